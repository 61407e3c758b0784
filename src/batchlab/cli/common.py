"""Options shared by every command that takes a config, and the one place they become a RunConfig."""
from __future__ import annotations

import functools
import inspect
import json
import sys
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterable, NoReturn, Optional

import typer

from batchlab.config import (AC_POLICIES, Assumptions, ConfigError, ModelSource, OptimizerKind, RunConfig, derive_accum, load_config_toml,
                             model_from_hf_config, parse_bytes, resolve_model)
from batchlab.cache.profiles import attach_cached
from batchlab.formula.profile import missing, needed, profiled_precision

AC_HELP = ("Activation checkpointing: none, full, every:K (= torchtitan selective-layer:K), "
           + "".join(f"{m} ({s.label}), " for m, s in AC_POLICIES.items() if s.selective) +
           "or a per-layer plan: 'plan:full*2,selective*4,none*2' (POLICY or POLICY*N per run of layers, first layer "
           "first, covering every layer; quote it in a shell) or plan:FILE (.json/.toml with per_layer, as fit "
           "writes it); batchlab fit takes auto: the cheapest plan that fits the memory; with --compile, budget:F "
           "(torch.compile's activation_memory_budget, 0 <= F <= 1). "
           "Recomputes activations during backward "
           "to save memory inside one step (trades compute for memory). NOT the training checkpoint saved to disk.")

