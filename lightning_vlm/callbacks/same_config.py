"""Every process of a run must have composed the same config.

Processes that torchrun, SLURM or a hand-made launch start each compose their own config from their own
command line, config files and sweeper. They can disagree without a sign: a ``conf/local`` file (git-ignored,
machine-specific) on one node and not another, an Optuna sweeper proposing other values on one rank, a
command line edited for one task. DDP then trains with one learning rate per rank, or hangs where a batch
size changes a collective's shape. ``SameConfig`` compares the configs (as written, before interpolation)
once the process group exists, before anything trains, and refuses the run naming the settings that differ.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf

from lightning_vlm.parallel.collectives import all_gather_object

_SHOWN = 5


def flat_settings(cfg: DictConfig) -> dict[str, str]:
    """``cfg`` as ``{dotted key: repr of its value}``, interpolations as written (not resolved: resolvers may
    build things); Hydra's own node left out (run folders and job numbers are its business)."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(node, list) and node:
            for i, value in enumerate(node):
                walk(value, f"{prefix}[{i}]")
        else:
            out[prefix] = repr(node)

    container = OmegaConf.to_container(cfg, resolve=False)
    walk({k: v for k, v in container.items() if k != "hydra"}, "")
    return out


class SameConfig(L.Callback):
    """Refuses, on every rank, a run whose ranks composed different configs (a collective at setup)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.settings = flat_settings(cfg)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size == 1:
            return
        ranks = all_gather_object(self.settings)
        differ = sorted(k for k in set().union(*ranks) if len({r.get(k, "<absent>") for r in ranks}) > 1)
        if differ:
            shown = "; ".join(
                f"{k}: " + ", ".join(f"rank {i} {r.get(k, '<absent>')}" for i, r in enumerate(ranks))
                for k in differ[:_SHOWN]
            )
            more = f" (and {len(differ) - _SHOWN} more)" if len(differ) > _SHOWN else ""
            raise ValueError(
                f"the {len(ranks)} processes of this run composed different configs: {shown}{more}. Each "
                "process composes its own: give every one the same command line and config files (a "
                "conf/local file on one machine only, a sweeper proposing other values per rank, ...)"
            )
