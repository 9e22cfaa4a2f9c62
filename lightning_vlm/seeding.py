"""``seed=null``: an unseeded run draws one seed, the same for every process, and logs it.

The data order (``data.seed: ${seed}``), the online methods' sampling and dropout all start from the seed.
Left None, the data's sampler failed at its first batch (``None + epoch``). Drawn per process, the ranks
would shuffle the epoch differently, and their shards (cut from one order) would overlap and miss rows.
So rank 0 draws it; the processes Lightning's launcher starts later inherit it through the environment.
Processes started together by torchrun or srun, or on several nodes, have no way to agree before their
process group exists, so there ``seed=null`` is refused.
"""

from __future__ import annotations

import logging
import os
import secrets

log = logging.getLogger(__name__)

# Set by rank 0 once drawn; Lightning's launcher starts the other ranks with rank 0's environment.
DRAWN_SEED_ENV = "LIGHTNING_VLM_DRAWN_SEED"


def drawn_seed(num_nodes: int = 1) -> int:
    """The run's seed for ``seed=null``: rank 0's draw on every process, or a ``ValueError``.

    ``num_nodes`` (``trainer.num_nodes``): each node's rank 0 would draw its own. WORLD_SIZE does not tell
    processes started together: Lightning's launcher leaves it (and LOCAL_RANK=0) in rank 0's environment,
    where the next job of an in-process sweep finds it; torchrun's run id and srun's task count do."""
    if int(os.environ.get("LOCAL_RANK", "0")) > 0 and DRAWN_SEED_ENV in os.environ:
        return int(os.environ[DRAWN_SEED_ENV])  # a process Lightning's launcher started from rank 0's
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun sets its workers' WORLD_SIZE itself
        tasks = max(tasks, int(os.environ.get("WORLD_SIZE", "1")))
    if tasks > 1 or num_nodes > 1:
        started = "on several nodes" if num_nodes > 1 else "together (torchrun, srun)"
        raise ValueError(
            f"seed=null with processes started {started}: each would draw its own seed, and their shards of "
            "the data, cut from differently shuffled epochs, would overlap. Pass seed=<int> (e.g. seed=$RANDOM)"
        )
    seed = secrets.randbelow(2**31)
    os.environ[DRAWN_SEED_ENV] = str(seed)
    log.warning(
        "seed=null: this run draws seed=%d (pass seed=%d to repeat it, or to resume it exactly)", seed, seed
    )
    return seed
