"""Two FSDP processes (CPU, gloo) saving sharded ``last.ckpt`` folders, killed in the middle of a save.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/_fsdp_killed_save.py OUT

``last.ckpt`` is written at steps 2 and 4. At step 3 rank 0 records a digest of every file of the step-2
folder (``OUT/step2.json``); at step 4 each rank writes its shard, truncates it to half (a write cut
short), and the process dies (``os._exit(137)``, as SIGKILL: no handler runs). The test then finds the
step-2 checkpoint whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from ddp_helpers import COMMON, TWO_PROCESSES_FSDP  # noqa: E402

from helpers import compose_train  # noqa: E402
from lightning_vlm.training import train  # noqa: E402


def digests(folder: Path) -> dict[str, str]:
    """Each file of a checkpoint folder, by its path inside it, with its content's SHA-256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


class KillInSave(L.Callback):
    """Records ``last.ckpt`` after its step-2 save; kills every rank inside the step-4 save."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        last = self.out / "checkpoints" / "last.ckpt"
        if trainer.global_step == 3 and trainer.is_global_zero:
            (self.out / "step2.json").write_text(json.dumps(digests(last)))
        if trainer.global_step == 4:
            import lightning.pytorch.strategies.fsdp as fsdp

            save = fsdp._distributed_checkpoint_save

            def cut_short(state: dict, path: Path) -> None:
                save(state, path)
                for shard in Path(path).glob(f"__{trainer.global_rank}_*.distcp"):
                    data = shard.read_bytes()
                    shard.write_bytes(data[: len(data) // 2])
                os._exit(137)

            fsdp._distributed_checkpoint_save = cut_short


def main() -> None:
    out = Path(sys.argv[1])
    overrides = [
        *[o for o in COMMON if not o.startswith(("callbacks=", "trainer.max_steps"))],
        *TWO_PROCESSES_FSDP, "trainer.max_steps=4", "callbacks=model_checkpoint", "~callbacks.model_checkpoint",
        "callbacks.last_checkpoint.every_n_train_steps=2",
        "+callbacks.kill._target_=_fsdp_killed_save.KillInSave", f"+callbacks.kill.out={out}",
    ]  # fmt: skip
    train(compose_train(overrides, out))


if __name__ == "__main__":
    main()