# name -> (annotation, default, help).  Flags are the names with dashes (--micro-batch); --change/--vary
# use the same names with underscores.
CONFIG_OPTIONS: dict[str, tuple[Any, Any, str]] = {
    "config": (Optional[str], None, "TOML file with a \\[config] table (as `batchlab fit` prints); the flags you "
                                    "type override it."),
    "model": (str, "tiny", "Preset (tiny, small, gpt2, llama-2-7b, ...), hf:NAME_OR_CONFIG.json, or package.module:factory."),
    "hf_config": (Optional[str], None, "A Hugging Face config.json (or its directory): the same as --model hf:FILE."),
    "layers": (Optional[int], None, "Override: number of transformer layers."),
    "hidden": (Optional[int], None, "Override: hidden size h."),
    "heads": (Optional[int], None, "Override: attention heads a."),
    "kv_heads": (Optional[int], None, "Override: key/value heads (GQA)."),
    "ffn": (Optional[int], None, "Override: MLP inner size."),
    "vocab": (Optional[int], None, "Override: vocabulary size V."),
    "max_positions": (Optional[int], None, "Override: the longest sequence the model takes (its learned position "
                                           "table's length)."),
    "mlp": (Optional[str], None, "Override: gelu or swiglu."),
    "norm": (Optional[str], None, "Override: layernorm or rmsnorm."),
    "dropout": (Optional[float], None, "Override: dropout probability (0 = off)."),
    "attention": (Optional[str], None, "Override: eager (s x s scores kept) or sdpa (fused, no s^2 term)."),
    "impl": (Optional[str], None, "Whose code a preset's layer terms count: hf (transformers; the llama-* and "
                                  "gpt2* default), torchtitan (its Llama), nanogpt, batchlab (its own GPT), or megatron "
                                  "(Megatron-LM's layer; measured runs use batchlab's GPT in its place)."),
    "use_cache": (Optional[bool], None, "transformers' use_cache: its training forward builds a KV cache "
                                        "(DynamicCache). Default: the model config's (on); off under --ac."),
    "seq": (int, 128, "Sequence length s (tokens per sample)."),
    "micro_batch": (Optional[int], None, "Micro-batch b: sequences per forward/backward on one rank (default 8)."),
    "accum": (Optional[int], None, "Gradient-accumulation steps per optimizer update (default 1)."),
    "global_batch": (Optional[int], None, "Global batch (sequences per update); accum is derived from it."),
    "dp": (int, 1, "Data-parallel world size."),
    "precision": (str, "fp32", "fp32, bf16-mixed (autocast), fp16-mixed, bf16, or bf16-fsdp (FSDP2 "
                               "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); formula only)."),
    "optimizer": (str, "adamw", ", ".join(k.value for k in OptimizerKind) + " (the optimizer catalogue)."),
    "optimizer_bytes": (Optional[float], None, "Optimizer state bytes per parameter (overrides --optimizer's)."),
    "ac": (str, "none", AC_HELP),
    "loss": (str, "full", "Loss path: full (F.cross_entropy on all logits), chunked[:N] (N checkpointed token "
                          "chunks, default 8), fused (a fused cross-entropy kernel; Megatron's --cross-entropy-loss-fusion "
                          "under --impl megatron), fused-linear (LM head + loss in one chunked kernel, Liger's), compiled "
                          "(the full loss under torch.compile) or classifier (no LM head: a pooled sequence classifier); "
                          "the last four formula only."),
    "zero": (int, 0, "ZeRO stage 0-3 over the DP ranks: 0 DDP, 1 + ZeroRedundancyOptimizer, 2 FSDP2 "
                     "reshard_after_forward=False, 3 FSDP2 full sharding."),
    "sharding": (Optional[str], None, "The data-parallel engine (sets the --zero stage): ddp, zero1, fsdp-grad-op "
                                      "(ZeRO-2), fsdp (ZeRO-3), deepspeed-zero1/2/3 (formula only: DeepSpeed's "
                                      "own buffers), or megatron / megatron-distopt (formula only: Megatron-Core's "
                                      "fp32 gradient buffer and main params; distopt shards them as ZeRO-1)."),
    "tp": (int, 1, "Tensor-parallel degree (Megatron's column/row split; divides heads, kv-heads and ffn). World "
                   "size = dp x tp x pp; tp does not multiply the global batch."),
    "sequence_parallel": (bool, False, "With --tp: split norms and dropouts along the sequence too."),
    "tp_overlap": (str, "none", "With --sequence-parallel: none, or async (each all-gather / reduce-scatter decomposed "
                                "and overlapped with its GEMM: torchtitan's AsyncTP, NeMo's tp_comm_overlap; formula "
                                "only)."),
    "pp": (int, 1, "Pipeline-parallel stages (divides the layers); accum = micro-batches per update per pipeline."),
    "pp_schedule": (str, "1f1b", "Pipeline schedule: gpipe, 1f1b or interleaved-1f1b."),
    "pp_virtual": (int, 1, "Model chunks per pipeline rank (interleaved-1f1b)."),
    "device": (str, "cpu", "Device: cpu, local (this machine's GPU, else cpu), h100-sxm, h200, a100-40gb, a100-80gb, "
                           "l40s, mi300x, or custom:mem=80GB,tflops=400,..."),
    "memory_budget": (Optional[str], None, "Memory per rank, e.g. 2GiB (replaces the device's; on CPU a tracked-bytes budget)."),
    "data": (str, "fixed", "fixed (full-length sequences) or padded (variable lengths, padding not counted as useful)."),
    "seed": (int, 0, "Seed for weights and synthetic data."),
    "compile": (str, "none", "torch.compile: none, model (the whole model) or blocks (each transformer block after "
                             "AC wrapping, as torchtitan). Measured with inductor; traced by AOTAutograd's min-cut "
                             "partitioner on fake tensors (estimate --trace); the formula does not model it yet."),
    "fp8": (str, "none", "FP8 GEMMs in the blocks' linear layers (formula only; a device with FP8 tensor cores): "
                         "none, tensorwise, tensorwise-allgather (FSDP2's fp8 all-gather) or rowwise (torchao "
                         "Float8Linear), te (Transformer Engine)."),
    "optimizer_in_backward": (bool, False, "Step each parameter in its post-accumulate-grad hook and free its "
                                           "gradient at once (torchtune optimizer_in_bwd): needs --accum 1, one rank."),
    "offload_activations": (bool, False, "Saved activations to host memory in forward, back in backward on a side "
                                         "stream (torchtune enable_activation_offloading; formula only, GPU devices)."),
    "deepspeed": (Optional[str], None, "With --sharding deepspeed-zero*: the ds_config's zero_optimization sizes as "
                                       "KEY=VALUE,... (elements, or auto as HF's Trainer fills it); hf-auto: the "
                                       "bucket sizes and persistence threshold at auto."),
    "achievable_fraction": (Optional[float], None, "Fraction of peak FLOP/s kernels reach (default: the device's "
                                                   "published figure, named in the assumptions)."),
    "comm_overlap": (Optional[float], None, "Fraction of communication hidden behind compute (default: the "
                                            "engine's model: DDP buckets, FSDP prefetch)."),
}
VERBOSE_HELP = ("Also print what the default view leaves out: the assumptions (time model, communication, allocator), "
                "where each figure's inputs come from (device sources, calibration, per-kernel rates) and long notes. "
                "--json and the report always hold all of it.")
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help=VERBOSE_HELP)]
MODEL_OVERRIDES = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_positions", "mlp", "norm", "dropout",
                   "attention", "impl", "use_cache")


