"""The chosen config as a batchlab TOML snippet, and the same settings for the trainers people use.

The TOML is one ``[config]`` table of RunConfig field names, read back by ``config.load_config_toml``
(every command's ``--config FILE``, and experiment files).  The others are pasted into the user's own
stack: torchtitan TOML, an accelerate config (YAML), HF ``TrainingArguments(...)``, Lightning
``Trainer(...)``, DeepSpeed JSON, and a complete PyTorch script (``torch_script``).  Where a stack has no
switch for a setting, the snippet says so in a comment instead of guessing.  Torch-free.
"""
from __future__ import annotations

import json
import math
from typing import Any

from batchlab.advise.torch_script import training_script
from batchlab.config import (Applied, Assumptions, ConfigError, ModelSpec, Precision, RunConfig,
                             optimizer_spec, preset, to_jsonable)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _table(name: str, values: dict[str, Any]) -> list[str]:
    return [f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]


def _model_is_preset(m: ModelSpec) -> bool:
    try:
        return preset(m.name) == m
    except ConfigError:
        return False


def config_toml(cfg: RunConfig) -> str:
    """A ``[config]`` table (model as a preset name when it is one, else a ``[config.model]`` table)."""
    d = to_jsonable(cfg)
    d.pop("parallel")  # derived from the flat degrees written here
    model, assumptions = d.pop("model"), d.pop("assumptions")
    model.pop("profile", None)  # a cache of the model's traced layer terms, found again from the model's config
    if _model_is_preset(cfg.model):
        d = {"model": cfg.model.name, **d}
    lines = _table("config", d)
    if not _model_is_preset(cfg.model):
        lines += [""] + _table("config.model", model)
    if cfg.assumptions != Assumptions():
        lines += [""] + _table("config.assumptions", assumptions)
    return "\n".join(lines) + "\n"


def _whole_blocks(cfg: RunConfig) -> bool:
    """Every layer's whole block recomputed (``full``, or a plan of it): what a framework's one switch does."""
    single = cfg.ac.simplified().single
    return single is not None and single.applied is Applied.WHOLE_BLOCK


def _hf_ac(cfg: RunConfig) -> tuple[bool, str | None]:
    if not cfg.ac.recomputes:
        return False, None
    if _whole_blocks(cfg):
        return True, None
    if cfg.ac.every_k:
        # transformers 5 modeling_utils: layer_index % every_n_layers == 0, the layers batchlab's every:K wraps
        return True, (f"{cfg.ac}: transformers >= 5 takes activation_checkpointing=True, activation_checkpointing_"
                      f"kwargs={{'every_n_layers': {cfg.ac.every}}}; older versions recompute every layer")
    what = "a per-layer plan" if cfg.ac.layers else "it"
    return True, (f"{cfg.ac}: TrainingArguments cannot express {what}: gradient_checkpointing=True recomputes every "
                  "layer (more compute than planned); wrap the chosen layers yourself to match (the PyTorch script "
                  "fit prints does)")


def huggingface(cfg: RunConfig) -> dict[str, Any]:
    ac, note = _hf_ac(cfg)
    args: dict[str, Any] = {"per_device_train_batch_size": cfg.micro_batch,
                            "gradient_accumulation_steps": cfg.accum, "gradient_checkpointing": ac}
    if ac:
        # gradient_checkpointing works from 4.40 on; transformers 5 names it activation_checkpointing (alias kept)
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if cfg.precision is Precision.BF16_MIXED:
        args["bf16"] = True
    elif cfg.precision is Precision.FP16_MIXED:
        args["fp16"] = True
    opt = optimizer_spec(cfg.optimizer)
    if opt.hf_optim is not None:
        args["optim"] = opt.hf_optim
    else:
        note = f"{note}; " if note else ""
        note += f"optimizer {cfg.optimizer}: {opt.note}"
    if cfg.optimizer_in_backward:  # transformers' Trainer steps once per update, after backward
        note = (f"{note}; " if note else "") + ("no TrainingArguments steps the optimizer in backward: register "
                                               "post-accumulate-grad hooks as the printed PyTorch script does")
    if cfg.parallel.stage == 1:
        args["deepspeed"] = "ds_config.json"  # the DeepSpeed settings (ZeRO-1 has no FSDP equivalent)
    elif cfg.parallel.shards_gradients:
        args["fsdp"] = "full_shard" if cfg.parallel.reshards_after_forward else "shard_grad_op"
    out = {"TrainingArguments": args, "launch": f"{cfg.dp} processes (torchrun --nproc-per-node ...)"}
    if note:
        out["note"] = note
    return out


def _nodes(cfg: RunConfig) -> tuple[int, int]:
    """(devices per node, nodes) for ``cfg.dp`` ranks on the device's nodes."""
    per_node = min(cfg.dp, cfg.device_spec.gpus_per_node)
    return per_node, math.ceil(cfg.dp / per_node)


