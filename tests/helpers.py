"""Test helpers: composing the project's Hydra configs the way train.py does."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

import lightning_vlm.config  # noqa: F401  (resolvers)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# TR-DPO's reference syncs added to a run (callbacks/reference_sync.py); REF_SYNC: halfway every step
SYNC_REF = "+callbacks.sync_ref._target_=lightning_vlm.callbacks.reference_sync.ReferenceSync"
REF_SYNC = [SYNC_REF, "+callbacks.sync_ref.sync_steps=1", "+callbacks.sync_ref.mixup_alpha=0.5"]


def group_options(group: str) -> list[str]:
    """Selectable options of a config group (files starting with `_` are shared bases)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("_"))


def compose_train(
    overrides: list[str], output_dir: Path | None = None, config_name: str = "train"
) -> DictConfig:
    """The config train.py (eval.py: ``config_name="eval"``) would run with these overrides, with
    Hydra's runtime values set."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir or ROOT / "logs" / "tests")
        cfg.hydra.job.num = 0
        # As Hydra leaves them resolved: each folder is created when its name resolves (config.py), and a
        # test's train() resolves the whole config (hparams), hydra node included. A folder the test
        # gives (hydra.sweep.dir=...) stays.
        for node in (cfg.hydra.run, cfg.hydra.sweep):
            if OmegaConf.is_interpolation(node, "dir"):
                node.dir = cfg.hydra.runtime.output_dir
    HydraConfig.instance().set_config(cfg)
    return cfg


def validate_at_the_end(cfg: DictConfig) -> None:
    """Validate only before (``validate_before_fit``) and after training: a learning test reads those two,
    and validation runs in a forked RNG, so the training run is the one validated every N steps. The
    interval counts batches: where a batch takes several optimizer steps (GSPO's steps_per_generation),
    fit ends before it, and train() validates the final weights once instead (training.py)."""
    cfg.trainer.val_check_interval = cfg.trainer.max_steps


def reward_gains(
    overrides: list[str], bars: dict[str, float], output_dir: Path, seeds: tuple[int, ...] = (0,),
    configure: Callable[[DictConfig], None] | None = None,
) -> dict[str, list[float]]:  # fmt: skip
    """Train the job ``overrides`` per seed (``validate_before_fit=true`` among them); per reward
    function in ``bars``, its sampled validation mean after training minus before, one entry per seed run.

    A test asks for the median gain over ``seeds`` to reach each reward's bar. With an odd number of
    seeds that verdict is settled once a majority of them pass (or fail) for every reward, and the
    median of the gains run so far then gives the same verdict, so the remaining seeds are not run."""
    from lightning_vlm.training import train

    gains: dict[str, list[float]] = {reward: [] for reward in bars}
    for seed in seeds:
        cfg = compose_train([*overrides, f"seed={seed}"], output_dir / f"seed{seed}")
        if configure is not None:
            configure(cfg)
        metrics, out = train(cfg)
        for reward in bars:
            before = out["initial_metrics"][f"val/rewards/{reward}"]
            after = float(metrics[f"val/rewards/{reward}"])
            print(f"{' '.join(overrides)}, seed {seed}: sampled {reward} {before:.3f} -> {after:.3f}")
            gains[reward].append(after - before)
        if all(_median_settled(gains[r], bars[r], len(seeds)) for r in bars):
            break
    return gains


def _median_settled(gains: list[float], bar: float, seeds: int) -> bool:
    """Whether the median over ``seeds`` runs reaching ``bar`` is already known from ``gains``."""
    if seeds % 2 == 0:  # the median of an even count averages two runs: every run is needed
        return len(gains) == seeds
    passed = sum(g >= bar for g in gains)
    return max(passed, len(gains) - passed) > seeds // 2


class RaiseAt(L.Callback):
    """Fails a job in the middle: raises at the end of its first train (or validation) batch."""

    def on_train_batch_end(self, *args) -> None:
        raise RuntimeError("boom in training")

    def on_validation_batch_end(self, trainer: L.Trainer, *args) -> None:
        if not trainer.sanity_checking:
            raise RuntimeError("boom in validation")


class TowerCounter:
    """Counts vision-tower calls and the images (patch rows for Qwen, tiles for LLaVA-Next) they see."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.calls, self.units = 0, 0
        self.handle = tower.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        first = args[0] if args else next(v for v in kwargs.values() if torch.is_tensor(v))
        self.calls += 1
        self.units += first.shape[0]

    def __enter__(self) -> TowerCounter:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


# What lora=default trains: the adapter factors and PEFT's trainable copies (modules_to_save).
LORA_TRAINED = ("lora_A", "lora_B", "modules_to_save")


def trained_by_lora(name: str) -> bool:
    """Whether PEFT parameter ``name`` is one LoRA training updates."""
    return any(part in name for part in LORA_TRAINED)


def base_name(name: str) -> str:
    """The HF model's name of a frozen PEFT parameter (``base_layer``/``original_module`` unwrapped)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "").replace(".original_module", "")


def mixed_rows(shape: str = "prompt", seed: int = 7) -> list[dict]:
    """Three synthetic rows in one batch: an image row, a text-only row, and a row with three images
    of different sizes (64x64, the task's 112x112, 128x96): what every VLM trainer gets wrong somewhere."""
    from lightning_vlm.data.synthetic import synthetic_rows

    rows = synthetic_rows(shape, 3, seed=seed)
    turn = rows[1]["prompt"][0] if shape != "sft" else rows[1]["messages"][0]
    rows[1]["images"] = []
    turn["content"] = [b for b in turn["content"] if b["type"] == "text"]
    image = rows[2]["images"][0]
    rows[2]["images"] = [image.resize((64, 64)), image, image.resize((128, 96))]
    first = rows[2]["prompt"][0] if shape != "sft" else rows[2]["messages"][0]
    first["content"][:0] = [{"type": "image"}, {"type": "image"}]
    return rows


def fake_scontrol(tmp_path: Path) -> tuple[str, Path]:
    """A ``scontrol`` that records its arguments (one call a line) in the returned file; the first value is
    a PATH that finds it first. SLURM does not run here: this is the requeue's only witness."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}", calls
