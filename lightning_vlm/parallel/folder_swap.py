"""Checkpoint folders replaced whole, as ``checkpoint_io.py`` replaces checkpoint files.

Lightning's FSDP strategy writes a sharded checkpoint (a folder: one shard file per rank, torch's
``.metadata``, rank 0's ``meta.pt``) into its folder in place, reopening and emptying each file. A kill
during a save (a scheduler's SIGKILL after its grace period, a node failure) left ``last.ckpt/`` a mix
of the previous save and the new one: no complete checkpoint to resume, or, with the shards written and
``meta.pt`` not, the new weights under the old step, data position and RNG. So the ranks write into a
fresh hidden folder beside the target (``VLMFSDPStrategy.save_checkpoint``), and once every rank has,
rank 0 puts it in place here: one ``renameat2(RENAME_EXCHANGE)`` swaps the two folders atomically
(Linux, local filesystems), then the old one is removed. Where the filesystem cannot exchange (NFS, other
systems) the old folder is moved aside first: a kill between the two renames leaves no target, and
:func:`set_aside` names the complete checkpoint kept beside it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import uuid
from pathlib import Path

from lightning_vlm.checkpoint_io import fsync_folder, remove_leftover, stale_temps

OLD_SUFFIX = ".old"
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two existing paths atomically; False where the system or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # not Linux, or a libc without it (glibc < 2.28)
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False  # a filesystem without exchange (NFS, overlay on some kernels)
    raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def swap_in(new: Path, target: Path) -> None:
    """Puts the complete folder ``new`` at ``target``, whose old content (a folder or a file) is removed
    once it is no longer the target; at every moment ``target`` is the old checkpoint or the new one
    (with exchange), or, without, a kill between two renames leaves the old one beside it (``set_aside``)."""
    if not target.exists():
        os.replace(new, target)
    elif target.is_dir() and _exchange(new, target):
        remove_leftover(new)  # the old checkpoint, now at the temporary name
    else:
        aside = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}{OLD_SUFFIX}")
        os.replace(target, aside)
        os.replace(new, target)
        remove_leftover(aside)
    fsync_folder(target.parent)
    for leftover in (*stale_temps(target), *set_aside(target)):
        remove_leftover(leftover)  # folders of saves killed before their swap


def set_aside(target: Path) -> list[Path]:
    """Complete checkpoints a swap without exchange moved aside from ``target`` and was killed before
    putting the new one in place (then ``target`` is missing)."""
    return sorted(target.parent.glob(f".{target.name}.*{OLD_SUFFIX}"))