def lightning(cfg: RunConfig) -> dict[str, Any]:
    strategy = {0: "ddp", 1: "deepspeed_stage_1", 2: "deepspeed_stage_2", 3: "fsdp"}[cfg.zero] if cfg.dp > 1 else "auto"
    precision = {Precision.FP32: "32-true", Precision.BF16_MIXED: "bf16-mixed", Precision.FP16_MIXED: "16-mixed",
                 Precision.BF16: "bf16-true", Precision.BF16_FSDP: "bf16-mixed"}[cfg.precision]
    devices, nodes = _nodes(cfg)
    trainer = {"accumulate_grad_batches": cfg.accum, "devices": devices, "strategy": strategy, "precision": precision}
    if nodes > 1:
        trainer["num_nodes"] = nodes
    opt = optimizer_spec(cfg.optimizer)
    out: dict[str, Any] = {"Trainer": trainer, "DataLoader": {"batch_size": cfg.micro_batch},
                           "configure_optimizers": f"return {opt.torch_class}(self.parameters(){opt.script_kwargs})"}
    if cfg.ac.recomputes:
        out["note"] = (f"activation checkpointing {cfg.ac}: no Trainer switch; with FSDP, strategy=FSDPStrategy("
                       "activation_checkpointing_policy={YourBlock}) wraps every block; else wrap the layers in the model")
    return out


def deepspeed(cfg: RunConfig) -> dict[str, Any]:
    ds: dict[str, Any] = {"train_micro_batch_size_per_gpu": cfg.micro_batch,
                          "gradient_accumulation_steps": cfg.accum, "train_batch_size": cfg.global_batch,
                          "zero_optimization": {"stage": cfg.zero, **cfg.deepspeed.typed()},
                          "optimizer": {"type": optimizer_spec(cfg.optimizer).deepspeed_type,
                                        "params": dict(optimizer_spec(cfg.optimizer).kwargs)}}
    if cfg.precision is Precision.BF16_MIXED:
        ds["bf16"] = {"enabled": True}
    elif cfg.precision is Precision.FP16_MIXED:
        ds["fp16"] = {"enabled": True}
    return ds


def _comment(text: str) -> str:
    return f"# {text}"


def torchtitan_toml(cfg: RunConfig) -> str:
    """torchtitan's JobConfig tables (torchtitan/config/job_config.py: Training, Parallelism, ActivationCheckpoint).

    torchtitan derives accumulation itself: global_batch_size / (local_batch_size x data-parallel degree)."""
    notes = []
    shard = cfg.parallel.shards_optimizer
    parallel: dict[str, Any] = {"data_parallel_replicate_degree": 1 if shard else cfg.dp,
                                "data_parallel_shard_degree": cfg.dp if shard else 1}
    if shard and not cfg.parallel.shards_parameters:
        # reshard_after_forward=False keeps parameters gathered from forward to backward: ZeRO-2's memory
        parallel["fsdp_reshard_after_forward"] = "never"
        notes.append(f"ZeRO-{cfg.zero} has no torchtitan switch; FSDP2 with fsdp_reshard_after_forward = \"never\" "
                     "(ZeRO-2 memory) is the nearest")
    precision = {Precision.BF16_MIXED: "bfloat16", Precision.BF16_FSDP: "bfloat16",
                 Precision.FP32: "float32"}.get(cfg.precision)
    if precision is None:
        notes.append(f"precision {cfg.precision}: torchtitan's mixed_precision_param is bfloat16 or float32")
    single = cfg.ac.single
    ac: dict[str, Any] = {"mode": single.torchtitan[0] if single is not None else "selective"}
    if cfg.ac.budget is not None:  # torchtitan sets torch._functorch.config.activation_memory_budget from it
        ac = {"mode": "memory_budget", "memory_budget": cfg.ac.budget}
        notes.append("mode = \"memory_budget\" needs the model compiled: [compile] enable = true, components = "
                     "[\"model\"]")
    elif single is not None:  # the catalogue entry's torchtitan setting (config/acpolicies.py)
        if single.torchtitan[1] is not None:
            ac["selective_ac_option"] = single.torchtitan[1]
        if not single.torchtitan_exact:
            notes.append("selective_ac_option = \"op\" saves matmul and attention outputs by a policy of its own; "
                         "close to, not the same as, batchlab's selective")
    elif cfg.ac.every_k:
        ac["selective_ac_option"] = str(cfg.ac.every)
        notes.append(f"torchtitan wraps layers {cfg.ac.every}, {2 * cfg.ac.every}, ... counting from 1; batchlab's "
                     f"every:{cfg.ac.every} wraps 0, {cfg.ac.every}, ...: the same count when {cfg.model.layers} "
                     f"is a multiple of {cfg.ac.every}")
    else:  # a plan
        ac["mode"] = "full"
        notes.append(f"{cfg.ac}: torchtitan's activation_checkpoint applies one mode to every layer and cannot "
                     "express a per-layer plan; mode = \"full\" fits in memory with more recompute (the PyTorch "
                     "script applies the plan)")
    training = {"local_batch_size": cfg.micro_batch, "global_batch_size": cfg.global_batch, "seq_len": cfg.seq}
    if precision is not None:
        training["mixed_precision_param"] = precision
    lines = [_comment(cfg.global_batch_text()), _comment(f"accumulation = {cfg.global_batch} / ({cfg.micro_batch} x "
                                                          f"{cfg.dp}) = {cfg.accum}, derived by torchtitan")]
    lines += [_comment(n) for n in notes]
    lines += _table("training", training) + [""] + _table("parallelism", parallel) + [""]
    lines += _table("activation_checkpoint", ac)
    return "\n".join(lines) + "\n"


