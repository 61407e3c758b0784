import json
import os
import re

import pytest

from batchlab.config import (ACMode, ACPolicy, ConfigError, Keep, RunConfig, apply_change, config_from_dict,
                             derive_accum, model_from_hf_config, parse_bytes, parse_field_value, preset)


def test_global_batch_is_micro_times_accum_times_dp():
    cfg = RunConfig(micro_batch=4, accum=3, dp=2)
    assert cfg.global_batch == 24
    assert cfg.tokens_per_update == 24 * cfg.seq
    assert "4 x 3 x 2 = 24" in cfg.global_batch_text()


def test_global_batch_derivation_and_refusal():
    assert derive_accum(64, 4, 2) == 8
    with pytest.raises(ConfigError, match="global_batch"):
        derive_accum(10, 4, 1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(micro_batch=0), "micro_batch"),
    (dict(seq=-1), "seq"),
    (dict(seq=100000), "seq"),
    (dict(zero=4), "zero"),
    (dict(device="tpu-v9"), "device"),
    (dict(precision="fp8"), "precision"),
    (dict(ac="every:9"), "ac"),
    (dict(ac="sometimes"), "ac"),
    (dict(memory_budget="lots"), "memory_budget"),
])
def test_invalid_values_name_their_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        RunConfig(**kwargs)
    assert e.value.field == field
    assert "\n" not in str(e.value)


def test_model_validation():
    with pytest.raises(ConfigError, match="heads"):
        preset("tiny", heads=3)
    with pytest.raises(ConfigError, match="kv_heads"):
        preset("tiny", kv_heads=3)
    with pytest.raises(ConfigError, match="model"):
        preset("gpt-17")


def test_ac_policy_decides_wrapped_layers_in_one_place():
    assert ACPolicy.parse("full").wrapped_layers(4) == (0, 1, 2, 3)
    assert ACPolicy.parse("every:2").wrapped_layers(5) == (0, 2, 4)
    assert ACPolicy.parse("none").wrapped_layers(4) == ()
    sel = ACPolicy.parse("selective")
    assert sel.mode is ACMode.SELECTIVE and sel.wrapped_layers(4) == () and sel.selective_layers(3) == (0, 1, 2)
    assert str(ACPolicy.parse("every:3")) == "every:3"


def test_config_is_frozen_and_replace_validates():
    cfg = RunConfig()
    with pytest.raises(Exception):
        cfg.seq = 5  # type: ignore[misc]
    new = cfg.replace(layers=2, micro_batch=2, achievable_fraction=0.5)
    assert new.model.layers == 2 and new.assumptions.achievable_fraction == 0.5
    assert set(cfg.diff(new)) == {"layers", "micro_batch", "achievable_fraction"}
    with pytest.raises(ConfigError):
        cfg.replace(bogus=1)


def test_keep_global_batch_rederives_accum():
    cfg = RunConfig(micro_batch=1, accum=8)
    b = apply_change(cfg, "micro_batch", "4", Keep.GLOBAL_BATCH)
    assert (b.micro_batch, b.accum, b.global_batch) == (4, 2, 8)
    c = apply_change(cfg, "micro_batch", 4, Keep.ACCUM)
    assert (c.accum, c.global_batch) == (8, 32)
    with pytest.raises(ConfigError, match="global_batch"):
        apply_change(cfg, "micro_batch", 3)


def test_round_trip_through_dict():
    cfg = RunConfig(model=preset("llama-3-8b"), seq=512, ac="every:4", precision="bf16-mixed", device="h100-sxm")
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_field_values_are_typed():
    assert parse_field_value("micro_batch", "4") == 4
    assert parse_field_value("dropout", "0.25") == 0.25
    assert parse_field_value("memory_budget", "2GiB") == 2 * 2**30
    with pytest.raises(ConfigError, match="micro_batch"):
        parse_field_value("micro_batch", "four")
    with pytest.raises(ConfigError, match="colour"):
        parse_field_value("colour", "red")


def test_sizes():
    assert parse_bytes("x", "512MiB") == 512 * 2**20
    assert parse_bytes("x", "80GB") == 80 * 10**9


def test_hf_config_from_disk(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 172,
                             "vocab_size": 100, "max_position_embeddings": 256}))
    m = model_from_hf_config(p)
    assert (m.layers, m.hidden, m.kv_heads, m.ffn, m.mlp.value, m.norm.value) == (2, 64, 2, 172, "swiglu", "rmsnorm")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="hf_config"):
        model_from_hf_config(bad)
    with pytest.raises(ConfigError, match="hf_config"):
        model_from_hf_config(tmp_path / "missing.json")


