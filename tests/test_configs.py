"""Every config composes, and every node it holds instantiates (or, for hub models, binds)."""

from __future__ import annotations

import inspect
from pathlib import Path

import hydra
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_class, get_method
from omegaconf import DictConfig, OmegaConf

from helpers import ROOT, compose_train, group_options
from lightning_vlm.methods.online import OnlineRL
from lightning_vlm.models.families import FAMILIES
from lightning_vlm.training import instantiate_group

# Every hub-model config: each family's, and the extra sizes.
REAL_MODELS = sorted({f.hub_config for f in FAMILIES.values() if f.hub_config} | {"qwen2_5_vl_7b"})


def _bind(node: DictConfig) -> None:
    """Checks a node's keys against its target's signature without running it (no download)."""
    target = node["_target_"]
    try:
        fn = get_class(target)
    except Exception:
        fn = get_method(target)
    kwargs = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not k.startswith("_")}
    inspect.signature(fn).bind_partial(**kwargs)


@pytest.mark.parametrize(
    "group", ["method", "model", "data", "trainer", "callbacks", "logger", "experiment", "debug", "lora"]
)
def test_every_option_composes(group, tmp_path):
    for option in group_options(group):
        cfg = compose_train([f"{group}={option}"], tmp_path)
        assert cfg.method._target_ and cfg.model._target_ and cfg.data._target_
        OmegaConf.to_container(cfg.data, resolve=True)


def test_hparams_search_composes(tmp_path):
    for option in group_options("hparams_search"):
        cfg = compose_train([f"hparams_search={option}"], tmp_path)
        assert cfg.hydra.sweeper.params


@pytest.mark.parametrize("model", REAL_MODELS)
def test_real_model_configs_bind(model, tmp_path):
    cfg = compose_train([f"model={model}"], tmp_path)
    assert "/" in cfg.model.model_name_or_path and cfg.trainer.precision == "bf16-mixed"
    # fp32 master weights for full fine-tuning; bf16 weights only under LoRA (the 7B)
    assert cfg.model.dtype == ("bfloat16" if cfg.model.lora else "float32")
    _bind(cfg.model)
    # model.lora=null on a 7B config: full fine-tuning at its rate, on fp32 master weights (bf16 ones
    # rounded every 1e-6 step away, with a warning only once the model had loaded)
    full = compose_train([f"model={model}", "model.lora=null", "method=grpo"], tmp_path)
    assert full.model.dtype == "float32" and full.method.optimizer.lr == 1e-6


@pytest.mark.parametrize("method", group_options("method"))
def test_method_nodes_instantiate(method, tmp_path):
    cfg = compose_train([f"method={method}"], tmp_path)
    datamodule = hydra.utils.instantiate(cfg.data)
    vlm = hydra.utils.instantiate(cfg.model)
    module = hydra.utils.instantiate(cfg.method, vlm=vlm)
    assert module.vlm is vlm and datamodule is not None
    trainer = hydra.utils.instantiate(
        cfg.trainer,
        callbacks=instantiate_group(cfg.callbacks),
        logger=instantiate_group(OmegaConf.merge(cfg.logger, {"wandb": {"offline": True}})),
    )
    assert trainer.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize("group", ["callbacks", "logger"])
