"""The single variable: FIELD=A:B parsing, both sides built, keep modes, confounded and bad input refused."""
from __future__ import annotations

import pytest

from batchlab.config import ACMode, ACPolicy, ConfigError, Precision, RunConfig
from batchlab.experiment.change import KeepMode, build_sides, parse_change
from batchlab.experiment.spec import load

BASE = RunConfig(seq=32, micro_batch=2, accum=4)  # global batch 8


def sides(*texts: str, keep=KeepMode.GLOBAL_BATCH, allow=False, base=BASE):
    return build_sides(base, [parse_change(t, base) for t in texts], keep, allow)


def test_values_are_typed_by_the_field():
    c = parse_change("micro_batch=1:2", BASE)
    assert (c.field, c.a, c.b) == ("micro_batch", 1, 2)
    c = parse_change("precision=fp32:bf16-mixed", BASE)
    assert c.b == "bf16-mixed" and BASE.replace(precision=c.b).precision is Precision.BF16_MIXED
    c = parse_change("dropout=0:0.1", BASE)
    assert (c.a, c.b) == (0.0, 0.1)
    c = parse_change("memory_budget=1GiB:2GiB", BASE)
    assert (c.a, c.b) == (2**30, 2 * 2**30)


@pytest.mark.parametrize("text, a, b", [("ac=none:every:2", "none", "every:2"), ("ac=every:2:full", "every:2", "full"),
                                        ("ac=none->selective", "none", "selective")])
def test_a_value_with_a_colon_splits_where_both_sides_are_valid(text, a, b):
    c = parse_change(text, BASE)
    assert (str(ACPolicy.parse(c.a)), str(ACPolicy.parse(c.b))) == (a, b)


def test_keep_global_batch_rederives_accum_for_a_micro_batch_change():
    s = sides("micro_batch=1:2")
    assert (s.a.micro_batch, s.a.accum, s.b.micro_batch, s.b.accum) == (1, 8, 2, 4)
    assert s.a.global_batch == s.b.global_batch == BASE.global_batch == 8
    assert s.derived == {"accum": (8, 4)} and "derived: accum 8 -> 4" in s.variable
    assert s.warnings == ()


def test_keep_global_batch_rederives_micro_batch_for_an_accum_change():
    s = sides("accum=4:8")
    assert (s.a.micro_batch, s.b.micro_batch) == (2, 1) and s.a.global_batch == s.b.global_batch == 8


def test_keep_global_batch_rederives_accum_for_a_dp_change():
    s = sides("dp=1:2")
    assert (s.a.accum, s.b.accum) == (4, 2) and s.b.global_batch == 8


def test_keep_accum_lets_the_global_batch_move_and_warns_about_the_learning_rate():
    s = sides("micro_batch=1:2", keep=KeepMode.ACCUM)
    assert (s.a.accum, s.b.accum) == (4, 4) and (s.a.global_batch, s.b.global_batch) == (4, 8)
    assert s.derived == {}
    assert any("learning rate" in w and "4 -> 8" in w for w in s.warnings)


def test_a_non_batch_change_leaves_the_batch_alone():
    s = sides("ac=none:full")
    assert s.a.ac.mode is ACMode.NONE and s.b.ac.mode is ACMode.FULL
    assert (s.a.micro_batch, s.a.accum) == (s.b.micro_batch, s.b.accum) == (2, 4) and s.derived == {}


def test_two_independent_changes_are_refused_unless_allowed():
    with pytest.raises(ConfigError, match="confound") as e:
        sides("micro_batch=1:2", "ac=none:full")
    assert e.value.field == "change"
    s = sides("seq=16:32", "ac=none:full", allow=True)
    assert s.confounded and set(s.a.diff(s.b)) == {"seq", "ac"}


@pytest.mark.parametrize("texts, field", [
    (("micro_batch=2:2",), "micro_batch"),  # same value both sides
    (("precision=fp32:FP32",), "precision"),  # same after parsing
    (("no_such_field=1:2",), "no_such_field"),
    (("micro_batch=one:2",), "micro_batch"),
    (("precision=fp32:fp64",), "precision"),
    (("ac=none:sometimes",), "ac"),
    (("micro_batch=3:2",), "global_batch"),  # 8 is not divisible by 3
    (("seq=32:4096",), "seq"),  # beyond the model's max_positions
    (("micro_batch",), "change"),
])
def test_bad_changes_name_the_field(texts, field):
    with pytest.raises(ConfigError) as e:
        sides(*texts)
    assert e.value.field == field
    assert "\n" not in str(e.value)


def test_a_non_divisible_side_says_which_side():
    with pytest.raises(ConfigError, match="side A") as e:
        sides("micro_batch=3:2")
    assert "not divisible" in str(e.value)


def test_micro_batch_and_accum_together_cannot_keep_the_global_batch():
    with pytest.raises(ConfigError) as e:
        sides("micro_batch=1:2", "accum=2:4", allow=True)
    assert e.value.field == "keep"


def test_an_experiment_file_holds_config_change_keep_and_prediction(tmp_path):
    f = tmp_path / "exp.toml"
    f.write_text('[config]\nmodel = "tiny"\nseq = 16\nlayers = 2\nglobal_batch = 4\n\n[change]\nmicro_batch = [1, 2]\n\n'
                 'keep = "global-batch"\npredict = { memory = "up", time = "same" }\nrounds = 4\nnote = "quiet machine"\n')
    e = load(f, RunConfig())
    assert (e.base.seq, e.base.model.layers, e.base.global_batch) == (16, 2, 4)
    assert [(c.field, c.a, c.b) for c in e.changes] == [("micro_batch", 1, 2)]
    assert e.keep is KeepMode.GLOBAL_BATCH
    assert {m.value: d.value for m, d in e.predictions.items()} == {"peak_memory": "up", "update_time": "same"}
    assert e.options == {"rounds": 4, "note": "quiet machine"}
    s = build_sides(e.base, e.changes, e.keep)
    assert (s.a.accum, s.b.accum) == (4, 2)


@pytest.mark.parametrize("text, field", [("[change]\nmicro_batch = [1]\n", "change"), ("colour = 1\n[change]\nseq=[16,32]\n", "experiment"),
                                         ("[config]\nwidth = 3\n[change]\nseq = [16, 32]\n", "width"),
                                         ("[config]\nseq = 16\n", "experiment"), ("not toml [", "experiment")])
def test_bad_experiment_files_name_the_field(tmp_path, text, field):
    f = tmp_path / "exp.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(f, RunConfig())
    assert e.value.field == field