def _fake_nvidia_smi(tmp_path, monkeypatch, output: str):
    from batchlab.config import device, local_device

    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    local_device.cache_clear()
    device.cache_clear()


def test_local_device_is_this_machines_gpu_or_cpu(tmp_path, monkeypatch):
    from batchlab.config import device, local_device

    try:
        _fake_nvidia_smi(tmp_path, monkeypatch, "NVIDIA H100 80GB HBM3\\n")
        assert RunConfig(device="local").device == "h100-sxm"
        _fake_nvidia_smi(tmp_path, monkeypatch, "Tesla T4\\n")
        with pytest.raises(ConfigError, match="not in the catalogue"):
            RunConfig(device="local")
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi at all
        local_device.cache_clear()
        device.cache_clear()
        assert RunConfig(device="local").device == "cpu"
    finally:
        local_device.cache_clear()
        device.cache_clear()


def _enum_fields(obj) -> dict[str, object]:
    """Every field annotated with an enum type (or an optional one), with its value."""
    import dataclasses
    import enum
    import typing

    hints = typing.get_type_hints(type(obj))
    out = {}
    for f in dataclasses.fields(obj):
        kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
        if typing.get_origin(hints[f.name]) is tuple:  # a tuple of enums (a plan's layers): each element
            out.update({f"{f.name}[{i}]": v for i, v in enumerate(getattr(obj, f.name))})
        elif any(isinstance(k, type) and issubclass(k, enum.Enum) for k in kinds):
            if getattr(obj, f.name) is not None or type(None) not in kinds:  # an optional one left unset: None
                out[f.name] = getattr(obj, f.name)
    return out


def test_enum_fields_hold_enums_when_built_from_strings():
    import enum

    from batchlab.config import Backend, DeviceSpec, ModelSpec

    cfg = RunConfig(model=ModelSpec(mlp="swiglu", norm="rmsnorm", attention="sdpa", position="rope"),
                    precision="bf16-mixed", optimizer="sgd", data="padded", sharding="deepspeed-zero2",
                    pp_schedule="gpipe")
    built = [cfg, cfg.model, ACPolicy("full"), ACPolicy.parse("plan:full,none*3"), DeviceSpec("x", "cuda", 1, 1.0, 1.0, 1.0, 1.0, 1.0),
             config_from_dict(json.loads(json.dumps(cfg.to_dict())))]
    for obj in built:
        values = _enum_fields(obj)
        assert values, type(obj).__name__
        for name, value in values.items():  # a str subclass, so `isinstance(value, str)` would not tell
            assert isinstance(value, enum.Enum), (type(obj).__name__, name, value)
    assert ACPolicy("full").mode is ACMode.FULL and built[4].backend is Backend.CUDA
    assert cfg.precision.value == "bf16-mixed" and cfg.model.mlp.value == "swiglu"


def test_model_source_kind():
    from batchlab.config import ModelSource, resolve_model

    kinds = {arg: RunConfig(model_source=resolve_model(arg)[1]).model_kind
             for arg in ("tiny", "hf:gpt2", "mypkg.models:build")}
    assert kinds == {"tiny": ModelSource.BUILTIN, "hf:gpt2": ModelSource.HF, "mypkg.models:build": ModelSource.FACTORY}


def test_config_error_keeps_field_and_message_apart():
    with pytest.raises(ConfigError) as e:
        RunConfig(micro_batch=0)
    assert (e.value.field, e.value.message) == ("micro_batch", "must be > 0, got 0")
    assert str(e.value) == "micro_batch: must be > 0, got 0"
    import pickle

    again = pickle.loads(pickle.dumps(e.value))  # crosses process boundaries intact
    assert (again.field, again.message, str(again)) == (e.value.field, e.value.message, str(e.value))


@pytest.mark.parametrize("make, says", [
    (lambda p: os.mkfifo(p), "not a regular file"),  # read as before, the fifo would be waited on for ever
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: os.truncate(p.open("wb").name, (64 << 20) + 1), "larger than 64 MiB"),  # sparse: no 64 MiB written
    (lambda p: p.write_bytes(b"seq = 1\n\xff\n"), "not UTF-8 text (byte 8)"),
])
def test_config_and_experiment_files_are_read_with_the_plan_files_guards(tmp_path, make, says):
    """--config, --experiment, --hf-config and notebook import read a file as a plan file is read (one reader,
    config/values.py read_text): a fifo, a folder, an outsized or binary file is one ConfigError naming the field."""
    import tomllib

    from batchlab.config.values import read_file

    path = tmp_path / "run.toml"
    make(path)
    with pytest.raises(ConfigError, match=f"^config: .*{re.escape(says)}"):
        read_file("config", path, tomllib.loads, "TOML")
