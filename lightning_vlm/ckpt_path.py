"""``ckpt_path``, as train.py and eval.py accept it: local files only, and errors that name it.

Checkpoints load with ``weights_only=True`` (:class:`lightning_vlm.checkpoint_io.AtomicCheckpointIO`):
tensors and plain values, never code from the file. Lightning would download a URL and unpickle it with
``weights_only=False``, so URLs are refused here, before anything loads.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_vlm.checkpoint_io import CheckpointLoadError
from lightning_vlm.parallel.folder_swap import set_aside

log = logging.getLogger(__name__)

# Lightning resolves these itself, to files its checkpoint callbacks wrote (loaded like any other path).
LIGHTNING_KEYWORDS = ("last", "best", "hpc")


def checkpoint_to_load(ckpt_path: str | None, trainer: L.Trainer, resuming: bool = False) -> str | None:
    """The local checkpoint ``trainer.fit``/``trainer.validate`` may load, or an error saying why not.

    URLs are refused (a checkpoint is fetched by hand, then loaded with ``weights_only=True``); a
    folder (FSDP's sharded checkpoints, DeepSpeed's) loads only through the strategy that wrote it.
    ``resuming`` (train.py): ``ckpt_path=last`` without a ``last.ckpt`` starts from the initial weights,
    saying so (a requeued job's first start); elsewhere it is refused.
    """
    if not ckpt_path:
        return None
    if str(ckpt_path) in LIGHTNING_KEYWORDS:
        return _keyword(str(ckpt_path), trainer, resuming)
    check_ckpt_path(ckpt_path)
    return _loadable(Path(ckpt_path), str(ckpt_path), trainer)


def check_ckpt_path(ckpt_path: str | None) -> None:
    """What can be said of ``ckpt_path`` before anything is built (``settings_check``): a URL, or no such
    file. A typo would otherwise be found after the model loaded (minutes for a large one) and a W&B run
    started."""
    if not ckpt_path or str(ckpt_path) in LIGHTNING_KEYWORDS:
        return
    if "://" in str(ckpt_path):
        raise ValueError(
            f"ckpt_path={ckpt_path!r} is a URL: train.py and eval.py load local files only (with "
            "weights_only=True). Download the checkpoint and pass its path."
        )
    if not Path(ckpt_path).exists():
        raise FileNotFoundError(
            f"ckpt_path={ckpt_path!r}: no such file or folder{_set_aside_hint(Path(ckpt_path))}"
        )


def _set_aside_hint(target: Path) -> str:
    """Where a sharded save killed between its two renames left the previous checkpoint (folder_swap.py)."""
    kept = set_aside(target)
    if not kept:
        return ""
    return (f"; a save of it was killed while putting the new checkpoint in place, and the previous complete one "
            f"is kept as {kept[-1]}: move it back (mv {kept[-1]} {target}) to resume from it")  # fmt: skip


def _loadable(path: Path, given: str, trainer: L.Trainer) -> str:
    """``path`` (what ``ckpt_path=given`` names), unless it is a folder this trainer's strategy cannot load."""
    if path.is_dir():
        from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

        found = "" if given == str(path) else f" found {str(path)!r}, which"
        files = sorted(p.name for p in path.glob("*.ckpt") if p.is_file())
        if files:  # a run's checkpoints folder
            raise ValueError(f"ckpt_path={given!r}{found} is a folder that holds the checkpoints "
                             f"{', '.join(files)}: pass one of them (last.ckpt resumes)")  # fmt: skip
        if (path / "config.json").is_file() and not (path / "meta.pt").is_file():
            raise ValueError(
                f"ckpt_path={given!r}{found} is a Hugging Face model folder: pass it as "
                f"model.model_name_or_path={given} (ckpt_path takes Lightning checkpoints)"
            )
        if not isinstance(trainer.strategy, FSDPStrategy | DeepSpeedStrategy):
            raise ValueError(
                f"ckpt_path={given!r}{found} is a folder: a sharded (FSDP) or DeepSpeed checkpoint, which "
                f"loads only through the strategy that wrote it (this trainer's is "
                f"{type(trainer.strategy).__name__}). Load it with the training run's strategy, e.g. "
                "`trainer=fsdp trainer.devices=<N>`, or use the HF folder an ExportHFModel callback "
                "wrote (`model.model_name_or_path=<dir>`)."
            )
    return str(path)


def _state_file(folder: Path) -> Path:
    """Where a checkpoint folder keeps Lightning's own entries: FSDP's sharded checkpoints in meta.pt,
    DeepSpeed's beside rank 0's model states (``checkpoint/[zero_pp_rank_0_]mp_rank_00_model_states.pt``)."""
    if (folder / "meta.pt").is_file():
        return folder / "meta.pt"
    deepspeed = sorted((folder / "checkpoint").glob("*mp_rank_00_model_states.pt"))
    return deepspeed[0] if deepspeed else folder / "meta.pt"


def checkpoint_entries(ckpt_path: str | os.PathLike | None) -> dict[str, Any] | None:
    """Lightning's top-level entries (hyper-parameters, callback states, ...) of the local checkpoint at
    ``ckpt_path``, a file or an FSDP or DeepSpeed checkpoint's folder; None for no such local file or one
    that does not load (the fit's own load then says what is wrong with it). Read with
    ``weights_only=True`` and memory-mapped: the weights are not read."""
    if not ckpt_path or "://" in str(ckpt_path):
        return None
    path = Path(ckpt_path)
    file = _state_file(path) if path.is_dir() else path
    if not file.is_file():
        return None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # damaged, not a zip checkpoint, ...: reported by the fit's load
        log.debug("checkpoint entries not read from %s: %s", file, err)
        return None
    return state if isinstance(state, dict) else None


def last_checkpoint(callbacks: Iterable[Any]) -> Path | None:
    """The newest ``last.ckpt`` (a file, or FSDP's folder) in the folders of ``callbacks``' checkpoint
    callbacks: what Lightning's ``ckpt_path=last`` loads. train.py reads the W&B run id from it before
    the Trainer exists, so it takes the callbacks, not a Trainer."""
    found = [
        Path(c.dirpath) / "last.ckpt"
        for c in callbacks
        if isinstance(c, ModelCheckpoint) and c.dirpath and (Path(c.dirpath) / "last.ckpt").exists()
    ]
    return max(found, key=lambda f: f.stat().st_mtime) if found else None


def _keyword(keyword: str, trainer: L.Trainer, resuming: bool) -> str | None:
    """Lightning's keyword, where it can find a file ("last": that file's path). "last" and "best" search this run's checkpoint
    folders, and a train.py run writes a new one unless ``hydra.run.dir`` is pinned: there Lightning
    finds nothing, warns, and trains (or evaluates) the initial weights. Only a resume may do so, and it
    says so; otherwise the error says which path to give."""
    if keyword == "hpc":  # SLURM's own checkpoint in default_root_dir: Lightning resolves it
        return keyword
    found = last_checkpoint(trainer.checkpoint_callbacks) if keyword == "last" else None
    if found is not None:
        return _loadable(found, keyword, trainer)
    # dict: each folder once (the best and the last checkpoints share one)
    folders = dict.fromkeys(
        Path(c.dirpath) for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)
    )
    where = ", ".join(map(str, folders)) or "none: no checkpoint callback"
    for folder in folders if keyword == "last" else ():
        if hint := _set_aside_hint(folder / "last.ckpt"):
            raise FileNotFoundError(f"ckpt_path=last: no {folder / 'last.ckpt'}{hint}")
    if keyword == "last" and resuming:
        log.warning("ckpt_path=last: no last.ckpt in %s, so training starts from the initial weights (a "
                    "run resumes its own folder only when hydra.run.dir is pinned)", where)  # fmt: skip
        return None
    raise FileNotFoundError(
        f"ckpt_path={keyword}: Lightning looks in this run's own checkpoint folders ({where}), which hold "
        f"no {keyword} checkpoint (each run writes a new folder). Give the file of the run to resume or "
        "score, e.g. ckpt_path=logs/<task>/runs/<run>/checkpoints/last.ckpt"
    )


