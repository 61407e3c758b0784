"""The chosen config as a complete PyTorch training script that runs as printed.

One script per config: plain single process at DP = 1; DDP at ZeRO-0; DDP + ``ZeroRedundancyOptimizer`` at
ZeRO-1; FSDP2 ``fully_shard`` per block at ZeRO-2 (``reshard_after_forward=False``) and ZeRO-3 (``True``).
Accumulation: DDP's ``no_sync()`` or FSDP2's ``set_requires_gradient_sync`` on all but the last micro-batch.
Activation checkpointing wraps the blocks ``ACPolicy.wrapped_layers`` names, as batchlab's harness does.
With tensor or pipeline parallelism (``tp`` / ``pp`` > 1) the mesh, the tensor-parallel plan, the pipeline stages
and schedule and the data dimension over them come from ``torch_script_parallel.py``; the stand-in's heads are a
multiple of tp.

The script builds a small stand-in model and random data between two marker lines (``STAND_IN_BEGIN`` /
``STAND_IN_END``) so it runs as printed; users replace that part with their own model (keeping
``model.layers``, the list of blocks), dataset and ``loss_fn``.  The text is self-contained: batchlab is
not imported by it.  Torch-free (this module only writes text).
"""
from __future__ import annotations

import math

from batchlab.advise import torch_script_parallel as parallel
from batchlab.config import AC_POLICIES, Applied, CompileMode, Precision, RunConfig, optimizer_spec

STAND_IN_BEGIN = "# >>> stand-in model, data and loss: replace with yours (keep model.layers, the list of blocks)"
STAND_IN_END = "# <<< end of the stand-in"
LR = 1e-4
# 16-bit compute dtype: autocast's, or FSDP2 MixedPrecisionPolicy's param_dtype under fully_shard
_AUTOCAST = {Precision.BF16_MIXED: "torch.bfloat16", Precision.FP16_MIXED: "torch.float16",
             Precision.BF16_FSDP: "torch.bfloat16"}

_STAND_IN = '''\
class Attention(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.proj = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape  # -1: the heads this rank holds (all, or heads / TP under tensor parallelism)
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, s, -1))


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1, self.attn, self.norm2 = torch.nn.LayerNorm(d), Attention(d, heads), torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class StandIn(torch.nn.Module):
    def __init__(self, layers, heads, vocab=256):
        super().__init__()
        d = 16 * heads
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.flatten(0, 1))  # (tokens, vocab)


model = StandIn(layers={layers}, heads={heads})  # {heads_why}
tokens = torch.randint(256, (MICRO_BATCH * ACCUM * DP * UPDATES, SEQ + 1))
dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loss_fn(logits, y):
    return torch.nn.functional.cross_entropy(logits.float(), y.flatten())
'''


# The selective policies as batchlab's harness runs them (models/ac.py), over aten ops
_OPS = '''\
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}  # a linear layer on a 2-D view
SDPA = {getattr(torch.ops.aten, n).default for n in (  # fused attention kernels (CUDA and CPU)
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(torch.ops.aten, n)}
'''
# the policies the script can print: each catalogue entry's (policy function, context_fn) (config/acpolicies.py)
_POLICIES = {m: (s.script_policy, s.script_context) for m, s in AC_POLICIES.items() if s.script_context}
# the policies that checkpoint one submodule of each block: the submodule's name
_BRANCHES = {m: s.branch for m, s in AC_POLICIES.items() if s.branch}


def _launch(cfg: RunConfig) -> list[str]:
    world = cfg.parallel.world_size  # dp x tp x pp processes
    if world == 1:
        return ["# launch: python train.py"]
    per_node = min(world, cfg.device_spec.gpus_per_node)
    nodes = math.ceil(world / per_node)
    if nodes == 1:
        return [f"# launch: python -m torch.distributed.run --standalone --nproc-per-node {world} train.py"]
    return [f"# launch on each of {nodes} nodes: python -m torch.distributed.run --nnodes {nodes} "
            f"--nproc-per-node {per_node} --rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py"]


def _strategy(cfg: RunConfig) -> str:
    if cfg.dp == 1:
        return "single process (DP = 1): no process group, no gradient synchronisation"
    return {0: "DDP: gradients all-reduced once per update",
            1: "ZeRO-1: DDP + ZeroRedundancyOptimizer (optimizer state sharded)",
            2: "ZeRO-2: FSDP2 fully_shard per block, reshard_after_forward=False (gradients + optimizer state "
               "sharded; parameters kept gathered from forward to backward)",
            3: "ZeRO-3: FSDP2 fully_shard per block, reshard_after_forward=True (parameters, gradients and "
               "optimizer state sharded)"}[cfg.zero]


def _fsdp(cfg: RunConfig) -> bool:
    return cfg.parallel.shards_gradients


