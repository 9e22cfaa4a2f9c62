"""How a raw row becomes our columns before normalisation: renames, prompt/answer templates, a system turn.

Open-r1 style prompt sets carry a question column (``problem``), an answer column (``solution``) and an
image, not a conversation. ``prompt_template`` (a Python format string over the row's columns, e.g.
``"{problem}"``) builds the user turn from them; ``normalize_row`` then puts the row's image block(s)
first in that turn, as for any plain-string prompt. For SFT data ``answer_template`` builds the
assistant turn the same way. ``system_prompt`` is prepended to every conversation as a system turn
(a row that has its own system turn keeps it). Templates see the columns after ``column_map``.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_vlm.data.image_budget import ImageBudget
from lightning_vlm.data.images import WHITE, load_row, rgb_background
from lightning_vlm.data.placeholders import control_token_error, control_token_in, model_image_token_in
from lightning_vlm.data.row_error import RowError
from lightning_vlm.data.rows import SHAPES, normalize_row

# The conversation column each shape's template fills, and the one the system turn goes in front of.
CONVERSATION: dict[str, str] = {
    "sft": "messages",
    "preference": "prompt",
    "prompt": "prompt",
    "unpaired": "prompt",
}


class BadRow(dict):
    """A raw row that a view over a source already knows is bad (``unpair``: a pair without its chosen
    or rejected answer): empty, carrying what is wrong. ``RowFormat.fill`` raises it as a RowError, where
    every row's problems are raised, so it names the row and ``on_bad_row=skip`` skips it."""

    def __init__(self, column: str, reason: str, detail: str) -> None:
        super().__init__()
        self.column, self.reason, self.detail = column, reason, detail


def check_column_map(column_map: Any) -> None:
    """A mapping of the data's column names to ours, no two onto one: which of them won depended on the
    row's key order, and the other column was lost."""
    if not isinstance(column_map, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in column_map.items()
    ):
        raise ValueError(f"data.column_map must map column names to column names, got {column_map!r}")
    targets = list(column_map.values())
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        sources = {t: sorted(k for k, v in column_map.items() if v == t) for t in twice}
        raise ValueError(f"data.column_map maps several columns onto one: {sources}")


def rename(row: Mapping, column_map: Mapping[str, str]) -> dict:
    """The row with user column names mapped to ours (a mapped column wins over one already named so); a
    dotted name reads a nested field (``reward_model.ground_truth``).

    A renamed column is gone under its old name: kept, it would pass through to the methods, and
    ``{image: images}`` would leave a row with both image columns."""
    if not column_map:
        return dict(row)
    # Only columns this row has replace ours: a row already written with our name keeps it.
    values = {k: _lookup(row, k) for k in column_map}
    present = {k for k, v in values.items() if v is not None}
    replaced = {column_map[k] for k in present}
    out = {k: v for k, v in row.items() if k not in column_map and k not in replaced}
    out.update({column_map[k]: values[k] for k in present})
    return out


def _lookup(row: Mapping, key: str) -> Any:
    """``row[key]``, or, for a dotted key the row has no column of, the nested field it names (verl's
    ``reward_model.ground_truth``; the outer column stays as it is); None when there is none."""
    if key in row or "." not in key:
        return row.get(key)
    head, _, rest = key.partition(".")
    inner = row.get(head)
    return _lookup(inner, rest) if isinstance(inner, Mapping) else None


def template_columns(template: str, setting: str) -> tuple[str, ...]:
    """The columns a format string names (``"{problem}"`` -> ``("problem",)``); a bad one raises naming
    the ``setting`` it came from."""
    if not isinstance(template, str):  # e.g. Hydra read an unquoted {problem} as a dict
        raise ValueError(
            f"{setting} must be a string, got {type(template).__name__} {template!r}; on the command line "
            f"quote it: '{setting}=\"{{problem}}\"'"
        )
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:  # unbalanced braces
        raise ValueError(
            f"{setting}={template!r} is not a Python format string ({e}); write literal braces as {{{{ }}}}"
        ) from None
    # "{problem}", "{meta[id]}" and "{meta.id}" all read column problem / meta.
    roots = [name.split(".")[0].split("[")[0] for name in fields]
    if any(not root or root.isdigit() for root in roots):
        raise ValueError(f"{setting}={template!r}: every {{...}} must name a column, e.g. {{problem}}")
    return tuple(dict.fromkeys(roots))


class _NotText(TypeError):
    def __init__(self, field: str, value: Any) -> None:
        self.column = field.split(".")[0].split("[")[0]
        super().__init__(
            f"{{{field}}} is a {type(value).__name__} ({str(value)[:60]}), which would be written as its Python "
            f"repr; name one item of it (e.g. {{{field}[0]}}), or a column of text"
        )