def test_callback_and_logger_options_instantiate(group, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for option in group_options(group):
        cfg = compose_train([f"{group}={option}"], tmp_path)
        nodes = cfg[group] or {}
        built = instantiate_group(nodes)
        assert len(built) == sum(1 for node in nodes.values() if "_target_" in node)


ONLINE = {"grpo": "GRPO", "rloo": "RLOO", "online_dpo": "OnlineDPO"}


@pytest.mark.parametrize("method", sorted(ONLINE))
def test_online_yaml_values_are_the_signature_defaults(method, tmp_path):
    """Each online setting's default has one value: the constructor's signature (the schema) and the
    method's YAML agree on every plain value (interpolations follow conf/scale or the run's seed)."""
    cfg = compose_train([f"method={method}"], tmp_path)
    node = OmegaConf.to_container(cfg.method, resolve=False)
    cls = get_class(node.pop("_target_"))
    # The method's own parameters, then the shared ones it passes on (**online) to OnlineRL.
    params = {**inspect.signature(OnlineRL).parameters, **inspect.signature(cls).parameters}
    assert set(node) <= set(params), set(node) - set(params)
    for key, value in node.items():
        default = params[key].default
        if key in ("optimizer", "sampling") or (isinstance(value, str) and value.startswith("${")):
            continue
        expected = list(default) if isinstance(default, tuple) else default
        assert value == expected, f"method.{key}: YAML {value!r}, {ONLINE[method]} default {default!r}"


@pytest.mark.parametrize("data", ["sft", "preference", "unpaired", "prompt"])
def test_a_datamodule_built_in_python_has_the_configs_settings(data, tmp_path):
    """The DataModules' defaults live in their signature (the config node is built from it): SFTDataModule()
    in Python gave 256 synthetic rows in batches of 8 where the same config gave 4096 in batches of 32."""
    cfg = compose_train([f"data={data}"], tmp_path)
    from_config = hydra.utils.instantiate(cfg.data)
    in_python = get_class(cfg.data._target_)(seed=cfg.seed, **({"batch_size": 4} if data == "prompt" else {}))
    assert dict(from_config.hparams) == dict(in_python.hparams)
    assert from_config.hparams.synthetic["num_train"] == 4096 and from_config.hparams.batch_size in (4, 32)
    # every setting is in the node, so the command line overrides it without a `+`
    params = set(inspect.signature(get_class(cfg.data._target_)).parameters)
    assert params == set(cfg.data) - {"_target_"}


def test_a_users_data_config_may_add_its_own_settings(tmp_path):
    # A DataModule subclass with settings of its own: its config extends data/_base, as the shipped ones.
    folder = tmp_path / "conf" / "data"
    folder.mkdir(parents=True)
    (folder / "mine.yaml").write_text(
        "defaults:\n  - _base\n  - _self_\n_target_: my.DataModule\nextra_option: 3\n"
    )
    cfg = compose_train([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data=mine"], tmp_path)
    assert cfg.data.extra_option == 3 and cfg.data.batch_size == 32


def test_sampling_and_engine_nodes_are_their_dataclasses(tmp_path):
    from dataclasses import asdict

    from lightning_vlm.generation.base import SamplingOptions
    from lightning_vlm.generation.engine_options import EngineOptions

    cfg = compose_train(["method=grpo", "generation=vllm_colocate", "method.sampling.top_p=0.9"], tmp_path)
    assert OmegaConf.to_container(cfg.method.sampling) == {**asdict(SamplingOptions()), "top_p": 0.9}
    engine = OmegaConf.to_container(cfg.callbacks.vllm_generation.engine, resolve=True)
    assert engine == {**asdict(EngineOptions()), "seed": cfg.seed}
    callback = hydra.utils.instantiate(cfg.callbacks.vllm_generation)
    assert callback.engine == EngineOptions(seed=cfg.seed)
    # one optimizer node for every method, its rate from conf/scale
    for method, rate in (("sft", "sft"), ("dpo", "dpo"), ("grpo", "online")):
        opt = compose_train([f"method={method}"], tmp_path).method
        assert opt.optimizer._target_ == "torch.optim.AdamW" and opt.scheduler is None
        assert opt.optimizer.lr == cfg.scale.lr[rate]


@pytest.mark.parametrize(
    ("method", "full", "adapters"), [("sft", 2e-5, 1e-4), ("dpo", 1e-6, 5e-6), ("grpo", 1e-6, 1e-5)]
)
def test_lora_on_a_pretrained_model_takes_loras_rate(method, full, adapters, tmp_path):
    # `model=qwen2_5_vl lora=default` trained the adapters at the full fine-tuning rate (10x too slow).
    def lr(*overrides: str) -> float:
        return compose_train([f"method={method}", *overrides], tmp_path).method.optimizer.lr

    assert lr("model=qwen2_5_vl") == pytest.approx(full)
    assert lr("model=qwen2_5_vl", "lora=default") == pytest.approx(adapters)
    assert lr("model=qwen2_5_vl_7b") == pytest.approx(adapters)
    assert lr("model=qwen2_5_vl_7b", "model.lora=null") == pytest.approx(full)  # full fine-tuning again
    assert lr("lora=default") == lr()  # the tiny models: one rate (LoRA also trains their lm_head)


def test_the_readmes_linear_decay_composes_to_trls_schedule(tmp_path):
    import torch

    from lightning_vlm.methods.common import configure_optimizers

    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if "'method.scheduler=" in x)
    override = line.split("`'", 1)[1].split("'`", 1)[0]
    cfg = compose_train(["method=sft", override, "trainer.max_steps=4"], tmp_path)
    method = hydra.utils.instantiate(cfg.method, vlm=None, _partial_=True)
    params = [torch.nn.Parameter(torch.zeros(1))]
    module = torch.nn.Module()
    module.trainable = params[0]
    config = configure_optimizers(module, method.keywords["optimizer"], method.keywords["scheduler"])
    scheduler, rates = config["lr_scheduler"]["scheduler"], []
    for _ in range(4):
        rates.append(scheduler.get_last_lr()[0])
        config["optimizer"].step()
        scheduler.step()
    assert rates == pytest.approx([cfg.scale.lr.sft * f for f in (1.0, 0.75, 0.5, 0.25)])
    assert scheduler.get_last_lr()[0] == 0.0


def test_gpu_trainer_takes_precision_from_the_scale(tmp_path):
    assert compose_train(["trainer=gpu"], tmp_path).trainer.precision == "32-true"  # tiny model
    assert compose_train(["trainer=gpu", "model=qwen2_5_vl"], tmp_path).trainer.precision == "bf16-mixed"


@pytest.mark.parametrize("model", ["qwen2_5_vl_7b", "llava_next"])
def test_lora_default_keeps_a_7b_models_own_adapter_size(model, tmp_path):
    # `lora=default` composes after the model and reset the 7B configs' r 64 to the 3B default of 16.
    own = compose_train([f"model={model}"], tmp_path).model.lora
    assert (own.r, own.lora_alpha, own.lora_dropout) == (64, 128, 0.05)
    assert compose_train([f"model={model}", "lora=default"], tmp_path).model.lora == own
    assert compose_train([f"model={model}", "model.lora.r=8"], tmp_path).model.lora.r == 8
    smaller = compose_train(["model=qwen2_5_vl", "lora=default"], tmp_path).model.lora
    assert smaller.r == 16 and smaller.modules_to_save is None


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"TORCHELASTIC_RUN_ID": "3f9c2a"}, "torchrun-3f9c2a"),
        ({"TORCHELASTIC_RUN_ID": "none"}, None),  # torchrun without --standalone or --rdzv-id
        ({"SLURM_JOB_ID": "77", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_ID": "0"}, "slurm-77.0"),
        ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "8"}, None),  # the batch script itself, not an srun step
        ({}, None),
    ],
)
def test_processes_of_one_launch_name_one_run_folder(environ, expected, tmp_path, monkeypatch):
    # Every torchrun/SLURM process composes its own config: ${now:} could differ by a second between
    # ranks and split one run over two folders.
    from lightning_vlm.config import launch_id

    assert launch_id(environ) == expected
    for key in (
        "TORCHELASTIC_RUN_ID",
        "SLURM_JOB_ID",
        "SLURM_NTASKS",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_STEP_ID",
    ):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    stamp = Path(OmegaConf.create({"dir": f"${{run_folder:{tmp_path},%Y-%m-%d_%H-%M-%S}}"}).dir).name
    if expected:
        assert stamp == expected
    else:  # the time, and a one-process SLURM job's id: array tasks starting together shared one folder
        job = environ.get("SLURM_JOB_ID")
        assert stamp[:4].isdigit() and stamp[19:] == (f"_slurm-{job}" if job else "")


