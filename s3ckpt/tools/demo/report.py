"""What the demo shows at the end: a table per checkpoint and a timeline picture.

matplotlib (the `demo` extra) is imported only to draw, so the training processes never load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .child import Child

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["table", "timeline"]

_MB = 1e6
_COLORS = {"first": "tab:blue", "restarted": "tab:green"}


def table(first: Child, restarted: Child, stored: dict[int, int]) -> str:
    """One row per save of the interrupted run. ``stored`` is what the catalog counts per step
    (data objects and ``.metadata``): no compression yet, so it is the state plus the record; a
    committed step missing from it was deleted by the manager's retention."""
    header = ["step", "run", "stall ms", "upload s", "MB/s", "state MB", "stored MB"]
    rows = []
    for child in (first, restarted):
        done = {event["step"]: event["t"] for event in child.of("saved")}
        for save in child.of("save"):
            step, state = save["step"], save["bytes"]
            stall = f"{(save['t1'] - save['t0']) * 1e3:.0f}"
            if step in done:
                upload = done[step] - save["t1"]
                timing = [f"{upload:.2f}", f"{state / _MB / upload:.1f}"]
                run, kept = child.role, stored.get(step)
            else:
                timing, run, kept = ["killed", "-"], f"{child.role} (killed)", None
            size = f"{kept / _MB:.2f}" if kept is not None else "pruned" if step in done else "-"
            rows.append([str(step), run, stall, *timing, f"{state / _MB:.2f}", size])
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 1 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def timeline(
    path: Path, first: Child, restarted: Child, reference: Child, gc_window: tuple[float, float]
) -> None:
    """Above, training steps and background uploads against wall time, with the kill and the
    restart; below, the loss curves of the interrupted run and of the reference."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 6), layout="constrained")
    lanes, losses = figure.subplots(2, 1, height_ratios=[3, 2])
    _lanes(lanes, first, restarted, gc_window)
    _losses(losses, first, restarted, reference)
    figure.savefig(path, dpi=120)


def _lanes(axes: Axes, first: Child, restarted: Child, gc_window: tuple[float, float]) -> None:
    from matplotlib.patches import Patch

    origin, killed_at = first.spawned, first.killed_at
    assert killed_at is not None
    for child in (first, restarted):
        color = _COLORS[child.role]
        steps = [(e["t0"] - origin, e["t1"] - e["t0"]) for e in child.of("step")]
        axes.broken_barh(steps, (0.65, 0.7), facecolors=color, edgecolor="white", linewidth=0.4)
        saves = child.of("save")
        stalls = [(e["t0"] - origin, e["t1"] - e["t0"]) for e in saves]
        axes.broken_barh(stalls, (0.65, 0.7), facecolors="tab:orange")
        done = {event["step"]: event["t"] for event in child.of("saved")}
        for save in saves:
            killed = save["step"] not in done
            start, length = save["t1"] - origin, done.get(save["step"], killed_at) - save["t1"]
            axes.broken_barh(
                [(start, length)],
                (-0.35, 0.7),
                facecolors="tab:red" if killed else color,
                hatch="//" if killed else None,
                alpha=0.55,
                edgecolor="black",
                linewidth=0.4,
            )
            axes.text(start + length / 2, 0, str(save["step"]), ha="center", va="center", size=7)
    marks = [
        (killed_at, "tab:red", "-", "SIGKILL ", "right"),
        (restarted.spawned, "tab:green", "--", " restart", "left"),
        (restarted.of("resume")[0]["t1"], "tab:green", "-", " resumed", "left"),
    ]
    for when, color, style, label, side in marks:
        axes.axvline(when - origin, color=color, linestyle=style, linewidth=1.2)
        axes.text(when - origin, 1.45, label, color=color, size=8, va="bottom", ha=side)
    axes.axvspan(gc_window[0] - origin, gc_window[1] - origin, color="0.8")
    axes.text(gc_window[0] - origin, -0.45, " gc", size=8, va="top")
    axes.set_xlim(left=0)
    axes.set_ylim(-0.7, 1.8)
    axes.set_yticks([0, 1], ["uploads\n(step)", "training"])
    axes.set_xlabel("wall time (s) since the first process started")
    axes.set_title("s3ckpt demo: training steps and background checkpoint uploads")
    legend = [
        Patch(color="tab:blue", label="first process"),
        Patch(color="tab:green", label="restarted process"),
        Patch(color="tab:orange", label="mgr.save blocks training"),
        Patch(facecolor="tab:red", alpha=0.55, hatch="//", label="upload cut by SIGKILL"),
    ]
    axes.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def _losses(axes: Axes, first: Child, restarted: Child, reference: Child) -> None:
    """The interrupted run's points should sit exactly on the reference's line."""
    steps = reference.of("step")
    axes.plot(
        [e["step"] for e in steps],
        [e["loss"] for e in steps],
        color="0.6",
        linewidth=3,
        label="uninterrupted reference",
    )
    for child in (first, restarted):
        points = child.of("step")
        axes.plot(
            [e["step"] for e in points],
            [e["loss"] for e in points],
            "o",
            markersize=3,
            color=_COLORS[child.role],
            label=f"{child.role} process",
        )
    axes.axvline(restarted.of("resume")[0]["step"], color="tab:green", linewidth=1.0)
    axes.set_xlabel("training step")
    axes.set_ylabel("loss")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
