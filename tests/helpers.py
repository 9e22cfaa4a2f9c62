"""Test helpers: composing the project's Hydra configs the way train.py does."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

import lightning_vlm.config  # noqa: F401  (resolvers)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def group_options(group: str) -> list[str]:
    """Selectable options of a config group (files starting with `_` are shared bases)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("_"))


def compose_train(overrides: list[str], output_dir: Path | None = None) -> DictConfig:
    """The config train.py would run with these overrides, with Hydra's runtime values set."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir or ROOT / "logs" / "tests")
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    return cfg
