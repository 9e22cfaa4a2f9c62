"""Score a checkpoint or an HF folder on a validation set: `python eval.py ckpt_path=...ckpt` (see README)."""

import hydra
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from lightning_vlm.evaluation import evaluate
from lightning_vlm.training import metric_value


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point: runs the method's validation and prints where the JSON report went; returns
    the optimised metric, so an ``eval.py -m`` sweep's summary ranks its jobs as train.py's does."""
    report, path = evaluate(cfg)
    if rank_zero_only.rank == 0:  # every process evaluates; rank 0 wrote the report
        print(f"Evaluation report ({report['num_rows']} rows): {path}")
    return metric_value(report["metrics"], cfg.get("optimized_metric"))


if __name__ == "__main__":
    main()