def build_config(given: set[str] | None = None, **o: Any) -> RunConfig:
    """Turn the shared options into a validated RunConfig (raises ConfigError naming the field).

    With ``config`` (a TOML file) the file is the base and the flags named in ``given`` (typed on the command
    line; default: those whose value differs from the default) override it.  An hf: model gets its cached layer
    profile only: a command traces what it lacks (``with_layer_profile``) once its own options are checked, so a
    mistyped option fails at once, not after seconds of tracing.
    """
    if not o.get("config"):
        return attach_cached(_config_from_flags(**o))
    base = load_config_toml(o["config"])
    if given is None:
        given = {k for k, (_, default, _) in CONFIG_OPTIONS.items() if k != "config" and o.get(k, default) != default}
    # merge first, validate once: the typed flags are raw values applied to the file's config in one replace,
    # so --seq is checked against the file's model, not the flags' default one
    return attach_cached(base.replace(**_typed_changes(base, given, o)))


def _typed_changes(base: RunConfig, given: set[str], o: dict[str, Any]) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    if given & {"model", "hf_config"}:
        changes["model"], changes["model_source"] = _model_from_flags(o)
    else:
        changes.update({k: o[k] for k in MODEL_OVERRIDES if k in given})
    changes.update({k: o[k] for k in RUN_FLAGS if k in given})
    if "memory_budget" in changes:
        changes["memory_budget"] = parse_bytes("memory_budget", changes["memory_budget"])
    if "sharding" in given:
        changes["sharding"] = o["sharding"]
        changes["zero"] = o["zero"] if "zero" in given else 0  # the engine's stage; a typed --zero must agree
    if "global_batch" in given:  # the file's micro-batch and DP unless typed
        changes["accum"] = _accum_for(o["global_batch"], changes.get("micro_batch", base.micro_batch),
                                      changes.get("dp", base.dp), changes.get("accum"))
    changes.update({k: o[k] for k in ("achievable_fraction", "comm_overlap") if k in given})
    if "optimizer_bytes" in given:
        changes["optimizer_bytes_per_param"] = o["optimizer_bytes"]
    return changes


def _model_from_flags(o: dict[str, Any]):
    """(ModelSpec, model_source) from --model / --hf-config and the shape overrides."""
    overrides = {k: o.get(k) for k in MODEL_OVERRIDES}
    if o.get("hf_config"):
        # one path for a config.json: the HF model's own code, as --model hf:FILE
        return model_from_hf_config(o["hf_config"], "hf_config", **overrides), f"hf:{o['hf_config']}"
    return resolve_model("tiny" if o.get("model") is None else o["model"], **overrides)  # "" is an error