class _TextFields(string.Formatter):
    """``str.format`` that refuses a field whose value is a list or a dict (VQAv2's ``answers``): its repr,
    brackets and quotes, would become the prompt or the answer trained on."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Any:
        value, first = super().get_field(field_name, args, kwargs)
        if isinstance(value, Mapping | list | tuple | set):
            raise _NotText(field_name, value)
        return value, first


def _fill(
    template: str, columns: tuple[str, ...], setting: str, row: Mapping, index: int, source: str
) -> str:
    for column in columns:
        if row.get(column) is None:  # stored datasets fill absent keys with None
            raise RowError(
                source,
                index,
                column,
                "missing_column",
                f"{setting}={template!r} names column {column!r}, which this row lacks (columns: {sorted(row)})",
            )
    try:
        return _TextFields().vformat(template, (), row)
    except _NotText as e:
        raise RowError(source, index, e.column, "wrong_type", f"{setting}={template!r}: {e}") from None
    except (KeyError, IndexError, AttributeError, ValueError, TypeError) as e:
        raise RowError(
            source,
            index,
            columns[0] if columns else "<template>",
            "wrong_type",
            f"{setting}={template!r} cannot be filled from this row: {type(e).__name__}: {e}",
        ) from None


@dataclass(frozen=True)
class RowFormat:
    """The per-source settings that turn raw rows into normalised rows of one shape (see module doc)."""

    shape: str
    column_map: Mapping[str, str] = field(default_factory=dict)
    prompt_template: str | None = None
    answer_template: str | None = None
    system_prompt: str | None = None
    alpha_background: tuple[int, int, int] = WHITE  # what transparent pixels become (images.to_rgb)
    image_budget: ImageBudget = field(default_factory=ImageBudget)  # each decoded image scaled into it

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown data shape {self.shape!r}; expected one of {SHAPES}")
        # Checked (and made a tuple: Hydra gives lists) now, not when the first image is decoded.
        object.__setattr__(self, "alpha_background", rgb_background(self.alpha_background))
        check_column_map(self.column_map)
        # "<image>" places an image (placeholders.py); a model's own image token is refused.
        token = model_image_token_in(self.prompt_template or "")
        if token:
            raise ValueError(
                f"data.prompt_template holds the model image token {token!r}: write '<image>' where the image "
                "goes, or nothing (images go first in the user turn)"
            )
        # Checked at construction, so a bad setting fails before any row is read.
        self._columns("prompt_template"), self._columns("answer_template")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"data.system_prompt must be a string, got {self.system_prompt!r}")
        for setting in ("system_prompt", "prompt_template", "answer_template"):
            if token := control_token_in(getattr(self, setting) or ""):
                raise ValueError(f"data.{setting} {control_token_error(token)}")
        if self.answer_template is not None and self.shape != "sft":
            raise ValueError(
                f"data.answer_template applies to SFT data only; {self.shape} data keep their answers in "
                f"{'chosen/rejected' if self.shape == 'preference' else 'columns the rewards read'}"
            )
        if self.shape == "sft" and (self.prompt_template is None) != (self.answer_template is None):
            raise ValueError(
                "SFT data built from templates need both data.prompt_template (the user turn) and "
                "data.answer_template (the assistant turn, e.g. '{solution}')"
            )

    def _columns(self, setting: str) -> tuple[str, ...]:
        template = getattr(self, setting)
        return () if template is None else template_columns(template, f"data.{setting}")

    def fill(self, row: Mapping, index: int = 0, source: str = "data") -> dict:
        """The raw row renamed and with its templated conversation column set; other columns unchanged."""
        if isinstance(row, BadRow):
            raise RowError(source, index, row.column, row.reason, row.detail)
        out = rename(row, self.column_map)
        if self.prompt_template is None:
            return out
        # Read from the renamed row before writing, so a template may name the column it replaces.
        user = _fill(
            self.prompt_template, self._columns("prompt_template"), "data.prompt_template", out, index, source
        )
        if self.shape == "sft":
            answer = _fill(
                self.answer_template,
                self._columns("answer_template"),
                "data.answer_template",
                out,
                index,
                source,
            )
            out["messages"] = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        else:
            out["prompt"] = user
        return out

    def with_system(self, row: dict) -> dict:
        """A normalised row with the system turn in front of its conversation (unless it has one)."""
        column = CONVERSATION[self.shape]
        messages = row[column]
        if not self.system_prompt or (messages and messages[0]["role"] == "system"):
            return row
        system = {"role": "system", "content": [{"type": "text", "text": self.system_prompt}]}
        return {**row, column: [system, *messages]}

    def normalize(
        self, row: Mapping, index: int, source: str, base_dir: Path | None, check_files: bool = True
    ) -> dict:
        """Validate one raw row and return it normalised; images stay references (see ``normalize_row``)."""
        out = normalize_row(self.fill(row, index, source), self.shape, index, source, base_dir, check_files)
        return self.with_system(out)

    def load(self, row: Mapping, index: int, source: str, base_dir: Path | None) -> dict:
        """Normalise one raw row and decode its images (see ``load_row``): the form DataModules yield."""
        filled = self.fill(row, index, source)
        loaded = load_row(
            filled, self.shape, index, source, base_dir, self.alpha_background, self.image_budget
        )
        return self.with_system(loaded)