def _imports(cfg: RunConfig) -> list[str]:
    out = ["import gc", "import os", "", "import torch", "import torch.distributed as dist"] if cfg.dp > 1 else ["import torch"]
    if cfg.dp > 1 and not _fsdp(cfg):
        out.insert(0, "import contextlib")
    if _fsdp(cfg):
        out += ["from torch.distributed.device_mesh import init_device_mesh",
                "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard"]
    elif cfg.dp > 1:
        out.append("from torch.nn.parallel import DistributedDataParallel as DDP")
        if cfg.parallel.stage == 1:
            out.append("from torch.distributed.optim import ZeroRedundancyOptimizer")
    if cfg.ac.budget is not None:  # torch.compile's partitioner settings: imported on their own
        out.append("import torch._functorch.config")
    if package := optimizer_spec(cfg.optimizer).package:  # the optimizer's class is named by its module path
        out.append(f"import {package}.optim")
    return out + _ac_imports(cfg) + [f"from torch.utils.data import {_samplers(cfg)}"]


def _ac_imports(cfg: RunConfig) -> list[str]:
    if cfg.ac.mode in _POLICIES or set(cfg.ac.layer_modes(cfg.model.layers)) & set(_POLICIES):
        return ["from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts"]
    return ["from torch.utils.checkpoint import checkpoint"] if cfg.ac.recomputes else []


def _samplers(cfg: RunConfig) -> str:
    return "DataLoader, TensorDataset" if cfg.dp == 1 else "DataLoader, DistributedSampler, TensorDataset"


_CHECKPOINTED = '''\
class Checkpointed(torch.nn.Module):
    """Activation checkpointing (recompute in backward): not the training checkpoint saved to disk."""

    def __init__(self, block, context_fn=None):
        super().__init__()
        self.block, self.context_fn = block, context_fn

    def forward(self, *args, **kwargs):
        # preserve_rng_state: dropout in the recompute draws the forward's mask (bitwise-equal gradients)
        extra = {"context_fn": self.context_fn} if self.context_fn is not None else {}
        return checkpoint(self.block, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)
'''


def _plan(cfg: RunConfig) -> list[str]:
    """A per-layer plan: each layer wrapped with its own policy (full: the whole block recomputed)."""
    modes = cfg.ac.layer_modes(cfg.model.layers)
    used = [m for m in _POLICIES if m in modes]
    branches = {m.value: _BRANCHES[m] for m in _BRANCHES if m in modes}
    out = ([_OPS] if used else []) + [_POLICIES[m][0] for m in used] + [_CHECKPOINTED]
    contexts = ", ".join(['"full": None'] + [f'"{m.value}": {_POLICIES[m][1]}' for m in used])
    out += [f"CONTEXTS = {{{contexts}}}  # selective checkpointing policy per plan entry"]
    if branches:
        out.append(f"BRANCHES = {branches!r}  # policies that checkpoint one submodule of the block")
    out += [f"PLAN = {[m.value for m in modes]!r}  # {cfg.ac}: one policy per layer, first layer first",
            "assert len(PLAN) == len(model.layers), (len(PLAN), len(model.layers))",
            "for i, policy in enumerate(PLAN):"]
    if branches:
        out += ["    if policy in BRANCHES:",
                "        setattr(model.layers[i], BRANCHES[policy], Checkpointed(getattr(model.layers[i], "
                "BRANCHES[policy])))",
                "    elif policy != \"none\":"]
    else:
        out.append("    if policy != \"none\":")
    out.append("        model.layers[i] = Checkpointed(model.layers[i], CONTEXTS[policy])")
    return out


def _checkpointing(cfg: RunConfig) -> list[str]:
    mode, n = cfg.ac.mode, cfg.model.layers
    if not cfg.ac.recomputes:
        return ["# activation checkpointing: none"]
    if cfg.ac.layers:
        return _plan(cfg)
    policy, context = _POLICIES.get(mode, ("", None))
    out = [_OPS, policy] if context else []
    out.append(_CHECKPOINTED)
    single = cfg.ac.single
    if cfg.ac.every_k:
        which = f"blocks 0, {cfg.ac.every}, {2 * cfg.ac.every}, ..."
    else:
        which = "every block recomputed" if single.applied is Applied.WHOLE_BLOCK else "a policy inside every block"
    step = f", {cfg.ac.every}" if cfg.ac.every_k else ""
    branch = _BRANCHES.get(mode)
    if branch:  # the submodule alone under checkpoint
        which = f"each block's {branch} recomputed"
        return out + [f"for layer in model.layers:  # {cfg.ac}: {which}; the config has {n} layers",
                      f"    layer.{branch} = Checkpointed(layer.{branch})"]
    out += [f"for i in range(0, len(model.layers){step}):  # {cfg.ac}: {which}; the config has {n} layers",
            f"    model.layers[i] = Checkpointed(model.layers[i]{', ' + context if context else ''})"]
    return out


