"""The chosen config as a batchlab TOML snippet, and the same settings for common trainers.

The TOML is one ``[config]`` table of RunConfig field names, read back by ``config.load_config_toml``
(every command's ``--config FILE``, and experiment files).  Torch-free.
"""
from __future__ import annotations

from typing import Any

from batchlab.config import (ACMode, Assumptions, ConfigError, ModelSpec, Precision, RunConfig,
                             preset, to_jsonable)


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
    model, assumptions = d.pop("model"), d.pop("assumptions")
    if _model_is_preset(cfg.model):
        d = {"model": cfg.model.name, **d}
    lines = _table("config", d)
    if not _model_is_preset(cfg.model):
        lines += [""] + _table("config.model", model)
    if cfg.assumptions != Assumptions():
        lines += [""] + _table("config.assumptions", assumptions)
    return "\n".join(lines) + "\n"


def _hf_ac(cfg: RunConfig) -> tuple[bool, str | None]:
    mode = cfg.ac.mode
    if mode is ACMode.NONE:
        return False, None
    if mode is ACMode.FULL:
        return True, None
    return True, (f"{cfg.ac} has no TrainingArguments switch: gradient_checkpointing=True recomputes every layer "
                  "(more compute than planned); wrap the chosen layers yourself to match")


def huggingface(cfg: RunConfig) -> dict[str, Any]:
    ac, note = _hf_ac(cfg)
    args: dict[str, Any] = {"per_device_train_batch_size": cfg.micro_batch,
                            "gradient_accumulation_steps": cfg.accum, "gradient_checkpointing": ac}
    if ac:
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if cfg.precision is Precision.BF16_MIXED:
        args["bf16"] = True
    elif cfg.precision is Precision.FP16_MIXED:
        args["fp16"] = True
    if cfg.zero == 1 and cfg.dp > 1:
        args["deepspeed"] = "ds_config.json"  # the DeepSpeed settings (ZeRO-1 has no FSDP equivalent)
    elif cfg.zero >= 2 and cfg.dp > 1:
        args["fsdp"] = "full_shard" if cfg.zero == 3 else "shard_grad_op"
    out = {"TrainingArguments": args, "launch": f"{cfg.dp} processes (torchrun --nproc-per-node ...)"}
    if note:
        out["note"] = note
    return out


def lightning(cfg: RunConfig) -> dict[str, Any]:
    strategy = {0: "ddp", 1: "deepspeed_stage_1", 2: "deepspeed_stage_2", 3: "fsdp"}[cfg.zero] if cfg.dp > 1 else "auto"
    precision = {Precision.FP32: "32-true", Precision.BF16_MIXED: "bf16-mixed", Precision.FP16_MIXED: "16-mixed",
                 Precision.BF16: "bf16-true", Precision.BF16_FSDP: "bf16-mixed"}[cfg.precision]
    out: dict[str, Any] = {"Trainer": {"accumulate_grad_batches": cfg.accum, "devices": cfg.dp,
                                       "strategy": strategy, "precision": precision},
                           "DataLoader": {"batch_size": cfg.micro_batch}}
    if cfg.ac.mode is not ACMode.NONE:
        out["note"] = f"activation checkpointing {cfg.ac}: Lightning has no switch; wrap the layers in the model"
    return out


def deepspeed(cfg: RunConfig) -> dict[str, Any]:
    ds: dict[str, Any] = {"train_micro_batch_size_per_gpu": cfg.micro_batch,
                          "gradient_accumulation_steps": cfg.accum, "train_batch_size": cfg.global_batch,
                          "zero_optimization": {"stage": cfg.zero}}
    if cfg.precision is Precision.BF16_MIXED:
        ds["bf16"] = {"enabled": True}
    elif cfg.precision is Precision.FP16_MIXED:
        ds["fp16"] = {"enabled": True}
    return ds


def _which_layers(cfg: RunConfig) -> str:
    n = cfg.model.layers
    if cfg.ac.mode is ACMode.FULL:
        return f"all {n} layers"
    if cfg.ac.mode is ACMode.SELECTIVE:
        return f"all {n} layers, attention core only (create_selective_checkpoint_contexts)"
    wrapped = cfg.ac.wrapped_layers(n)
    return f"layers 0, {cfg.ac.every}, {2 * cfg.ac.every}, ... ({len(wrapped)} of {n})"


def pytorch_loop(cfg: RunConfig) -> str:
    ac_line = ("# no activation checkpointing" if cfg.ac.mode is ACMode.NONE else
               f"# activation checkpointing {cfg.ac}: {_which_layers(cfg)} via "
               "torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)")
    return "\n".join([
        f"MICRO_BATCH, ACCUM, DP = {cfg.micro_batch}, {cfg.accum}, {cfg.dp}  "
        f"# global batch {cfg.global_batch} = {cfg.micro_batch} x {cfg.accum} x {cfg.dp}",
        ac_line,
        "loader = DataLoader(dataset, batch_size=MICRO_BATCH, sampler=DistributedSampler(dataset))",
        "for step, (x, y) in enumerate(loader):",
        "    last = (step + 1) % ACCUM == 0",
        "    with (contextlib.nullcontext() if last else model.no_sync()):  # one all-reduce per update",
        "        (loss_fn(model(x), y) / ACCUM).backward()",
        "    if last:",
        "        optimizer.step()",
        "        optimizer.zero_grad(set_to_none=True)",
    ])


def all_snippets(cfg: RunConfig) -> dict[str, Any]:
    return {"batchlab_toml": config_toml(cfg), "pytorch": pytorch_loop(cfg), "huggingface": huggingface(cfg),
            "lightning": lightning(cfg), "deepspeed": deepspeed(cfg)}
