"""Box rewards for grounding: read a box from a completion and score its overlap (IoU, GIoU) with the solution.

Boxes are ``(x1, y1, x2, y2)`` tuples ("xyxy": left, top, right, bottom) once parsed; completions
may write them as ``xyxy``, ``xywh`` (left, top, width, height) or ``cxcywh`` (centre, width,
height), chosen by ``box_format``. The completion and the solution are in the same coordinate
system (pixels, 0..1, or Qwen2-VL's 0..1000) and the same ``box_format``: IoU and GIoU are
invariant to scaling both boxes alike, so no conversion between systems is needed. ``coordinates``
only says which range is valid: the completion's box is clipped to it (one wholly outside it scores
as no box) and the solution's box must lie in it (a solution outside it means a mistaken setting).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning_vlm.rewards.accuracy import extract_answer
from lightning_vlm.rewards.answers import score_with_reference

if TYPE_CHECKING:
    from lightning_vlm.rewards.builtin import Completion

Box = tuple[float, float, float, float]

BOX_FORMATS = ("xyxy", "xywh", "cxcywh")
# The largest coordinate of each system; None: pixels, bounded by an image size we are not given.
COORDINATE_RANGES: dict[str, float | None] = {"pixel": None, "normalized": 1.0, "norm1000": 1000.0}

_N = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"
_C = r"\s*,\s*"
# "[a, b, c, d]" (also inside JSON such as {"bbox_2d": [...]}), "(a, b, c, d)", and corner pairs
# "(a,b),(c,d)" as in Qwen2-VL's <|box_start|>(x1,y1),(x2,y2)<|box_end|>. Between the pairs "\s*+,?\s*+" is
# possessive: two plain "\s*" split a run of spaces every way ("(1,2)" then 16000 spaces took 0.7 s).
_BOX = re.compile(
    rf"\[\s*{_N}{_C}{_N}{_C}{_N}{_C}{_N}\s*\]"
    rf"|\(\s*{_N}{_C}{_N}{_C}{_N}{_C}{_N}\s*\)"
    rf"|\(\s*{_N}{_C}{_N}\s*\)\s*+,?\s*+\(\s*{_N}{_C}{_N}\s*\)"
)


def _check_settings(box_format: str, coordinates: str = "pixel") -> None:
    if box_format not in BOX_FORMATS:
        raise ValueError(f"unknown box_format {box_format!r}; expected one of {BOX_FORMATS}")
    if coordinates not in COORDINATE_RANGES:
        raise ValueError(f"unknown coordinates {coordinates!r}; expected one of {tuple(COORDINATE_RANGES)}")


def to_xyxy(values: Sequence[float], box_format: str = "xyxy") -> Box | None:
    """Four numbers in ``box_format`` as an xyxy box; None when not finite or inverted (x2 < x1 or y2 < y1)."""
    _check_settings(box_format)
    if len(values) != 4 or not all(math.isfinite(v) for v in values):
        return None
    a, b, c, d = (float(v) for v in values)
    if box_format == "xywh":
        box = (a, b, a + c, b + d)
    elif box_format == "cxcywh":
        box = (a - c / 2, b - d / 2, a + c / 2, b + d / 2)
    else:
        box = (a, b, c, d)
    return box if box[2] >= box[0] and box[3] >= box[1] else None


def parse_box(text: str, box_format: str = "xyxy") -> Box | None:
    """The box a completion gives, as xyxy, or None when none parses or it is invalid (see ``to_xyxy``).

    Looks in the last ``<answer>...</answer>`` block when there is one (the final answer, as
    ``accuracy_reward`` reads it; a box outside that block is not the answer), else in the whole
    text, and takes the first box there. Accepted: ``[x1, y1, x2, y2]``, ``(x1, y1, x2, y2)``,
    ``(x1,y1),(x2,y2)`` (with or without Qwen2-VL's ``<|box_start|>``/``<|box_end|>`` around it),
    and JSON such as ``{"bbox_2d": [...]}`` or ``{"bbox": [...]}``; integers or decimals, signs,
    exponents, any spacing. ``box_format`` applies to all four numbers in every syntax.
    """
    match = _BOX.search(extract_answer(text))
    if match is None:
        return None
    return to_xyxy([float(g) for g in match.groups() if g is not None], box_format)


def _area(box: Box) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def _union_and_intersection(a: Box, b: Box) -> tuple[float, float]:
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    intersection = max(0.0, width) * max(0.0, height)
    return _area(a) + _area(b) - intersection, intersection


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two xyxy boxes, in [0, 1].

    Zero-area boxes (a point or a line) have IoU 1.0 with an identical box and 0.0 with anything
    else, where the ratio itself would be 0/0 or 0.
    """
    if a == b:
        return 1.0
    union, intersection = _union_and_intersection(a, b)
    return intersection / union if union > 0 else 0.0


def box_giou(a: Box, b: Box) -> float:
    """Generalized IoU of two xyxy boxes, in [-1, 1] (Rezatofighi et al., CVPR 2019, arXiv:1902.09630).

    ``IoU - |C minus (A union B)| / |C|`` with ``C`` the smallest box enclosing both: unlike IoU it
    still ranks boxes that do not overlap, by how far apart they are (touching gives 0, far apart
    tends to -1). Identical boxes give 1.0, zero-area ones included; two different zero-area boxes
    give -1.0, also where ``C`` has no area (points on one line), the limit of the formula.
    """
    if a == b:
        return 1.0
    union, intersection = _union_and_intersection(a, b)
    hull = _area((min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])))
    # No area, or one past float's range (a box of finite area far off: inf / inf would be NaN)
    if not 0 < hull < math.inf:
        return -1.0
    iou = intersection / union if union > 0 else 0.0
    return iou - (hull - union) / hull