def with_layer_profile(cfg: RunConfig, also: Iterable[RunConfig] = ()) -> RunConfig:
    """An hf: model's layer profile attached (cached: no torch; first use: traced now, a few seconds), so
    the calculator describes the model's own code.  ``also``: the configs derived from cfg the command will
    evaluate (--vary rows, compare's sides, fit's candidates); the profile is made to cover them too, their
    layer policies, precisions and sequence regimes, so no row falls back to the builtin terms."""
    if cfg.model_kind is not ModelSource.HF:  # the builtin GPT's terms are the calculator's own
        return cfg
    cfg = attach_cached(cfg)
    for there, policies in _to_cover(cfg, also):
        cfg = _traced(cfg, there, policies)
    return cfg


def _to_cover(cfg: RunConfig, also: Iterable[RunConfig]) -> list[tuple[RunConfig, frozenset[str]]]:
    """(a config at each precision and regime, the layer policies the configs there need), for those of the
    same model as cfg (a config of another shape has another profile: its estimate says so)."""
    groups: dict[tuple, tuple[RunConfig, set[str]]] = {}
    for c in (cfg, *also):
        if c.model_source != cfg.model_source or c.model.shape_id() != cfg.model.shape_id():
            continue
        window = c.model.sliding_window
        at = (profiled_precision(c.precision), window is not None and c.seq >= window)
        groups.setdefault(at, (c, set()))[1].update(needed(c))
    return [(c, frozenset(p)) for c, p in groups.values()]


def _traced(cfg: RunConfig, there: RunConfig, policies: frozenset[str]) -> RunConfig:
    """cfg with its profile covering ``policies`` at the precision and regime of ``there`` (cfg's model)."""
    there = there.replace(model=there.model.with_profile(cfg.model.matching_profile))
    todo = missing(there, policies)
    if not todo:
        return cfg
    try:
        from batchlab.trace.profile import with_profile
    except ImportError as e:  # the calculator alone installed: tracing needs torch and transformers
        typer.echo(f"warning: no layer profile (tracing the model's own code needs torch and transformers: {e}); "
                   "the calculator uses its built-in layer terms", err=True)
        return cfg
    typer.echo(f"profiling {cfg.model_source}'s layers ({there.precision}, layer policies {', '.join(sorted(todo))}) "
               "on fake tensors (once; cached) ...", err=True)
    try:
        profile = with_profile(there, policies).model.profile
    except ConfigError as e:
        typer.echo(f"warning: no layer profile ({e}); the calculator uses its built-in layer terms", err=True)
        return cfg
    return cfg.replace(model=cfg.model.with_profile(profile))


def with_goal_profile(goal, after_oom: bool = False):
    """goal with its base's layer profile covering every config the planner evaluates and, ``after_oom``, every
    change the advice proposes (advise/: ``searched_configs``, ``advised_configs``)."""
    import dataclasses

    from batchlab.advise.after_oom import advised_configs
    from batchlab.advise.plan import searched_configs

    also = searched_configs(goal) + (advised_configs(goal) if after_oom else [])
    return dataclasses.replace(goal, base=with_layer_profile(goal.base, also))


RUN_FLAGS = ("seq", "micro_batch", "accum", "dp", "precision", "optimizer", "ac", "loss", "zero", "device", "memory_budget",
             "data", "seed", "tp", "sequence_parallel", "tp_overlap", "pp", "pp_schedule", "pp_virtual", "compile", "fp8",
             "optimizer_in_backward", "offload_activations", "deepspeed")


def _accum_for(global_batch: int, micro_batch: int, dp: int, accum: int | None) -> int:
    """accum from --global-batch; a --accum typed beside it must agree."""
    derived = derive_accum(global_batch, micro_batch, dp)
    if accum is not None and accum != derived:
        raise ConfigError("accum", f"--accum {accum} contradicts --global-batch {global_batch} = "
                                   f"{micro_batch} x accum x {dp}")
    return derived


