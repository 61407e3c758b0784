"""HF config.json folders at toy sizes for the any-model tests (tests/models/test_any_model.py, tests/trace/test_layer_profile*.py): 2 layers, hidden 64,
any model_type, fields overridden per family.  A module, not fixtures: the tests build them in parametrize
tables."""
from __future__ import annotations

import json
from pathlib import Path

from batchlab.config import RunConfig, resolve_model
from batchlab.measure import MeasureOptions

FAST = MeasureOptions(warmup=1, steps=1, memory=True, timing=False)
SHAPE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=512)


def config_dir(tmp_path: Path, model_type: str, **fields) -> str:
    folder = tmp_path / model_type
    folder.mkdir(exist_ok=True)
    values = {k: v for k, v in {**SHAPE, **fields}.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(dict(values, model_type=model_type)))
    return str(folder)


def hf_cfg(path: str, **kw) -> RunConfig:
    spec, source = resolve_model(f"hf:{path}")
    return RunConfig(model=spec, model_source=source, **{**dict(seq=64, micro_batch=2), **kw})


def rel(a: int, b: int) -> float:
    return abs(a - b) / b