def _clip(box: Box, coordinates: str) -> Box:
    limit = COORDINATE_RANGES[coordinates]
    if limit is None:
        return box
    x1, y1, x2, y2 = (min(max(v, 0.0), limit) for v in box)
    return (x1, y1, x2, y2)


def _beyond(box: Box, coordinates: str) -> bool:
    """Whether ``box`` lies wholly past an edge of the valid range (a point or line there too)."""
    limit = COORDINATE_RANGES[coordinates]
    return limit is not None and (box[2] < 0 or box[3] < 0 or box[0] > limit or box[1] > limit)


def _only_box(text: str, reference: Any, box_format: str) -> Box | None:
    """The one box of a solution's text (JSON data written out as text too: ``{"bbox_2d": [...]}``,
    ``[[x1, y1, x2, y2]]``, as Qwen's grounding data holds it); several boxes are no one reference, and
    raise (a completion's first box is its answer, a solution's first of two is a guess)."""
    found = list(_BOX.finditer(text))
    if len(found) > 1:
        raise ValueError(f"the solution {reference!r} holds {len(found)} boxes; a box reward scores one")
    values = [float(g) for g in found[0].groups() if g is not None] if found else []
    return to_xyxy(values, box_format)


def _solution_box(reference: Any, box_format: str, coordinates: str) -> Box:
    if isinstance(reference, str):
        box = _only_box(extract_answer(reference), reference, box_format)
    elif isinstance(reference, Mapping) or (
        isinstance(reference, list | tuple) and any(isinstance(v, Mapping | list | tuple) for v in reference)
    ):
        box = _only_box(json.dumps(reference, default=str), reference, box_format)
    else:
        # A list, tuple or array of four numbers (a bbox column) is taken as the box itself.
        try:
            values = [float(v) for v in reference]
        except (TypeError, ValueError):
            values = []
        box = to_xyxy(values, box_format)
    if box is None:
        raise ValueError(
            f"cannot read a box from the solution {reference!r}; expected four numbers in "
            f"box_format={box_format!r} such as '[x1, y1, x2, y2]' or a list of four numbers"
        )
    limit = COORDINATE_RANGES[coordinates]
    if limit is not None and not all(0.0 <= v <= limit for v in box):
        raise ValueError(
            f"the solution box {box} lies outside 0..{limit:g} of coordinates={coordinates!r}; "
            "set `coordinates` to the system the solutions are written in"
        )
    if coordinates == "norm1000" and all(v <= 1.0 for v in box):
        # Qwen2-VL's 0..1000 completions never overlap a 0..1 box: every reward would be 0, silently.
        raise ValueError(
            f"the solution box {box} lies within 0..1: it reads as normalized coordinates, not "
            "coordinates='norm1000' (0..1000); set coordinates='normalized' if the solutions are 0..1"
        )
    return box