def _compiling(cfg: RunConfig) -> list[str]:
    """torch.compile as --compile names it (after checkpointing, as torchtitan orders them), and budget:F's knob:
    torch.compile's partitioner reads it when each graph compiles (at its first call)."""
    if cfg.compile is CompileMode.NONE:
        return []
    out = [""]
    if cfg.ac.budget is not None:
        out += [f"# {cfg.ac}: of what each compiled graph saves beyond its inputs, at most this fraction is kept",
                f"torch._functorch.config.activation_memory_budget = {cfg.ac.budget:g}"]
    if cfg.compile is CompileMode.BLOCKS:
        return out + ["for layer in model.layers:  # --compile blocks: each block on its own", "    layer.compile()"]
    return out + ["model.compile()  # --compile model: the whole model, one compiled module"]


def _devices(cfg: RunConfig) -> list[str]:
    if cfg.dp == 1:
        return ['device = torch.device("cuda" if torch.cuda.is_available() else "cpu")', "rank = 0"]
    return ['dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # torchrun sets rank, world',
            "rank = dist.get_rank()",
            "if dist.get_world_size() != DP:",
            '    raise SystemExit(f"this config is for DP = {DP} processes; launched {dist.get_world_size()}")',
            "if torch.cuda.is_available():",
            '    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))',
            "    torch.cuda.set_device(device)",
            "else:",
            '    device = torch.device("cpu")']


def _optimizer_class(cfg: RunConfig) -> tuple[str, str]:
    """(class, extra keyword arguments) for cfg.optimizer, from its catalogue entry."""
    spec = optimizer_spec(cfg.optimizer)
    return spec.torch_class, spec.script_kwargs


def _wrap(cfg: RunConfig) -> list[str]:
    cls, kw = _optimizer_class(cfg)
    out = []
    if cfg.precision is Precision.BF16:
        out.append("model.to(torch.bfloat16)  # pure bf16: weights, gradients and optimizer state")
    out.append("model.to(device)")
    if _fsdp(cfg):
        param = _AUTOCAST.get(cfg.precision)
        mp = (f"MixedPrecisionPolicy(param_dtype={param}, reduce_dtype=torch.float32)" if param else
              "MixedPrecisionPolicy()")
        reshard = cfg.parallel.reshards_after_forward
        out += ["mesh = init_device_mesh(device.type, (DP,))", f"mp = {mp}",
                "for block in model.layers:",
                f"    fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward={reshard})",
                f"fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward={reshard})",
                f"optimizer = {cls}(model.parameters(), lr={LR}{kw})  # after fully_shard: sharded state"]
    elif cfg.dp > 1:
        out.append('model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, '
                   "gradient_as_bucket_view=True)")
        if cfg.parallel.stage == 1:
            out.append(f"optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class={cls}, "
                       f"lr={LR}{kw})")
        else:
            out.append(f"optimizer = {cls}(model.parameters(), lr={LR}{kw})")
    elif cfg.optimizer_in_backward:  # torchtune optimizer_in_bwd (training/memory.py register_optim_in_bwd_hooks)
        out += ["# the optimizer step fused into backward: one optimizer per parameter, stepped as soon as its",
                "# gradient is accumulated, which is then freed (no moment holds every gradient)",
                f"optimizers = {{p: {cls}([p], lr={LR}{kw}) for p in model.parameters()}}", "",
                "def step_in_backward(p):", "    optimizers[p].step()", "    optimizers[p].zero_grad(set_to_none=True)", "",
                "for p in model.parameters():", "    p.register_post_accumulate_grad_hook(step_in_backward)"]
    else:
        out.append(f"optimizer = {cls}(model.parameters(), lr={LR}{kw})")
    if cfg.precision is Precision.FP16_MIXED:
        out.append("scaler = torch.amp.GradScaler(device.type)  # fp16: dynamic loss scaling")
    return out


def _loader(cfg: RunConfig) -> list[str]:
    if cfg.dp == 1:
        return ["loader = DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=True, drop_last=True,",
                "                    generator=torch.Generator().manual_seed(0))  # a seeded order"]
    return ["sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)  # each rank its own share",
            "sampler.set_epoch(0)  # once per epoch: a new shuffle",
            "loader = DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)"]