def _config_from_flags(**o: Any) -> RunConfig:
    spec, source = _model_from_flags(o)
    mb, accum, gb, dp = o.get("micro_batch"), o.get("accum"), o.get("global_batch"), o.get("dp", 1)
    if gb is not None:
        if mb is None:  # the optimizer stepping in backward accumulates nothing: the rank's batch is one micro-batch
            mb = max(1, gb // dp) if o.get("optimizer_in_backward") and accum is None else 1
        accum = _accum_for(gb, mb, dp, accum)
    budget = o.get("memory_budget")
    given = {k: o[k] for k in ("seq", "precision", "optimizer", "ac", "loss", "zero", "device", "data", "seed", "tp",
                               "sequence_parallel", "tp_overlap", "pp", "pp_schedule", "pp_virtual", "sharding", "compile", "fp8",
                               "optimizer_in_backward", "offload_activations", "deepspeed")
             if o.get(k) is not None}
    default = Assumptions()
    assumptions = Assumptions(achievable_fraction=o.get("achievable_fraction", default.achievable_fraction),
                              comm_overlap=o.get("comm_overlap", default.comm_overlap),
                              optimizer_bytes_per_param=o.get("optimizer_bytes"))
    return RunConfig(model=spec, model_source=source, micro_batch=8 if mb is None else mb,
                     accum=1 if accum is None else accum, dp=dp,
                     memory_budget=parse_bytes("memory_budget", budget) if budget is not None else None,
                     assumptions=assumptions, **given)


@dataclass(frozen=True)
class CommandLine:
    """What a command reads of its own command line besides the config (``with_config`` passes it to a command
    that has a ``line`` parameter)."""

    typed: frozenset[str] = frozenset()  # the shared config options typed (not defaults): held, or conflicting
    ac_auto: bool = False  # --ac auto (fit's planner; the config gets none meanwhile)
    # fit --world-size: asked of the layouts searched, not of the one-device base config
    sequence_parallel: bool = False
    pp_virtual: int = 1
    tp_overlap: str = "none"


def takes_ac_auto(fn: Callable) -> Callable:
    """Mark a command (below ``with_config``) as accepting ``--ac auto``."""
    fn.takes_ac_auto = True
    return fn


def searches_layouts(fn: Callable) -> Callable:
    """Mark a command (below ``with_config``) whose ``--world-size`` searches layouts: --sequence-parallel and
    --pp-virtual then go to its ``line``, not to the base config (one device: no TP or PP ranks to split over)."""
    fn.searches_layouts = True
    return fn


def _layout_asks(fn: Callable, kwargs: dict[str, Any], config_kwargs: dict[str, Any], typed: set[str]) -> dict:
    if not getattr(fn, "searches_layouts", False) or kwargs.get("world_size") is None:
        return {}
    asks = {k: config_kwargs[k] for k in ("sequence_parallel", "pp_virtual", "tp_overlap") if k in typed}
    config_kwargs.update({k: CONFIG_OPTIONS[k][1] for k in asks})
    typed -= set(asks)
    return asks


def _auto_ac(fn: Callable, config_kwargs: dict[str, Any], typed: set[str]) -> bool:
    if str(config_kwargs.get("ac") or "").strip().lower() != "auto":
        return False
    if not getattr(fn, "takes_ac_auto", False):
        raise ConfigError("ac", "auto is batchlab fit's planner; here give a policy or the plan fit wrote: "
                                "plan:FILE or plan:POLICY*N,...")
    config_kwargs["ac"] = "none"
    typed.discard("ac")
    return True


def with_config(fn: Callable) -> Callable:
    """Give a typer command every shared config option; it receives ``cfg: RunConfig`` instead.

    The command's own parameters keep their place; ``--json`` is added too and passed as ``as_json``; a ``line``
    parameter receives the command line's ``CommandLine``.
    """
    # resolve string annotations (modules using `from __future__ import annotations`), or typer would see
    # strings and drop each option's help and bounds
    hints = typing.get_type_hints(fn, include_extras=True)
    own = [p.replace(annotation=hints.get(p.name, p.annotation))
           for p in inspect.signature(fn).parameters.values() if p.name not in ("cfg", "as_json", "line")]
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                annotation=Annotated[ann, typer.Option(help=help_, rich_help_panel="Configuration")])
              for name, (ann, default, help_) in CONFIG_OPTIONS.items()]
    json_param = inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, default=False,
                                   annotation=Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")])

    ctx_param = inspect.Parameter("batchlab_ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)

    wants_line = "line" in inspect.signature(fn).parameters

    @functools.wraps(fn)
    def wrapper(**kwargs):
        ctx = kwargs.pop("batchlab_ctx")
        config_kwargs = {k: kwargs.pop(k) for k in CONFIG_OPTIONS}
        typed = _typed_in(ctx)
        try:
            asks = _layout_asks(fn, kwargs, config_kwargs, typed)
            line = CommandLine(ac_auto=_auto_ac(fn, config_kwargs, typed), typed=frozenset(typed), **asks)
            cfg = build_config(given=typed, **config_kwargs)
            for w in config_warnings(cfg):
                typer.echo(f"warning: {w}", err=True)
            if wants_line:
                kwargs["line"] = line
            return fn(cfg=cfg, as_json=kwargs.pop("as_json"), **kwargs)
        except ConfigError as e:
            fail(str(e))

    wrapper.__signature__ = inspect.Signature(own + shared + [json_param, ctx_param])
    return wrapper


def _typed_in(ctx) -> set[str]:
    """The shared config options the user typed (not defaults) in a click context."""
    return {k for k in CONFIG_OPTIONS if (src := ctx.get_parameter_source(k)) is not None
            and src.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")}


def config_from_command(argv: Iterable[str]) -> RunConfig:
    """The RunConfig ``batchlab COMMAND ARGS...`` builds (``argv`` = [COMMAND, *ARGS]), parsed by the command's own
    options exactly as when typed (click through typer, then build_config); nothing runs, nothing is traced."""
    import typer.main

    from batchlab.cli import load_commands

    name, *args = list(argv)
    command = typer.main.get_command(load_commands([name])).commands[name]
    try:
        ctx = command.make_context(name, args)
    except typer.exceptions.TyperException as e:  # an option the command has not, a value it refuses
        raise ConfigError(name, e.format_message()) from None
    return build_config(given=_typed_in(ctx), **{k: ctx.params[k] for k in CONFIG_OPTIONS})


def config_warnings(cfg: RunConfig) -> list[str]:
    """Assumptions the config made silently that change its figures."""
    from batchlab.config import Precision
    from batchlab.config.devices import CUSTOM_FP32_ASSUMED
    from batchlab.util.units import fmt_count

    spec, lay = cfg.device_spec, cfg.parallel
    out = [f"ignored: {w}" for w in cfg.deepspeed.ignored(lay.engine_spec.stage, lay.dp)]
    if spec.source == CUSTOM_FP32_ASSUMED and cfg.precision is Precision.FP32:
        out.append(f"--device {cfg.device}: no fp32_tflops= given; fp32 training assumed at tflops/8 = "
                   f"{fmt_count(spec.peak_flops_fp32, 'FLOP/s')} (add fp32_tflops=N to the device to set it)")
    return out


def console():
    """The terminal's width on a terminal; 120 columns when piped or redirected (rich's 80 wraps our tables)."""
    import os

    from rich.console import Console

    return Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=120)


def print_json(obj: Any) -> None:
    from batchlab.config import to_jsonable

    json.dump(to_jsonable(obj), sys.stdout, indent=2)
    sys.stdout.write("\n")


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr and the exit code; no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