def test_machine_settings_in_conf_local_override_the_config(tmp_path):
    # conf/local/default.yaml (git-ignored) as README says to write it: its keys at the top level. Without
    # the group's _global_ package they landed under `local.` and nothing read them.
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "default.yaml").write_text(
        "trainer:\n  devices: 4\npaths:\n  log_dir: /mnt/big/logs\n"
    )
    cfg = compose_train([f"hydra.searchpath=[file://{tmp_path}]"], tmp_path)
    assert cfg.trainer.devices == 4 and cfg.paths.log_dir == "/mnt/big/logs" and "local" not in cfg


@pytest.mark.parametrize("experiment", ["grpo_count", "grpo_grounding", "grpo_mixed"])
def test_experiments_set_learning_rates_relative_to_the_models_scale(experiment, tmp_path):
    # Tuned on the tiny models (2.5e-4), the absolute rate was 250x a 3B model's online default (1e-6).
    tiny = compose_train([f"experiment={experiment}"], tmp_path)
    hub = compose_train([f"experiment={experiment}", "model=qwen2_5_vl"], tmp_path)
    assert tiny.method.optimizer.lr == pytest.approx(2.5e-4)
    assert hub.method.optimizer.lr == pytest.approx(hub.scale.lr.online / 2) == pytest.approx(5e-7)


