"""Train a VLM with any method: `python train.py method=grpo model=qwen2_5_vl` (see README)."""

import hydra
from omegaconf import DictConfig

from lightning_vlm.training import metric_value, train


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the optimised metric so sweepers can use it."""
    metrics, _ = train(cfg)
    return metric_value(metrics, cfg.get("optimized_metric"), warn=False)  # train() warned already


if __name__ == "__main__":
    main()
