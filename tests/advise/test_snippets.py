"""`fit`'s settings for other stacks, fed to the real library where installed, else parsed and checked against
the documented keys (sources named at each list)."""
from __future__ import annotations

import ast
import json
import tomllib
import warnings

import pytest

from batchlab.advise.snippets import all_snippets, printable
from batchlab.config import ACPolicy, Precision, RunConfig, preset

CONFIGS = {
    "single": RunConfig(model=preset("tiny"), micro_batch=4, accum=2),
    "ddp-bf16-full": RunConfig(model=preset("tiny"), micro_batch=2, accum=4, dp=8, precision=Precision.BF16_MIXED,
                               ac=ACPolicy.parse("full"), device="h100-sxm"),
    "zero1": RunConfig(model=preset("tiny"), micro_batch=2, accum=2, dp=4, zero=1, device="h100-sxm"),
    "fsdp-every2": RunConfig(model=preset("tiny"), micro_batch=4, accum=8, dp=16, zero=3, device="h100-sxm",
                             precision=Precision.BF16_MIXED, ac=ACPolicy.parse("every:2")),
}
params = pytest.mark.parametrize("name", list(CONFIGS))

# pytorch/torchtitan torchtitan/config/job_config.py (Training, Parallelism, ActivationCheckpoint dataclasses)
TORCHTITAN = {"training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm",
                           "steps", "enable_cpu_offload", "mixed_precision_param", "mixed_precision_reduce", "compile",
                           "gc_freq", "gc_debug", "seed", "deterministic"},
              "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree",
                              "fsdp_reshard_after_forward", "tensor_parallel_degree", "pipeline_parallel_degree",
                              "context_parallel_degree"},
              "activation_checkpoint": {"mode", "selective_ac_option"}}
# https://www.deepspeed.ai/docs/config-json/ (batch size, ZeRO and precision sections)
DEEPSPEED = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "zero_optimization", "bf16", "fp16", "optimizer"}


@params
def test_torchtitan_toml_parses_with_its_keys_and_global_batch(name):
    cfg = CONFIGS[name]
    t = tomllib.loads(all_snippets(cfg)["torchtitan_toml"])
    for table, keys in t.items():
        assert set(keys) <= TORCHTITAN[table], (table, set(keys) - TORCHTITAN[table])
    tr, par, ac = t["training"], t["parallelism"], t["activation_checkpoint"]
    dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    # torchtitan's accumulation = global / (local x DP) must be the config's
    assert dp == cfg.dp and tr["global_batch_size"] // (tr["local_batch_size"] * dp) == cfg.accum
    assert ac["mode"] in {"selective", "full", "none"}
    if ac["mode"] == "selective":
        assert ac["selective_ac_option"] == "op" or int(ac["selective_ac_option"]) == cfg.ac.every


@params
def test_accelerate_yaml_loads_in_accelerate(name, tmp_path):
    yaml = pytest.importorskip("yaml")
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    cfg = CONFIGS[name]
    path = tmp_path / "accelerate.yaml"
    path.write_text(all_snippets(cfg)["accelerate_yaml"])
    assert yaml.safe_load(path.read_text())["num_processes"] == cfg.dp
    c = config_args.ClusterConfig.from_yaml_file(str(path))  # refuses unknown keys
    assert c.num_processes == cfg.dp and c.mixed_precision == ("bf16" if cfg.precision.mixed else "no")
    if c.fsdp_config:
        from accelerate.utils import FullyShardedDataParallelPlugin

        # the launcher passes these on as FSDP_* settings; the plugin takes them without the prefix (version: with it)
        plugin = FullyShardedDataParallelPlugin(**{k if k == "fsdp_version" else k.removeprefix("fsdp_"): v
                                                   for k, v in c.fsdp_config.items()})
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward == (cfg.zero == 3)


@params
def test_training_arguments_construct(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cfg = CONFIGS[name]
    made = []

    def training_arguments(**kw):
        if "deepspeed" in kw:
            pytest.importorskip("deepspeed")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5: gradient_checkpointing is an alias
            made.append(transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw))

    exec(all_snippets(cfg)["huggingface_code"], {"TrainingArguments": training_arguments})
    a = made[0]
    assert a.per_device_train_batch_size * a.gradient_accumulation_steps * cfg.dp == cfg.global_batch
    assert bool(a.bf16) == (cfg.precision is Precision.BF16_MIXED)


@params
def test_lightning_trainer_constructs_on_cpu(name):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import StrategyRegistry

    cfg = CONFIGS[name]
    kw = all_snippets(cfg)["lightning"]["Trainer"]
    assert kw["devices"] * kw.get("num_nodes", 1) == cfg.dp
    if kw["strategy"] not in ("auto", "ddp"):  # deepspeed / fsdp need their package or a GPU to construct
        assert kw["strategy"] in StrategyRegistry.available_strategies()
        return
    made = []
    exec(all_snippets(cfg)["lightning_code"], {"Trainer": lambda **k: made.append(
        L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **k)), "DataLoader": lambda *a, **k: None,
        "dataset": []})
    assert made[0].accumulate_grad_batches == cfg.accum and made[0].num_devices == kw["devices"]


@params
def test_deepspeed_json_keys_and_batch_identity(name):
    cfg = CONFIGS[name]
    ds = json.loads(all_snippets(cfg)["deepspeed_json"])
    assert set(ds) <= DEEPSPEED
    # DeepSpeed refuses a config where train_batch_size != micro x accum x world size
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * cfg.dp


@params
def test_pytorch_script_parses_and_its_imports_resolve(name):
    pytest.importorskip("torch")
    code = all_snippets(CONFIGS[name])["pytorch"]
    tree = ast.parse(code)
    imports = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    exec("\n".join(imports), {})
    cfg = CONFIGS[name]
    expected = "fully_shard" if cfg.zero >= 2 else "DistributedDataParallel" if cfg.dp > 1 else "DataLoader"
    assert expected in code  # run end to end in advise/test_torch_script.py


def test_fit_prints_every_stack():
    titles = [t for t, _ in printable(CONFIGS["fsdp-every2"])]
    for stack in ("torchtitan", "accelerate", "Hugging Face", "Lightning", "DeepSpeed", "FSDP2"):
        assert any(stack in t for t in titles), stack