@pytest.mark.parametrize(
    ("launch", "shared"),
    [
        ({}, None),
        ({"TORCHELASTIC_RUN_ID": "3f9c2a", "WORLD_SIZE": "2"}, "torchrun-3f9c2a"),
        ({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2"}, "2026-12-07_12-00-00"),  # plain torchrun
    ],
)
def test_runs_started_in_the_same_second_get_their_own_folders(launch, shared, tmp_path, monkeypatch):
    # Two train.py runs started in one second (two terminals, a script's `&`) shared logs/<task>/runs/<time>,
    # and one run's checkpoint save replaced or deleted the other's files. Each process claims its own
    # folder; the processes of one torchrun launch share theirs on purpose.
    from lightning_vlm import config

    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in launch.items():
        monkeypatch.setenv(key, value)
    now = config.datetime(2026, 12, 7, 12, 0, 0)
    monkeypatch.setattr(config, "datetime", type("Frozen", (), {"now": staticmethod(lambda: now)}))
    composed = []
    for _ in range(2):  # two processes' configs (compose_train pins the run folder as Hydra has it)
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            composed.append(compose("train", [f"paths.log_dir={tmp_path}"], return_hydra_config=True))
    runs = tmp_path / composed[0].task_name / "runs"
    expected = [runs / shared] * 2 if shared else [
        runs / "2026-12-07_12-00-00", runs / "2026-12-07_12-00-00_2"
    ]  # fmt: skip
    assert [Path(c.hydra.run.dir) for c in composed] == expected
    if not shared:
        assert all(folder.is_dir() for folder in expected)
        sweeps = [Path(c.hydra.sweep.dir).name for c in composed]
        assert sweeps == ["2026-12-07_12-00-00", "2026-12-07_12-00-00_2"]


def test_composing_creates_no_folder_and_eval_names_its_own(tmp_path, monkeypatch):
    # eval.yaml set hydra.run.dir over train's, and OmegaConf's merge resolves the value it replaces:
    # every eval.py run created an empty train run folder and sweep folder. (The folder's root from the
    # environment: a command-line override applies after the merges.)
    monkeypatch.setenv("PROJECT_ROOT", str(tmp_path))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("eval", return_hydra_config=True)
    assert not list(tmp_path.iterdir())
    run = Path(cfg.hydra.run.dir)
    assert run.parent == tmp_path / "logs" / cfg.task_name / "evals" and run.is_dir()
    assert [p.name for p in (tmp_path / "logs" / cfg.task_name).iterdir()] == ["evals"]


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, 0),
        ({"RANK": "3", "LOCAL_RANK": "1"}, 3),  # torchrun
        ({"SLURM_PROCID": "5"}, 5),  # srun's task
        ({"SLURM_PROCID": "0", "LOCAL_RANK": "3"}, 3),  # Lightning's child inside an sbatch script
        ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, 1),  # Lightning's launcher, first process of node 1
    ],
)
def test_a_process_is_rank_0_only_when_its_launcher_says_so(environ, expected, monkeypatch):
    # Lightning's launcher sets no RANK: its processes in an sbatch script inherited SLURM_PROCID=0 and
    # every one logged (and would write a sweep's summary) as rank 0.
    from lightning_vlm.parallel.collectives import launcher_rank

    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert launcher_rank() == expected
