"""Matplotlib rendering of a ``draw.Drawing``: ranks as rows, one column per round.

Each cell shows the rank's buffers as bars (one box per element when they are short), with
the ranges the step touches filled in, and the step's actions as text. Arrows run from the
sent range on the sender to the written range on the receiver: blue for a plain receive,
red for receive-and-reduce ("+="). Local actions are green (copy) and purple (reduce).
Rounds wrap onto several bands when there are more than ``columns``.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from pycoll.algorithms.schedule import Copy, Recv, RecvReduce, Reduce, Send

COLORS = {"send": "#444444", "recv": "#1f77b4", "recv_reduce": "#d62728",
          "copy": "#2ca02c", "reduce": "#9467bd"}
U = 0.21          # inches per data unit (the axes keep an equal aspect)
LEFT = 3.0  # rank labels
BAR_H, BAR_GAP, LINE = 0.9, 0.45, 0.72
X_LABEL, X_BAR0 = 1.9, 2.1  # offsets inside a column: buffer names, bars


def require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("drawing needs matplotlib: pip install 'pycoll[plot]' "
                          "(or pip install matplotlib); --text works without it") from None


def _kind(a) -> str:
    return {Send: "send", Recv: "recv", RecvReduce: "recv_reduce", Copy: "copy",
            Reduce: "reduce"}[type(a)]


def render(tl, path, columns: int = 7, dpi: int = 100) -> None:
    require_matplotlib()
    import matplotlib
    if matplotlib.get_backend().lower() not in ("agg", "svg", "pdf", "cairo"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    from pycoll.cli.draw_state import action_label, label, simulate

    states, verdict = simulate(tl)
    bufs = tl.buffers() or {"out": 1}  # a barrier moves headers only: one box per rank
    names = list(bufs)
    longest = max(bufs.values(), default=1)
    per_cell: dict[tuple[int, int], list] = {}  # (rank, round) -> actions
    for s in tl.schedules:
        for i, step in enumerate(s.steps):
            per_cell.setdefault((s.rank, tl.rounds[s.rank][i]), []).extend(step)
    lines = max((len(v) for v in per_cell.values()), default=1)
    # column: names | bars (longer for long buffers, so box labels fit) | action text
    bar_w = min(max(1.25 * longest, 5.3), 14.0)
    X_BAR1 = X_BAR0 + bar_w
    X_TEXT = X_BAR1 + 0.4
    longest_line = max((len(action_label(a)) for v in per_cell.values() for a in v), default=0)
    W = X_TEXT + 0.29 * longest_line + 0.6
    H = max(len(names) * (BAR_H + BAR_GAP) + 1.6, lines * LINE + 1.2, 3.2)
    n_rounds = max(tl.n_rounds, 1)
    bands = math.ceil(n_rounds / max(columns, 1))
    cols = math.ceil(n_rounds / bands)  # balanced bands: 9 rounds -> 5 + 4, not 8 + 1
    band_h = 1.3 + tl.world * H
    width = max(LEFT + cols * W + 0.4, 42.0)
    chars = int((width - 0.6) / 0.27)  # 7.5 pt characters per line of the caption
    caption = textwrap.wrap(tl.summary(), chars) + textwrap.wrap(
        f"boxes: what each element holds after the round ({_key(tl)}). {verdict}", chars)
    legend_rows = 1 if width >= 64 else 2
    top = 1.6 + 0.72 * len(caption) + 0.8 * legend_rows + 0.8
    height = top + bands * band_h + 0.3
    fig = plt.figure(figsize=(width * U, height * U), dpi=dpi)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(-height, 0)
    ax.set_aspect("equal")
    ax.axis("off")

    def origin(rank: int, rd: int) -> tuple[float, float]:
        """Top-left corner of the cell of ``rank`` in round ``rd``."""
        band, col = divmod(rd, cols)
        return LEFT + col * W, -(top + band * band_h + 1.3 + rank * H)

    def bar_y(rank: int, rd: int, buf: str) -> float:
        return origin(rank, rd)[1] - 0.45 - names.index(buf) * (BAR_H + BAR_GAP) - BAR_H / 2

    def range_x(rank: int, rd: int, start: int, count: int) -> tuple[float, float]:
        x0 = origin(rank, rd)[0] + X_BAR0
        scale = (X_BAR1 - X_BAR0) / longest
        return x0 + start * scale, x0 + (start + count) * scale

    # title and legend
    root = f", root {tl.root}" if tl.root is not None else ""
    fell = "" if tl.name.startswith(tl.algorithm) else f"  (falls back to {tl.name})"
    plural = "" if tl.count == 1 else "s"
    count = "" if tl.collective == "barrier" else f", count = {tl.count} element{plural}"
    ax.text(0.3, -0.5, f"{tl.collective} / {tl.algorithm}{fell}  —  P = {tl.world}{count}{root}",
            fontsize=12, weight="bold", va="top")
    ax.text(0.3, -1.55, "\n".join(caption), fontsize=7.5, va="top", color="#333333",
            linespacing=1.35)
    handles = [Patch(facecolor="white", edgecolor=COLORS["send"], lw=1.6, label="sent range"),
               Patch(color=COLORS["recv"], label="receive (=)"),
               Patch(color=COLORS["recv_reduce"], label="receive and reduce (+=)"),
               Patch(color=COLORS["copy"], label="local copy"),
               Patch(color=COLORS["reduce"], label="local reduce (+=)")]
    ax.legend(handles=handles, loc="upper left", ncol=5 if legend_rows == 1 else 3, fontsize=7.5,
              frameon=False, bbox_to_anchor=(0.1, -1.9 - 0.72 * len(caption)), bbox_transform=ax.transData, borderaxespad=0)

    # grid: round headers, rank labels, row shading
    for rd in range(n_rounds):
        x, y = origin(0, rd)
        ax.text(x + W / 2, y + 0.55, f"round {rd}", ha="center", fontsize=9, weight="bold")
        if rd % cols:
            ax.plot([x, x], [y + 0.2, y - tl.world * H], color="#bbbbbb", lw=0.6)
    for band in range(bands):
        for r in range(tl.world):
            x, y = origin(r, band * cols)
            if r % 2 == 0:
                ax.add_patch(Rectangle((LEFT - 0.1, y - H), cols * W + 0.2, H, color="#f3f3f3",
                                       zorder=0, lw=0))
            ax.text(LEFT - 0.3, y - H / 2, f"rank {r}", ha="right", va="center", fontsize=9,
                    weight="bold")

    # cells: bars, highlighted ranges, action text
    texts: list[tuple[float, float, float, float]] = []  # (x, y, half w, half h) for labels
    for r in range(tl.world):
        for rd in range(n_rounds):
            acts = per_cell.get((r, rd), [])
            x, y = origin(r, rd)
            fade = 1.0 if acts else 0.35
            for b in names:
                by = bar_y(r, rd, b)
                x0, x1 = range_x(r, rd, 0, bufs[b])
                ax.add_patch(Rectangle((x0, by - BAR_H / 2), x1 - x0, BAR_H, facecolor="white",
                                       edgecolor="#888888", lw=0.6, alpha=fade, zorder=1))
                if bufs[b] <= 40:
                    for e in range(1, bufs[b]):
                        ex = range_x(r, rd, e, 0)[0]
                        ax.plot([ex, ex], [by - BAR_H / 2, by + BAR_H / 2], color="#bbbbbb",
                                lw=0.4, alpha=fade, zorder=1)
                ax.text(x + X_LABEL, by, b, ha="right", va="center", fontsize=7,
                        color="#555555", alpha=fade)
                box_pt = (X_BAR1 - X_BAR0) / longest * U * 72
                for e, v in enumerate(states.get((r, rd), {}).get(b, [])):
                    text = label(tl, v)
                    size = min(7.0, box_pt / (0.62 * len(text) + 0.4))
                    if v is not None and size >= 3.5:
                        ax.text(sum(range_x(r, rd, e, 1)) / 2, by, text, ha="center",
                                va="center", fontsize=size, zorder=6, alpha=fade)
            for a in acts:
                k = _kind(a)
                if k == "send":
                    _mark(ax, r, rd, a.buf, a.start, a.count, None, COLORS[k], bar_y, range_x)
                elif k in ("recv", "recv_reduce"):
                    _mark(ax, r, rd, a.buf, a.start, a.count, COLORS[k], None, bar_y, range_x)
                else:
                    _mark(ax, r, rd, a.src, a.src_start, a.count, None, COLORS[k], bar_y, range_x)
                    _mark(ax, r, rd, a.dst, a.dst_start, a.count, COLORS[k], None, bar_y, range_x)
            for i, a in enumerate(acts):
                line, ty = action_label(a), y - 0.45 - i * LINE
                ax.text(x + X_TEXT, ty, line, fontsize=7, family="monospace", va="top",
                        color=COLORS[_kind(a)])
                texts.append((x + X_TEXT + 0.14 * len(line), ty - LINE / 2, 0.14 * len(line),
                              LINE / 2))

    # arrows, one per transfer, from the sent range to the written range
    placed = [(sum(range_x(r, rd, 0, bufs[b])) / 2, bar_y(r, rd, b),
               (X_BAR1 - X_BAR0) / 2, BAR_H / 2)  # obstacles: every bar, then each label
              for r in range(tl.world) for rd in range(n_rounds) for b in names]
    placed += texts
    for t in tl.transfers:
        sx = sum(range_x(t.src, t.round, t.send.start, t.send.count)) / 2
        dx = sum(range_x(t.dst, t.round, t.recv.start, t.recv.count)) / 2
        p0 = (sx, bar_y(t.src, t.round, t.send.buf))
        p1 = (dx, bar_y(t.dst, t.round, t.recv.buf))
        color = COLORS["recv_reduce" if t.reduces else "recv"]
        rad = 0.18 if abs(t.src - t.dst) == 1 else 0.3
        ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle="-|>", mutation_scale=9, lw=1.1,
                                     color=color, alpha=0.85, zorder=4, shrinkA=2, shrinkB=2,
                                     connectionstyle=f"arc3,rad={rad}"))
        # label on the curve, at the first spot free of the labels placed so far
        cx = (p0[0] + p1[0]) / 2 + rad * (p1[1] - p0[1])
        cy = (p0[1] + p1[1]) / 2 - rad * (p1[0] - p0[0])
        label = f"[{t.recv.start}:{t.recv.start + t.recv.count})" + ("+=" if t.reduces else "")
        half_w, half_h = 0.14 * len(label) + 0.15, 0.33
        for f in (0.5, 0.62, 0.38, 0.74, 0.26, 0.84, 0.16, 0.5):
            mx = (1 - f) ** 2 * p0[0] + 2 * f * (1 - f) * cx + f * f * p1[0]
            my = (1 - f) ** 2 * p0[1] + 2 * f * (1 - f) * cy + f * f * p1[1]
            if all(abs(mx - x) > half_w + w or abs(my - y) > half_h + h
                   for x, y, w, h in placed):
                break
        placed.append((mx, my, half_w, half_h))
        ax.text(mx, my, label, fontsize=6.5, ha="center", va="center", color=color, zorder=5,
                bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))
    if not tl.transfers and not tl.locals:
        ax.text(LEFT + 1, -(top + 1.5), "nothing to do at this world size", fontsize=10)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    if str(path).lower().endswith(".png"):
        _palette(path)


def _palette(path) -> None:
    """Rewrite a PNG with a 256-colour palette: a third of the size, as legible (needs Pillow,
    which matplotlib depends on; skipped without it)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        q = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                       dither=Image.Dither.NONE)
    q.save(path, optimize=True)