def _step(cfg: RunConfig) -> list[str]:
    """Forward (under autocast where mixed and not FSDP2, whose policy casts) and backward of one micro-batch."""
    autocast = _AUTOCAST.get(cfg.precision)
    forward = ["loss = loss_fn(model(x), y) / ACCUM"]
    if autocast and not _fsdp(cfg):
        forward = [f"with torch.autocast(device.type, dtype={autocast}):", "    " + forward[0]]
        if cfg.precision is Precision.BF16_FSDP:  # its MixedPrecisionPolicy needs fully_shard (ZeRO-2/3, DP > 1)
            forward.insert(0, "# bf16-fsdp without fully_shard: autocast is the nearest (its residual stays fp32)")
    backward = "scaler.scale(loss).backward()" if cfg.precision is Precision.FP16_MIXED else "loss.backward()"
    return forward + [backward]


def _loop(cfg: RunConfig) -> list[str]:
    out = ["for step, (x, y) in enumerate(loader):", "    x, y = x.to(device), y.to(device)",
           "    last = (step + 1) % ACCUM == 0  # the last micro-batch of an update"]
    step = _step(cfg)
    if _fsdp(cfg):
        out += ["    # reduce-scatter on the last micro-batch only (unsharded gradients kept until then)",
                "    model.set_requires_gradient_sync(last)"] + ["    " + line for line in step]
    elif cfg.dp > 1:  # backward inside no_sync: the all-reduce is skipped for all but the last micro-batch
        out += ["    with contextlib.nullcontext() if last else model.no_sync():  # one all-reduce per update"]
        out += ["        " + line for line in step]
    else:
        out += ["    " + line for line in step]
    out.append("    if last:")
    if cfg.optimizer_in_backward:
        out.append("        # every parameter stepped during backward")
    elif cfg.precision is Precision.FP16_MIXED:
        out += ["        scaler.step(optimizer)", "        scaler.update()"]
    else:
        out.append("        optimizer.step()")
    out += ["        optimizer.zero_grad(set_to_none=True)"] if not cfg.optimizer_in_backward else []
    out += ["        if rank == 0:",
            '            print(f"update {(step + 1) // ACCUM}: loss {loss.item() * ACCUM:.4f}", flush=True)']
    if cfg.dp > 1:
        # the DDP reducer and ZeroRedundancyOptimizer hold gloo work: freed while the group lives, or a rank can
        # abort in interpreter teardown with SIGABRT (docs/cpu.md, "Figures behind the code's choices")
        out += ["del model, optimizer", "gc.collect()", "dist.destroy_process_group()"]
    return out


def training_script(cfg: RunConfig) -> str:
    """A complete script for ``cfg`` (DP, TP, PP, ZeRO stage, accumulation, checkpointing, precision, optimizer)."""
    layered = parallel.applies(cfg)
    if layered and parallel.unsupported(cfg):
        return f"# {cfg.global_batch_text()}\n# no PyTorch script: {parallel.unsupported(cfg)}\n"
    heads = parallel.stand_in_heads(cfg)
    why = ("heads: a multiple of TP (each tensor-parallel rank computes heads / TP whole heads)" if cfg.tp > 1 else
           "a small stand-in")
    head = [f"# {cfg.global_batch_text()}", f"# {parallel.strategy(cfg) if layered else _strategy(cfg)}",
            *_launch(cfg)]
    consts = [f"MICRO_BATCH, ACCUM, DP, SEQ = {cfg.micro_batch}, {cfg.accum}, {cfg.dp}, {cfg.seq}",
              *(parallel.consts(cfg) if layered else []),
              "UPDATES = 2  # optimizer updates the stand-in data lasts",
              "torch.manual_seed(0)  # the same stand-in weights and data on every rank"]
    body = [STAND_IN_BEGIN, _STAND_IN.format(layers=cfg.model.layers, heads=heads, heads_why=why), STAND_IN_END, ""]
    if not layered:
        parts = [head, _imports(cfg), [""], consts, [""], body, _checkpointing(cfg), _compiling(cfg), [""],
                 _devices(cfg), _wrap(cfg), _loader(cfg), [""], _loop(cfg)]
    else:  # tensor parallelism on the plain blocks, then checkpointing, then the pipeline cut and the DP dimension
        cls, kw = _optimizer_class(cfg)
        half = _AUTOCAST.get(cfg.precision)
        imports = parallel.imports(cfg) + _ac_imports(cfg) + [f"from torch.utils.data import {_samplers(cfg)}"]
        tp = parallel.tensor_parallel(cfg) + ([""] if cfg.tp > 1 else [])
        optimizer = f"{cls}(PARAMS, lr={LR}{kw})"
        parts = [head, imports, [""], consts, [""], body, parallel.devices(cfg), [""], tp, _checkpointing(cfg), [""],
                 parallel.pipeline(cfg), parallel.wrap(cfg, half, optimizer), parallel.loader(cfg), [""],
                 parallel.loop(cfg, half, _step(cfg))]
    return "\n".join(line for part in parts for line in part) + "\n"
