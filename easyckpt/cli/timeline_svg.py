"""Drawing report.py's Timeline: an SVG written by hand (the HTML report needs nothing installed) and, for a .png
output, the same two panels through matplotlib (the ``report`` extra, imported only then).

Top panel: the stall of each snapshot step (ms), one bar per step and run, skipped snapshots as red crosses.
Bottom panel: each persisted step's write and each commit (ms). Both share the step axis; the events (starts,
resumes, SIGTERM saves, lost trainers, errors) are dashed vertical lines labelled with their step. Every
mark carries a <title> with its exact figures, and a class naming what it is (snapshot, skip, persist,
commit, event), so that what is drawn can be checked against the log.
"""
from __future__ import annotations

import html
import io
import math
from typing import Any, Callable, Dict, List, Sequence

from easyckpt.cli.timeline import Timeline

WIDTH, LEFT, RIGHT = 960, 70, 20
TOP_H, BOTTOM_H, GAP, HEAD = 220, 150, 50, 60
COLOURS = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22"]
EVENT_COLOURS = {"start": "#555", "resume": "#2ca02c", "sigterm": "#ff7f0e", "lost": "#d62728", "error": "#d62728"}


def run_colour(run: int) -> str:
    return COLOURS[run % len(COLOURS)]


def nice_ceiling(value: float) -> float:
    """The axis' top: 1, 2 or 5 times a power of ten, at or above ``value`` (1 for nothing to draw)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= value - 1e-12)


def step_ticks(first: int, last: int, count: int = 8) -> List[int]:
    """Whole steps from ``first`` to ``last``, both included, about ``count`` of them."""
    if last <= first:
        return [first]
    stride = max(1, math.ceil((last - first) / count))
    ticks = list(range(first, last, stride))
    return ticks + [last] if last - ticks[-1] >= stride / 2 or len(ticks) == 1 else ticks[:-1] + [last]


def _fmt(v: float) -> str:
    return f"{v:g}" if v >= 0.01 or v == 0 else f"{v:.1e}"


def svg(tl: Timeline) -> str:
    first, last = tl.steps()
    span = max(1, last - first)
    plot_w = WIDTH - LEFT - RIGHT
    height = HEAD + TOP_H + GAP + BOTTOM_H + 40

    def x(step: float) -> float:
        return LEFT + plot_w * (step - first) / span
    bar = max(1.0, min(14.0, 0.6 * plot_w / (span + 1)))
    out: List[str] = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
                      f"font-family='sans-serif' font-size='11'>"]
    top0, bottom0 = HEAD, HEAD + TOP_H + GAP
    stall_max = nice_ceiling(max([ms for _, _, ms in tl.stalls], default=0.0))
    write_max = nice_ceiling(max([ms for _, ms in tl.persists + tl.commits], default=0.0))
    out += _axes(top0, TOP_H, stall_max, "stall per snapshot (ms)", "stall-axis", first, last, x)
    out += _axes(bottom0, BOTTOM_H, write_max, "persist / commit (ms)", "write-axis", first, last, x)
    for run, step, ms in sorted(tl.stalls):
        h = TOP_H * ms / stall_max
        out.append(f"<rect class='snapshot' data-step='{step}' data-run='{run + 1}' x='{x(step) - bar / 2:.2f}' "
                   f"y='{top0 + TOP_H - h:.2f}' width='{bar:.2f}' height='{max(h, 0.5):.2f}' "
                   f"fill='{run_colour(run)}' fill-opacity='0.8'><title>snapshot of step {step} (run {run + 1}): "
                   f"{ms:.3f} ms</title></rect>")
    for run, step in tl.skips:
        out.append(f"<text class='skip' data-step='{step}' x='{x(step):.2f}' y='{top0 + TOP_H - 4}' fill='#d62728' "
                   f"text-anchor='middle' font-size='14'>&#215;<title>snapshot of step {step} skipped (run {run + 1})"
                   f"</title></text>")
    for cls, points, shape in (("persist", tl.persists, "circle"), ("commit", tl.commits, "diamond")):
        for step, ms in points:
            cy = bottom0 + BOTTOM_H - BOTTOM_H * ms / write_max
            tip = f"<title>{cls} of step {step}: {ms:.3f} ms</title>"
            if shape == "circle":
                out.append(f"<circle class='{cls}' data-step='{step}' cx='{x(step):.2f}' cy='{cy:.2f}' r='4' "
                           f"fill='#1f77b4'>{tip}</circle>")
            else:
                cx = x(step)
                out.append(f"<polygon class='{cls}' data-step='{step}' points='{cx:.2f},{cy - 5:.2f} {cx + 5:.2f},"
                           f"{cy:.2f} {cx:.2f},{cy + 5:.2f} {cx - 5:.2f},{cy:.2f}' fill='#ff7f0e'>{tip}</polygon>")
    for i, m in enumerate(tl.marks):
        colour, mx = EVENT_COLOURS.get(m.kind, "#555"), x(m.step)
        label = html.escape(m.label)
        left = mx < LEFT + 0.6 * plot_w         # labels near the right edge run leftwards, inside the picture
        out.append(f"<g class='event' data-step='{m.step}' data-kind='{html.escape(m.kind)}'>"
                   f"<line x1='{mx:.2f}' x2='{mx:.2f}' y1='{HEAD - 8}' y2='{bottom0 + BOTTOM_H}' stroke='{colour}' "
                   f"stroke-dasharray='4 3'/><text x='{mx + (3 if left else -3):.2f}' y='{12 + 12 * (i % 4)}' "
                   f"fill='{colour}' text-anchor='{'start' if left else 'end'}'>{label}</text></g>")
    out.append("</svg>")
    return "\n".join(out)


def _axes(y0: float, h: float, top: float, name: str, cls: str, first: int, last: int,
          x: Callable[[float], float]) -> List[str]:
    right = WIDTH - RIGHT
    out = [f"<g class='{cls}' data-max='{top:g}'>",
           f"<rect x='{LEFT}' y='{y0}' width='{right - LEFT}' height='{h}' fill='none' stroke='#999'/>",
           f"<text x='{LEFT}' y='{y0 - 6}' font-weight='bold'>{html.escape(name)}</text>"]
    for frac in (0.0, 0.5, 1.0):
        yy = y0 + h - h * frac
        out.append(f"<text class='ytick' x='{LEFT - 6}' y='{yy + 4:.2f}' text-anchor='end'>{_fmt(top * frac)}</text>")
    for step in step_ticks(first, last):
        out.append(f"<text class='xtick' x='{x(step):.2f}' y='{y0 + h + 14}' text-anchor='middle'>{step}</text>")
    out.append("</g>")
    return out


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def png(tl: Timeline) -> bytes:
    """The same panels as svg(), drawn by matplotlib (the ``report`` extra) into PNG bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(12, 6), height_ratios=[3, 2])
    try:
        for run in sorted({r for r, _, _ in tl.stalls}):
            steps = [(s, ms) for r, s, ms in tl.stalls if r == run]
            top.bar([s for s, _ in steps], [ms for _, ms in steps], color=run_colour(run), label=f"run {run + 1}")
        if tl.skips:
            top.scatter([s for _, s in tl.skips], [0] * len(tl.skips), marker="x", color="#d62728", label="skipped")
        _scatter(bottom, tl.persists, "o", "#1f77b4", "persist")
        _scatter(bottom, tl.commits, "D", "#ff7f0e", "commit")
        at_step: Dict[int, int] = {}
        for m in tl.marks:
            for ax in (top, bottom):
                ax.axvline(m.step, color=EVENT_COLOURS.get(m.kind, "#555"), linestyle="--", linewidth=0.8)
            nth = at_step[m.step] = at_step.get(m.step, -1) + 1       # labels of one step side by side
            top.annotate(m.label, (m.step, 1.0), xycoords=("data", "axes fraction"), xytext=(-2 + 9 * nth, -2),
                         textcoords="offset points", fontsize=7, rotation=90, va="top", ha="right")
        top.set_ylabel("stall per snapshot (ms)")
        bottom.set_ylabel("persist / commit (ms)")
        bottom.set_xlabel("step")
        for ax in (top, bottom):
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="upper left")
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        return buf.getvalue()
    finally:
        plt.close(fig)


def _scatter(ax: Any, points: Sequence[Any], marker: str, colour: str, label: str) -> None:
    if points:
        ax.scatter([s for s, _ in points], [ms for _, ms in points], marker=marker, color=colour, label=label)