def _yaml(d: dict[str, Any], indent: int = 0) -> list[str]:
    """Block YAML for a flat-or-nested dict of str / int / bool (what an accelerate config holds)."""
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += [" " * indent + f"{k}:"] + _yaml(v, indent + 2)
        else:
            # strings quoted: YAML 1.1 reads a bare no / NO (accelerate's "no mixed precision") as false
            text = ("true" if v else "false") if isinstance(v, bool) else repr(v) if isinstance(v, str) else str(v)
            out.append(" " * indent + f"{k}: {text}")
    return out


def accelerate_yaml(cfg: RunConfig) -> str:
    """``accelerate launch --config_file`` (accelerate/commands/config/config_args.py ClusterConfig keys)."""
    devices, nodes = _nodes(cfg)
    d: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "num_processes": cfg.dp, "num_machines": nodes,
                         "machine_rank": 0, "mixed_precision": {Precision.BF16_MIXED: "bf16",
                                                                Precision.FP16_MIXED: "fp16"}.get(cfg.precision, "no"),
                         "use_cpu": False}
    if cfg.dp == 1:
        d["distributed_type"] = "NO"
    elif cfg.parallel.stage == 0:
        d["distributed_type"] = "MULTI_GPU"
    elif cfg.parallel.stage == 1:
        d["distributed_type"] = "DEEPSPEED"
        d["deepspeed_config"] = {"zero_stage": 1, "gradient_accumulation_steps": cfg.accum}
    else:
        d["distributed_type"] = "FSDP"
        d["fsdp_config"] = {"fsdp_version": 2, "fsdp_reshard_after_forward": cfg.parallel.reshards_after_forward,
                            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                            "fsdp_activation_checkpointing": cfg.ac.recomputes}
    lines = [_comment(cfg.global_batch_text()),
             _comment(f"micro-batch {cfg.micro_batch}: your DataLoader's batch_size; accumulation {cfg.accum}: "
                      f"Accelerator(gradient_accumulation_steps={cfg.accum})")]
    if cfg.ac.recomputes and not _whole_blocks(cfg):
        lines.append(_comment(f"activation checkpointing {cfg.ac}: accelerate switches it on for every layer only"))
    return "\n".join(lines + _yaml(d)) + "\n"


def all_snippets(cfg: RunConfig) -> dict[str, Any]:
    script = training_script(cfg)  # a per-layer plan as it is: the script wraps each layer with its policy
    cfg = cfg.replace(ac=cfg.ac.simplified())
    return {"batchlab_toml": config_toml(cfg), "pytorch": script, "huggingface": huggingface(cfg),
            "lightning": lightning(cfg), "deepspeed": deepspeed(cfg), "torchtitan_toml": torchtitan_toml(cfg),
            "accelerate_yaml": accelerate_yaml(cfg), "huggingface_code": call_code("TrainingArguments", huggingface(cfg)),
            "lightning_code": call_code("Trainer", lightning(cfg)), "deepspeed_json": json.dumps(deepspeed(cfg), indent=2)}


def call_code(name: str, snippet: dict[str, Any]) -> str:
    """``TrainingArguments(...)`` / ``Trainer(...)`` as Python to paste (keyword values as Python literals)."""
    kwargs = snippet[name]
    lines = [f"{name}("] + [f"    {k}={v!r}," for k, v in kwargs.items()] + [")"]
    if "DataLoader" in snippet:
        lines.append(f"DataLoader(dataset, batch_size={snippet['DataLoader']['batch_size']})  # micro-batch per device")
    if "configure_optimizers" in snippet:
        lines.append(f"# LightningModule.configure_optimizers: {snippet['configure_optimizers']}")
    if "launch" in snippet:
        lines.append(f"# launch: {snippet['launch']}")
    if "note" in snippet:
        lines.append(f"# note: {snippet['note']}")
    return "\n".join(lines)


TITLES = (("As a batchlab config (save as fit.toml; then batchlab measure --config fit.toml, or use it as an "
           "experiment file's [config])", "batchlab_toml"),
          ("PyTorch training script (single process / DDP / ZeroRedundancyOptimizer / FSDP2, tensor and pipeline "
           "parallelism as the config needs; "
           "runs as printed on a stand-in model: replace the part between the >>> and <<< lines with yours)",
           "pytorch"), ("torchtitan (TOML)", "torchtitan_toml"),
          ("accelerate config (YAML)", "accelerate_yaml"), ("Hugging Face", "huggingface_code"),
          ("Lightning", "lightning_code"), ("DeepSpeed config (JSON)", "deepspeed_json"))


def printable(cfg: RunConfig) -> list[tuple[str, str]]:
    """(title, text) for every snippet ``fit`` prints."""
    s = all_snippets(cfg)
    return [(title, s[key]) for title, key in TITLES]
