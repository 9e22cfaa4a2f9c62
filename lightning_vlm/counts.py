"""Counts and sizes given as settings (rows, tokens, completions): whole numbers > 0, refused naming the setting.

Apart from ``settings_check`` (which imports the data package) so that the DataModules and methods can
check their own counts without importing it back.
"""

from __future__ import annotations

from typing import Any


def check_count(setting: str, value: Any, allow_none: bool = True, hint: str = "") -> None:
    """Raise ``ValueError`` naming ``setting`` unless ``value`` is a whole number > 0 (or None if allowed):
    sizes and counts (rows, tokens, completions), which a 2.5 breaks far from the setting."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        null = " or null" if allow_none else ""
        raise ValueError(f"{setting} must be a whole number > 0{null}, got {value!r}{hint}")
