"""Training curves as a PNG: metrics grouped into panels by name, drawn with matplotlib's Agg backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from pathlib import Path

# name -> {global step -> value}
History = Mapping[str, Mapping[int, float]]


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


class PanelAssigner:
    """Puts a metric into the panel that names it exactly, else the first panel with a matching pattern.

    Exact names win so that a broad pattern (``val/rewards/*``: an online method's per-function rewards)
    does not take a metric another panel names (``val/rewards/accuracies``: DPO's preference accuracy).
    """

    def __init__(self, panels: Mapping[str, Sequence[str]]) -> None:
        self.panels = {str(title): [str(m) for m in metrics] for title, metrics in panels.items()}
        self._exact = {m: t for t, ms in self.panels.items() for m in ms if not _is_pattern(m)}
        self._cache: dict[str, str | None] = {}

    def panel_of(self, name: str) -> str | None:
        """The panel title for metric ``name``; ``None`` when no panel wants it."""
        if name not in self._cache:
            title = self._exact.get(name)
            if title is None:
                title = next(
                    (
                        t
                        for t, ms in self.panels.items()
                        if any(_is_pattern(m) and fnmatchcase(name, m) for m in ms)
                    ),
                    None,
                )
            self._cache[name] = title
        return self._cache[name]

    def group(self, history: History) -> dict[str, list[str]]:
        """Panel title -> the metrics of ``history`` drawn in it, in panel order; empty panels left out."""
        grouped: dict[str, list[str]] = {title: [] for title in self.panels}
        for name in sorted(history):
            title = self.panel_of(name)
            if title is not None and history[name]:
                grouped[title].append(name)
        return {title: names for title, names in grouped.items() if names}


def plot_curves(history: History, grouped: Mapping[str, Sequence[str]], path: Path, dpi: int = 100) -> Path:
    """Draws one panel per entry of ``grouped`` (title -> metric names) side by side; saves a PNG."""
    # Imported here: matplotlib costs ~0.5 s to import and is only needed once, at the end of a run.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # A bare Figure on the Agg canvas: no pyplot global state and no backend switch in the user's process.
    fig = Figure(figsize=(5.0 * len(grouped), 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (title, names) in enumerate(grouped.items(), start=1):
        ax = fig.add_subplot(1, len(grouped), i)
        for name in names:
            steps = sorted(history[name])
            # Markers while points are few: a validation curve may have only one or two.
            marker = "o" if len(steps) <= 50 else None
            ax.plot(steps, [history[name][s] for s in steps], marker=marker, markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
