"""Small configs shared by the trace and timeline tests: the built-in GPT, HF GPT-2 and HF Llama at toy
sizes (2 layers, hidden 64, seq 32), so a fake-tensor trace and a real CPU update both take well under a
second.  A module, not conftest fixtures: the tests build them at collection time (parametrize tables)."""
from __future__ import annotations

from batchlab.config import RunConfig, preset


def tiny(**kw) -> RunConfig:
    return RunConfig(model=preset("tiny", layers=2), seq=32, micro_batch=2, **kw)


def hf_gpt2(**kw) -> RunConfig:
    spec = preset("gpt2", layers=2, hidden=64, heads=4, vocab=256, max_positions=128)
    return RunConfig(model=spec, model_source="hf:gpt2", seq=32, micro_batch=2, **kw)


def hf_llama(**kw) -> RunConfig:
    spec = preset("llama-2-7b", layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=256, max_positions=128)
    return RunConfig(model=spec, model_source="hf:llama-2-7b", seq=32, micro_batch=2, **kw)