# Lightning's functions that read ckpt_path and load its weights into the module, and its optimizer
# state into the optimizers (ValueError: groups of other sizes, when other parameters train).
_RESTORING = {"resume_start", "restore_model", "restore_optimizers_and_schedulers"}


def _raised_restoring(err: BaseException) -> bool:
    return any(
        frame.f_code.co_name in _RESTORING and frame.f_code.co_filename.endswith("checkpoint_connector.py")
        for frame, _ in traceback.walk_tb(err.__traceback__)
    )


@contextmanager
def restore_errors(ckpt_path: str | None, module: L.LightningModule) -> Iterator[None]:
    """Re-raises a failure to load ``ckpt_path``'s weights into ``module`` (another method's checkpoint,
    another model or LoRA setting: missing, unexpected or differently shaped weights) as a ``ValueError``
    naming ``ckpt_path``; every other error passes unchanged."""
    try:
        yield
    except (RuntimeError, ValueError) as err:
        # A file that is no checkpoint at all says so itself (CheckpointLoadError).
        if not ckpt_path or isinstance(err, CheckpointLoadError) or not _raised_restoring(err):
            raise
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        detail = " ".join(lines[:3]).rstrip(".")
        detail = detail if len(detail) <= 600 else detail[:600] + " ..."
        raise ValueError(
            f"ckpt_path={ckpt_path!r} does not fit this run's {type(module).__name__} module: {detail}. "
            "A checkpoint loads into the method, model and LoRA setting that wrote it, with the same "
            "parameters trained (pass the training run's method=/model=/lora= overrides and "
            "model.freeze_vision_tower); to start another method from its weights, export them "
            "(callbacks=[default,export]) and pass model.model_name_or_path=<that folder>."
        ) from err