def _box_reward(
    name: str,
    completions: Sequence[Completion],
    solution: Sequence[Any] | None,
    columns: dict[str, Any],
    box_format: str,
    coordinates: str,
    overlap: Callable[[Box, Box], float],
    floor: float,
) -> list[float | None]:
    _check_settings(box_format, coordinates)

    def score(text: str, reference: Box) -> float:
        box = parse_box(text, box_format)
        # No box, or one whose area overflows ([0, 0, 1e200, 1e200]: inf, and GIoU's hull term inf / inf
        # NaN, which the trainer reads as unscored, above the floor a wrong box gets)
        if box is None or not math.isfinite(_area(box)):
            return floor
        clipped = _clip(box, coordinates)
        # A box wholly past the edge clips to a sliver of no area on it, which GIoU would score as a
        # box touching the reference (0.5, more than a wrong box inside the image): it is no box.
        if _area(clipped) <= 0 < _area(box) or _beyond(box, coordinates):
            return floor
        return overlap(clipped, reference)

    return score_with_reference(
        name, completions, solution, columns, lambda ref: _solution_box(ref, box_format, coordinates), score,
        lists=False,
    )  # fmt: skip


def iou_reward(
    completions: Sequence[Completion],
    solution: Sequence[Any] | None = None,
    *,
    box_format: str = "xyxy",
    coordinates: str = "pixel",
    threshold: float | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """IoU of the completion's box (``parse_box``) with the solution box, in [0, 1]; 0.0 without a box.

    The solution is box text, parsed like a completion, or a list/tuple of four numbers, both in
    ``box_format`` and ``coordinates`` like the completion. With ``threshold`` the reward is binary,
    1.0 when IoU >= threshold, else 0.0 (the accuracy reward of VLM-R1 and Visual-RFT).
    """
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ValueError(f"iou_reward: threshold must lie in [0, 1]; got {threshold}")

    def overlap(box: Box, reference: Box) -> float:
        iou = box_iou(box, reference)
        return iou if threshold is None else float(iou >= threshold)

    return _box_reward("iou_reward", completions, solution, kwargs, box_format, coordinates, overlap, 0.0)


def giou_reward(
    completions: Sequence[Completion],
    solution: Sequence[Any] | None = None,
    *,
    box_format: str = "xyxy",
    coordinates: str = "pixel",
    **kwargs: Any,
) -> list[float | None]:
    """``(GIoU + 1) / 2`` of the completion's box with the solution box, in [0, 1]; 0.0 without a box.

    Rescaled so that it adds to other rewards on their 0..1 scale: 1.0 for the exact box, above
    0.5 only for boxes that overlap it, towards 0 the farther off they are; a completion without
    a box gets the minimum. The solution is read as in ``iou_reward``. NeMo-RL's ``bbox_giou_reward``
    (``nemo_rl/environments/rewards.py``) returns the raw GIoU in [-1, 1], reads boxes only inside
    ``<answer>`` tags and only as "[x1, y1, x2, y2]", and scores a missing or unparsable box 0.0,
    above a far-off box's negative GIoU; here a missing box is never better than a wrong one.
    """
    return _box_reward(
        "giou_reward",
        completions,
        solution,
        kwargs,
        box_format,
        coordinates,
        lambda box, reference: (box_giou(box, reference) + 1.0) / 2.0,
        0.0,
    )