def _key(tl) -> str:
    if tl.collective in ("all_reduce", "reduce", "reduce_scatter"):
        return "digits: the ranks whose contributions it sums so far; Σ: all of them"
    if tl.collective == "all_to_all":
        return "a→b: the block rank a sends to rank b"
    if tl.collective == "barrier":
        return "headers only, no payload"
    return "the rank whose data it is" + ("; scatter: the rank it is for"
                                          if tl.collective == "scatter" else "")


def _mark(ax, r, rd, buf, start, count, fill, edge, bar_y, range_x) -> None:
    """Fill (a written range) or outline (a read range) ``buf[start:start+count]``."""
    from matplotlib.patches import Rectangle

    by = bar_y(r, rd, buf)
    x0, x1 = range_x(r, rd, start, count)
    if count == 0:  # header-only message: a tick where it would start
        ax.plot([x0, x0], [by - 0.5, by + 0.5], color=fill or edge, lw=2, zorder=3)
        return
    if fill:
        ax.add_patch(Rectangle((x0, by - BAR_H * 0.5), x1 - x0, BAR_H, facecolor=fill, alpha=0.75,
                               lw=0, zorder=2))
    else:
        ax.add_patch(Rectangle((x0, by - BAR_H * 0.5), x1 - x0, BAR_H, facecolor="none",
                               edgecolor=edge, lw=1.6, zorder=3))
