"""Every activation-checkpointing plan input is answered: hostile ``--ac plan:...`` values, plan files, ``--vary``
values and ``fit --ac auto`` outputs, each through the real CLI.  Each case: exit 0 or 2, never a traceback, a
bad input one line ``error: FIELD: ...`` naming the field, and an answer within seconds (a fifo or /dev/zero
must not be waited on, a ``layers = 10**8`` table must not be built).

Most cases run ``estimate`` (the formula alone) in-process with typer's CliRunner; the ones that could hang a
process (fifo, device) run as a subprocess with a timeout.  The tiny preset has 4 layers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchlab.cli import app
from batchlab.config import ACMode, ACPolicy, ConfigError
from batchlab.config.planfile import MAX_BYTES, MAX_LAYERS

runner = CliRunner()
LONG_80 = "plan:" + ",".join(["full*1"] * 57) + ",none*23"  # 80 layers in 399 characters


def run(args: list[str], cwd: Path | None = None, codes: tuple[int, ...] = (0, 2)):
    """The CLI's answer, checked for what every answer must be: exit 0 or 2, no traceback.  How long it takes is
    bounded by the reader's limits (MAX_BYTES, MAX_LAYERS, nesting), each tested here by what it refuses, not by
    this host's seconds."""
    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        r = runner.invoke(app, args, env={"COLUMNS": "2000"})  # no wrapping inside a path
    finally:
        os.chdir(old)
    assert r.exit_code in codes, (args, r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output and not isinstance(r.exception, (AssertionError, RecursionError,
                                                                           MemoryError, OSError)), r.output
    return r


def refused(args: list[str], field: str = "ac", cwd: Path | None = None) -> str:
    """A one-line error naming ``field``; its text."""
    r = run(args, cwd)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {field}: "), r.output
    return lines[0]


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    """The plan files the cases name as {d}/NAME."""
    d = tmp_path_factory.mktemp("plans")
    texts = {
        "ok.json": json.dumps({"per_layer": ["full", "none", "selective", "none"]}),
        "ok.toml": 'per_layer = ["full", "selective-op", "none", "full"]\n',
        "table.json": json.dumps({"layers": 4, "per_layer": {"0": "full", "3": "selective"}}),
        "preset.json": json.dumps({"ac": "full", "per_layer": [], "layers": 4}),  # what fit wrote for a preset
        "every.json": json.dumps({"ac": "every:2", "per_layer": [], "layers": 4}),
        "deep.json": "[" * 100_000 + "]" * 100_000,
        "deep2.json": '{"per_layer": ' + "[" * 50 + "]" * 50 + "}",
        "deep.toml": "per_layer = " + "[" * 5000 + "]" * 5000 + "\n",
        "layers_huge.json": json.dumps({"layers": 10**12, "per_layer": {"0": "full"}}),
        "layers_2_70.json": json.dumps({"layers": 2**70, "per_layer": {"0": "full"}}),
        "layers_1e8.json": json.dumps({"layers": 10**8, "per_layer": {"0": "full"}}),
        "layers_digits.json": '{"layers": 1' + "0" * 5000 + ', "per_layer": {"0": "full"}}',
        "layers_neg.json": json.dumps({"layers": -1, "per_layer": {"0": "full"}}),
        "layers_str.json": json.dumps({"layers": "4", "per_layer": {"0": "full"}}),
        "layers_bool.json": json.dumps({"layers": True, "per_layer": {"0": "full"}}),
        "layers_none.json": json.dumps({"per_layer": {"0": "full"}}),
        "key_neg.json": json.dumps({"layers": 4, "per_layer": {"-1": "full"}}),
        "key_big.json": json.dumps({"layers": 4, "per_layer": {"9" * 400: "full"}}),
        "key_out.json": json.dumps({"layers": 4, "per_layer": {"7": "full"}}),
        "long_list.json": json.dumps({"per_layer": ["none"] * (MAX_LAYERS + 1)}),
        "nine.json": json.dumps({"per_layer": ["full"] * 9}),
        "ints.json": json.dumps({"per_layer": [1, 2, 3, 4]}),
        "nested.json": json.dumps({"per_layer": [["full"], "none", "none", "none"]}),
        "unknown.json": json.dumps({"per_layer": ["full", "sometimes", "none", "none"]}),
        "plan_ac.json": json.dumps({"ac": "plan:full*4", "per_layer": [], "layers": 4}),
        "list.json": "[1, 2]",
        "number.json": "4",
        "null.json": "null",
        "string.json": '"full*4"',
        "empty.json": "",
        "empty_list.json": json.dumps({"per_layer": []}),
        "empty_table.json": json.dumps({"per_layer": {}, "layers": 4}),
        "dup.json": '{"per_layer": ["full", "full", "full", "full"], "per_layer": ["none"]}',
        "dup.toml": 'per_layer = ["full"]\nper_layer = ["none"]\n',
        "broken.json": '{"per_layer": [',
        "broken.toml": "per_layer = [\n",
        "nan.json": '{"per_layer": NaN}',
    }
    for name, text in texts.items():
        (d / name).write_text(text)
    (d / "latin1.json").write_bytes(b'{"per_layer": ["f\xfcll"]}')
    (d / "bom16.json").write_bytes('{"per_layer": ["full"]}'.encode("utf-16"))
    (d / "big.json").write_bytes(b" " * (MAX_BYTES + 10) + b"{}")
    (d / "folder.json").mkdir()
    (d / "loop_a.json").symlink_to(d / "loop_b.json")
    (d / "loop_b.json").symlink_to(d / "loop_a.json")
    (d / "dangling.json").symlink_to(d / "nowhere.json")
    (d / "plainfile").write_text(json.dumps({"per_layer": ["full"] * 4}))
    # files named like inline plans: the inline plan is read, never the file
    (d / "none*4").write_text(json.dumps({"per_layer": ["full"] * 4}))
    (d / "full").write_text(json.dumps({"per_layer": ["full"] * 4}))
    os.mkfifo(d / "fifo.json")
    return d


GOOD = [  # (args, text the answer shows)
    (["--layers", "80", "--ac", LONG_80], "ac=plan:full*57,none*23"),
    (["--ac", "plan: full * 2 , none*2 "], "ac=plan:full*2,none*2"),
    (["--ac", "PLAN:FULL*2,None*2"], "ac=plan:full*2,none*2"),
    (["--attention", "sdpa", "--ac", "plan:full,op,attn,megatron"],
     "ac=plan:full,selective-op,selective-attn,megatron-selective"),
    (["--ac", "plan:{d}/ok.json"], "ac=plan:full,none,selective,none"),
    (["--ac", "plan:{d}/ok.toml"], "ac=plan:full,selective-op,none,full"),
    (["--ac", "plan:{d}/table.json"], "ac=plan:full,none*2,selective"),
    (["--ac", "plan:{d}/preset.json"], "ac=plan:full*4"),
    (["--ac", "plan:{d}/every.json"], "ac=plan:full,none,full,none"),
    (["--ac", "plan:{d}/plainfile"], "ac=plan:full*4"),  # a path without a suffix: the / makes it one
    (["--ac", "plan:none*4"], "ac=plan:none*4"),  # a file "none*4" sits in the working directory
    (["--layers", "1", "--ac", "plan:full"], "ac=plan:full"),  # a file "full" sits there too
]


@pytest.mark.parametrize("args, shown", GOOD)
def test_good_plans_are_read_as_their_rule_says(d, args, shown):
    r = run(["estimate", *(a.replace("{d}", str(d)) for a in args)], cwd=d)
    assert r.exit_code == 0 and shown in r.output, r.output


BAD = [  # (--ac value, a piece of the one-line error)
    ("plan:", "needs items"),
    ("plan:   ", "needs items"),
    ("plan:,", "needs items"),
    ("plan:full*2,,none*2", "needs items"),
    ("plan:full*0", "1..100,000"),
    ("plan:full*-1", "not POLICY or POLICY*N"),
    ("plan:full*", "not POLICY or POLICY*N"),
    ("plan:*4", "not POLICY or POLICY*N"),
    ("plan:full*1e3", "not POLICY or POLICY*N"),
    ("plan:full*99999999999999999999", "1..100,000"),
    ("plan:full*" + "9" * 5000, "1..100,000"),
    ("plan:full*100001", "1..100,000"),
    ("plan:" + "none," * (MAX_LAYERS + 1) + "none", "1..100,000"),
    ("plan:bogus*4", "unknown layer policy"),
    ("plan:every*4", "not a layer policy"),
    ("plan:plan*4", "not a layer policy"),
    ("plan:auto", "unknown layer policy"),
    ("plan:fülL*4", "not POLICY or POLICY*N"),
    ("plan:full*４", "not POLICY or POLICY*N"),  # a full-width digit
    ("plan:ｆull*4", "not POLICY or POLICY*N"),
    ("plan:full*2\nnone*2", "not POLICY or POLICY*N"),
    ("plan:none*3", "names 3 layers; the model has 4"),
    ("plan:none*5", "names 5 layers; the model has 4"),
    ("plan:x", "unknown layer policy"),  # neither a policy nor, by the rule, a file
    ("plan:~nosuchuser/plan.json", "cannot expand '~'"),
    ("plan:" + "a" * 395 + ".json", "cannot open it"),  # a file name too long
    ("plan:/" + "a/" * 3000 + "p.json", "cannot open it"),  # a path too long
    ("plan:/tmp/[/x].json", "not found"),
    ("plan:a\x00b.json", "NUL"),
    ("plan:{d}/missing.json", "not found"),
    ("plan:{d}/deep.json", "nested more than"),
    ("plan:{d}/deep2.json", "nested more than"),
    ("plan:{d}/deep.toml", "nested more than"),
    ("plan:{d}/layers_huge.json", "1..100,000"),
    ("plan:{d}/layers_2_70.json", "1..100,000"),
    ("plan:{d}/layers_1e8.json", "1..100,000"),
    ("plan:{d}/layers_digits.json", "not valid JSON"),
    ("plan:{d}/layers_neg.json", "1..100,000"),
    ("plan:{d}/layers_str.json", "1..100,000"),
    ("plan:{d}/layers_bool.json", "1..100,000"),
    ("plan:{d}/layers_none.json", "1..100,000"),
    ("plan:{d}/key_neg.json", "names layer '-1'"),
    ("plan:{d}/key_big.json", "names layer"),
    ("plan:{d}/key_out.json", "names layer '7'"),
    ("plan:{d}/long_list.json", "at most 100,000"),
    ("plan:{d}/nine.json", "names 9 layers; the model has 4"),
    ("plan:{d}/ints.json", "a policy is a string"),
    ("plan:{d}/nested.json", "a policy is a string"),
    ("plan:{d}/unknown.json", "unknown layer policy 'sometimes'"),
    ("plan:{d}/plan_ac.json", "is a plan"),
    ("plan:{d}/list.json", "needs per_layer"),
    ("plan:{d}/number.json", "needs per_layer"),
    ("plan:{d}/null.json", "needs per_layer"),
    ("plan:{d}/string.json", "needs per_layer"),
    ("plan:{d}/empty.json", "not valid JSON"),
    ("plan:{d}/empty_list.json", "needs per_layer"),
    ("plan:{d}/empty_table.json", "needs per_layer"),
    ("plan:{d}/dup.json", "given twice"),
    ("plan:{d}/dup.toml", "not valid TOML"),
    ("plan:{d}/broken.json", "not valid JSON"),
    ("plan:{d}/broken.toml", "not valid TOML"),
    ("plan:{d}/nan.json", "needs per_layer"),
    ("plan:{d}/latin1.json", "not UTF-8"),
    ("plan:{d}/bom16.json", "not UTF-8"),
    ("plan:{d}/big.json", "larger than 8 MiB"),
    ("plan:{d}/folder.json", "is a directory"),
    ("plan:{d}", "is a directory"),
    ("plan:{d}/loop_a.json", "symbolic links"),
    ("plan:{d}/dangling.json", "not found"),
]


@pytest.mark.parametrize("value, says", BAD, ids=[f"{i}-{v[:30]}" for i, (v, _) in enumerate(BAD)])
def test_bad_plans_are_one_line_errors_naming_ac(d, value, says):
    line = refused(["estimate", "--ac", value.replace("{d}", str(d))], cwd=d)
    assert says in line and len(line) < 400, line


def test_what_was_tried_is_said():
    """An inline reading says so and how a file is named; a file reading says why it was taken as one."""
    assert "a file needs .json/.toml or a / in its path" in refused(["estimate", "--ac", "plan:myplan?"])
    assert "read as a file because it ends in .json" in refused(["estimate", "--ac", "plan:nope.json"])


@pytest.mark.parametrize("path", ["/dev/zero", "{d}/fifo.json"])
def test_a_device_or_fifo_is_refused_not_read(d, path):
    """In a subprocess: a blocking open would hang the process, an unbounded read fill the memory."""
    p = subprocess.run([sys.executable, "-m", "batchlab", "estimate", "--ac", f"plan:{path.replace('{d}', str(d))}"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().startswith("error: ac: ") and "not a regular file" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("vary, rows", [
    ("ac=none,plan:full*2,none*2", ["none", "plan:full*2,none*2"]),
    ("ac=plan:full*4;none", ["plan:full*4", "none"]),
    ("ac=plan:full*4,plan:none*2,full*2", ["plan:full*4", "plan:none*2,full*2"]),
    ("ac=none;full;every:2", ["none", "full", "every:2"]),
])
def test_vary_keeps_a_plans_commas(vary, rows):
    from batchlab.formula.vary import values_of

    assert values_of(vary.partition("=")[2]) == rows
    r = run(["estimate", "--vary", vary, "--json"])
    assert r.exit_code == 0 and [row["value"] for row in json.loads(r.output)] == rows


@pytest.mark.parametrize("vary, shown", [
    ("ac=none,plan:full*2,bogus*2", "plan:full*2,bogus*2"),
    ("ac=none,[/x]", "[/x]"),  # rich markup in a value: shown as typed
    ("ac=none;plan:/tmp/[red]x.json", "plan:/tmp/[red]x.json"),
])
def test_vary_with_a_bad_plan_row_is_answered(vary, shown):
    # no policy whatever the config: a user error, as --ac would be, before any row (shown as typed)
    r = run(["estimate", "--vary", vary])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ac: "), r.output
    assert shown.removeprefix("plan:").split(",")[-1].split("*")[0] in lines[0]


def test_compare_change_carries_a_multi_item_plan():
    from batchlab.config import RunConfig
    from batchlab.experiment.change import parse_change

    c = parse_change("ac=none:plan:full*2,none*2", RunConfig())
    assert str(c.b) == "plan:full*2,none*2"


def test_relative_plan_paths_are_taken_from_the_file_naming_them(tmp_path, d):
    from batchlab.config import RunConfig
    from batchlab.experiment.spec import load

    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "p.json").write_text(json.dumps({"per_layer": ["full", "full", "none", "none"]}))
    (sub / "cfg.toml").write_text('[config]\nac = "plan:./p.json"\n')
    (sub / "exp.toml").write_text('[change]\nac = ["none", "plan:p.json"]\n')
    r = run(["estimate", "--config", str(sub / "cfg.toml")], cwd=d)  # elsewhere, with no p.json
    assert r.exit_code == 0 and "ac=plan:full*2,none*2" in r.output, r.output
    (change,) = load(sub / "exp.toml", RunConfig()).changes
    assert RunConfig(ac=change.b).ac.layers == (ACMode.FULL,) * 2 + (ACMode.NONE,) * 2
    with pytest.raises(ConfigError, match="not found"):  # outside the file's context: the working directory
        ACPolicy.parse("plan:p.json")


# -- fit --ac auto: what it writes reads back, what it prints is literal, what it cannot write is said


def _fit(tmp_path: Path, *extra: str):
    return run(["fit", "--ac", "auto", "--no-verify", "--memory-budget", "60MiB", "--margin", "0", *extra],
               cwd=tmp_path)


@pytest.mark.parametrize("name", ["[/x].json", "[red]p.json", "a b,c.json", "plan-without-suffix"])
def test_fits_plan_file_is_printed_literally_and_reads_back(tmp_path, name):
    out = tmp_path / name
    r = _fit(tmp_path, "--plan-out", str(out))
    assert r.exit_code == 0 and str(out) in r.output, r.output
    use = json.loads(out.read_text())["use"]
    back = run(["estimate", *use.split(" ", 1)], cwd=tmp_path)
    assert back.exit_code == 0, back.output
    chosen = r.output.split("--ac ")[-1].split()[0]
    assert f"ac={chosen}" in back.output or f"ac={ACPolicy.parse(chosen)}" in back.output


@pytest.mark.parametrize("ac, by_hand", [("full", ["full"] * 4), ("every:2", ["full", "none", "full", "none"]),
                                         ("selective-attn", ["selective-attn"] * 4)])
def test_a_preset_pick_is_written_per_layer_and_reads_back(tmp_path, ac, by_hand):
    """A preset beats every plan: the file and the plan's JSON (fit --ac auto --json) both name each layer's
    policy of the tiny preset's 4 (they once held per_layer = [])."""
    from batchlab.advise.acfit import write_plan
    from batchlab.advise.acplan import ACPlan, Point, point
    from batchlab.config import RunConfig

    cfg = RunConfig(ac=ac)
    chosen = Point(ac, cfg.micro_batch, 10**6, 1.0, "plan", 2 * 10**6)
    path = tmp_path / "plan.json"
    plan = ACPlan(2 * 10**6, chosen, cfg, frontier=[point(cfg, "preset", {})])
    write_plan(plan, path)
    assert json.loads(path.read_text())["per_layer"] == by_hand
    assert plan.to_dict()["per_layer"] == by_hand and plan.to_dict()["frontier"][0]["per_layer"] == by_hand
    r = run(["estimate", "--ac", f"plan:{path}"])
    assert r.exit_code == 0 and f"ac={ACPolicy(ACMode.PLAN, layers=cfg.ac.layer_modes(4))}" in r.output


def test_an_unwritable_default_plan_file_keeps_the_results_and_report(tmp_path, monkeypatch):
    from batchlab.advise import acfit

    (tmp_path / "afile").write_text("")
    target = tmp_path / "afile" / "batchlab-ac-plan.json"  # under a regular file: no directory can hold it
    monkeypatch.setattr(acfit, "DEFAULT_FILE", str(target))
    r = _fit(tmp_path, "--report", str(tmp_path / "rep"))
    assert r.exit_code == 0 and "chosen" in r.output, r.output
    assert "the plan file was not written" in r.output and str(target) in r.output
    assert ".part" not in r.output
    assert (tmp_path / "rep" / "fit-report.md").exists() and (tmp_path / "rep" / "fit-report.html").exists()


def test_write_errors_name_the_users_path(tmp_path):
    from batchlab.util.files import write_atomic

    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError) as e:
        write_atomic(tmp_path / "afile" / "x.json", "{}", "plan_out")
    assert str(tmp_path / "afile" / "x.json") in str(e.value) and ".part" not in str(e.value)


def test_plan_out_a_directory_is_refused_before_planning(tmp_path):
    refused(["fit", "--ac", "auto", "--no-verify", "--plan-out", str(tmp_path)], "plan_out")


def test_the_planner_refuses_more_layers_than_any_plan_holds(tmp_path):
    refused(["fit", "--ac", "auto", "--no-verify", "--layers", str(MAX_LAYERS + 1), "--memory-budget", "4TiB"],
            "layers")


def test_two_thousand_layers_are_planned_in_seconds(tmp_path):
    r = _fit(tmp_path, "--layers", "2000", "--memory-budget", "20GiB", "--plan-out", str(tmp_path / "p.json"))
    assert r.exit_code == 0 and len(json.loads((tmp_path / "p.json").read_text())["per_layer"]) == 2000


def test_a_timed_out_verification_is_reported_as_a_timeout(tmp_path):
    r = run(["fit", "--ac", "auto", "--verify", "--timeout", "0.01", "--plan-out", str(tmp_path / "p.json")],
            cwd=tmp_path, codes=(1,))  # as fit's own verification: a run with no answer chooses nothing
    assert "measurement timed out" in r.output and "failed against" not in r.output and "falling back" not in r.output
