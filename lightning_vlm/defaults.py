"""A constructor's settings and their defaults, read from its signature: the one place they are written.

Config nodes are built from them (``config.signature_defaults``), and a setting a user changed is told
from them (the warnings about settings that do nothing).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any


def init_defaults(target: type) -> dict[str, Any]:
    """``target.__init__``'s named settings and their defaults (``inspect.Parameter.empty`` for one
    without), in signature order; ``self``, ``*args`` and ``**kwargs`` left out."""
    return {
        name: param.default
        for name, param in inspect.signature(target.__init__).parameters.items()
        if name != "self" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
    }


def config_value(value: Any) -> Any:
    """``value`` as a config holds it: mappings as dicts and tuples as lists, at every depth (YAML, and
    hparams that a checkpoint loads with ``weights_only=True``, know no tuples or mapping proxies)."""
    if isinstance(value, Mapping):
        return {k: config_value(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [config_value(v) for v in value]
    return value
