"""Checkpoint files written atomically and read with ``weights_only=True``: a Lightning ``CheckpointIO``.

Lightning's ``TorchCheckpointIO`` serialises the whole checkpoint into memory, then writes it through an
fsspec transaction, whose local temporary file is made in the *system* temp folder (``TMPDIR``) and
moved onto the target with ``shutil.move``. When that folder is on another filesystem (a tmpfs
``/tmp``, a node-local disk beside a network volume), the move is a copy onto ``last.ckpt`` itself: a
crash or a kill during the copy leaves it truncated, and the previous good copy is already gone.
Nothing is fsynced either, so a machine crash can leave a renamed file with no data.

:class:`AtomicCheckpointIO` streams ``torch.save`` into a temporary file *beside the target*, fsyncs it,
then ``os.replace``-s it onto the target (atomic within one filesystem) and fsyncs the folder: the
target is always either the previous complete checkpoint or the new complete one. Set on the trainer
through ``trainer.plugins`` (``conf/trainer/default.yaml``). Strategies that write folders themselves
do not call ``save_checkpoint``: FSDP's sharded checkpoints are swapped in whole instead
(``parallel/folder_swap.py``); DeepSpeed's are written in place, as DeepSpeed writes them.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

TEMP_SUFFIX = ".tmp"


class CheckpointLoadError(pickle.UnpicklingError, ValueError):
    """A checkpoint file that cannot be read safely (damaged, not a checkpoint, or holding objects a
    ``weights_only=True`` load refuses). Both an ``UnpicklingError`` (what ``torch.load`` raises) and a
    ``ValueError`` (a bad ``ckpt_path``), so callers catching either see it."""


def temp_name(target: Path) -> Path:
    """A fresh temporary path in ``target``'s folder (hidden, so no ``*.ckpt`` glob or Lightning's
    ``ckpt_path="last"`` search ever picks it)."""
    return target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")


def stale_temps(target: Path) -> list[Path]:
    """Temporary files of earlier writes of ``target`` that never completed (a killed writer)."""
    return sorted(target.parent.glob(f".{target.name}.*{TEMP_SUFFIX}"))


def remove_leftover(path: Path) -> None:
    """Removes a killed write's temporary file, or folder (a sharded save's: ``parallel/folder_swap.py``)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fsync_folder(folder: Path) -> None:
    """Makes renames in ``folder`` durable (where the platform lets a folder be synced)."""
    # The rename is durable only once the folder's entry is on disk (POSIX); some filesystems and
    # platforms cannot open a folder for fsync, and the file's own data is already synced then.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves replace the target atomically (temporary file in the target's
    folder, fsync, ``os.replace``) and whose loads default to ``weights_only=True`` with errors that name the
    file. Remote paths (``s3://``...) keep Lightning's write: an object store's upload is already atomic."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Writes ``checkpoint`` to ``path``; until the new file is complete, ``path`` keeps its old content."""
        fs, local = url_to_fs(str(path))
        if not isinstance(fs, LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        target = Path(local)
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = temp_name(target)
        try:
            # "x": never write into a file someone else made (permissions as any new file: the umask's).
            with open(temp, "xb") as file:
                self.write(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, target)
        except BaseException:
            # An exception (disk full, KeyboardInterrupt) leaves no partial file; a SIGKILL leaves the
            # temporary one, removed by the next complete write of this target (below).
            temp.unlink(missing_ok=True)
            raise
        fsync_folder(target.parent)
        for leftover in stale_temps(target):
            remove_leftover(leftover)

    def write(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        """Serialises ``checkpoint`` into the open temporary ``file``, streamed: no second copy in memory
        (Lightning's write holds the whole serialised checkpoint in a buffer first)."""
        torch.save(checkpoint, file)

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Reads the checkpoint at ``path``, ``weights_only=True`` unless the caller says otherwise; a file
        that cannot be read raises :class:`CheckpointLoadError` naming it."""
        # Lightning passes None through, and turns None into False for http(s) paths: unpickling a
        # downloaded file could run its code. Only tensors and plain containers are accepted here.
        weights_only = True if weights_only is None else weights_only
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError as err:
            # From None: torch's text suggests weights_only=False, i.e. running the file's code.
            raise CheckpointLoadError(_refused(path, err)) from None
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            raise  # their own messages name the path and say what is wrong
        except Exception as err:
            # How a short or damaged file shows: the zip reader's RuntimeError, EOF, a seek past its start,
            # or (random bytes read as a legacy pickle) whatever the unpickler trips on, e.g. a KeyError.
            raise CheckpointLoadError(
                f"ckpt_path={str(path)!r} could not be read as a PyTorch checkpoint "
                f"({type(err).__name__}: {_first_line(err) or 'the file ends early'}): the file is empty, "
                "truncated (copied or written only in part), or not a checkpoint."
            ) from err


def _first_line(err: BaseException) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), "")


def _refused(path: _PATH, err: pickle.UnpicklingError) -> str:
    # torch's message: a preamble that advises weights_only=False (running the file's code), "what it
    # met" (after "WeightsUnpickler error:" in some versions), then pointers to its docs. Only what it met.
    text = str(err).split("WeightsUnpickler error:", 1)[-1]
    advice = ("weights_only", "Weights only load failed", "Check the documentation", "torch.serialization")
    kept = [" ".join(p.split()) for p in text.split("\n\n") if p.strip() and not any(a in p for a in advice)]
    detail = " ".join(kept).strip().rstrip(".") or "an object that is not a tensor or a plain value"
    return (
        f"ckpt_path={str(path)!r}: Weights only load failed ({detail}). lightning-vlm checkpoints hold only "
        "tensors and plain values, and load with weights_only=True, which never runs code from the file; "
        "this one is damaged, not a PyTorch checkpoint, or holds other Python objects."
    )
