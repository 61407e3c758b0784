"""The one run configuration shared by the calculator, the harness, experiments and the advisor.

    choices   the closed sets (enums whose values are what users type) and ConfigError
    values    single-value checks and parsers: whole numbers, sizes, files
    model     ModelSpec (a decoder-only transformer's shape) and the published presets
    devices   the device catalogue (data) and its lookup (aliases, custom:..., local)
    acpolicies  the activation-checkpointing policy catalogue: what each keeps, recomputes, how it is applied and spelt
    optimizers  the optimizer catalogue: state, step ops, torch class, framework spellings per optimizer
    run       ACPolicy, Assumptions, RunConfig (frozen, validated) and the serialiser
    batch     the global-batch rules of a one-variable change (keep_global_batch, apply_change)
    load      configs from user text: field values, dicts, TOML tables and files, HF config.json, --model

Pure Python: importing this package never imports torch (the calculator runs where torch is absent).
Sizes are bytes, times seconds, rates per second; GiB appears only in display code.
"""
from batchlab.config.batch import BATCH_FIELDS, apply_change, keep_global_batch
from batchlab.config.acpolicies import AC_POLICIES, ACMode, ACPolicySpec, Applied
from batchlab.config.choices import (AttentionImpl, Backend, Choice, CompileMode, ConfigError, Counted, DataKind,
                                     Implementation, Keep, LossMode, MLPKind, ModelSource, NormKind, PositionKind,
                                     Precision)
from batchlab.config.optimizers import OPTIMIZERS, OptimizerKind, OptimizerSpec, optimizer_spec
from batchlab.config.devices import (DEVICE_ALIASES, DEVICES, GB, GPU_NAMES, T, DeviceSpec, GiB, catalogue_key,
                                     device, local_device)
from batchlab.config.load import (HF_FAMILIES, config_from_dict, config_from_table, load_config_toml,
                                  model_from_hf_config, parse_field_value, resolve_model)
from batchlab.config.model import PRESETS, ModelSpec, default_ffn, preset, trained_with
from batchlab.config.run import (ASSUMPTION_FIELDS, CHANGEABLE_FIELDS, MODEL_FIELDS, RUN_FIELDS, ACPolicy,
                                 Assumptions, LossPolicy, RunConfig, derive_accum, to_jsonable)
from batchlab.config.values import parse_bytes, read_file, whole_number

__all__ = [
    "ACMode", "ACPolicy", "ACPolicySpec", "AC_POLICIES", "Applied", "ASSUMPTION_FIELDS", "Assumptions", "AttentionImpl", "BATCH_FIELDS", "Backend",
    "CHANGEABLE_FIELDS", "Choice", "CompileMode", "ConfigError", "Counted", "DEVICES", "DEVICE_ALIASES", "DataKind", "DeviceSpec", "GB", "GPU_NAMES",
    "GiB", "HF_FAMILIES", "Implementation", "Keep", "LossMode", "LossPolicy", "MLPKind", "MODEL_FIELDS", "ModelSource", "ModelSpec", "NormKind",
    "OPTIMIZERS", "OptimizerKind", "OptimizerSpec", "PRESETS", "PositionKind", "Precision", "RUN_FIELDS", "RunConfig", "T", "apply_change",
    "catalogue_key", "config_from_dict", "config_from_table", "default_ffn", "derive_accum", "device",
    "keep_global_batch", "load_config_toml", "local_device", "model_from_hf_config", "parse_bytes",
    "optimizer_spec", "parse_field_value", "preset", "read_file", "resolve_model", "to_jsonable", "trained_with", "whole_number",
]
