"""The calculator's profiled layer terms past the profile's fitted lengths (seq 512) against the trace (which
equals a real run's live tensors: tests/trace/test_layer_profile_families.py): a checkpointed ALiBi model (the deep
sliding-window model in bf16: tests/trace/test_layer_profile_families.py, which profiles it already)."""
from __future__ import annotations

import pytest

from batchlab.formula import estimate as formula_estimate
from batchlab.trace import estimate as trace_estimate
from hf_shapes import config_dir, hf_cfg, rel

transformers = pytest.importorskip("transformers")


@pytest.mark.slow  # a profile, 8-15 s on 2 loaded cores
@pytest.mark.parametrize("model_type, fields, precision, ac, layers", [
    # a checkpointed block keeps the (b, 1, s, s) mask it is handed, and its forward's working set (the ALiBi
    # scores) is the forward's high point at long sequences: -27% before both were per AC policy
    ("bloom", dict(n_layer=2, n_head=4, num_hidden_layers=None, max_position_embeddings=None), "fp32", "full", 2),
])
def test_formula_at_seq_512_within_3pct_of_the_trace(tmp_path, model_type, fields, precision, ac, layers):
    """The trace equals a real run's live tensors (tests above); 512 is past the profile's fitted shapes."""
    from batchlab.trace.profile import with_profile

    cfg = hf_cfg(config_dir(tmp_path, model_type, **fields), seq=512, precision=precision, ac=ac)
    cfg = with_profile(cfg.replace(layers=layers))
    tr, est = trace_estimate(cfg).memory, formula_estimate(cfg).memory
    assert rel(est.peak_tensor_bytes, tr.peak_bytes) <= 0.03
    assert rel(est.activations_bytes, tr.activations_bytes) <= 0.03
    assert est.peak_phase == tr.peak_phase
