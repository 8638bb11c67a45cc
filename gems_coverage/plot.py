"""Pictures: the roadmap's coverage over time and the bench's per-op attribution, drawn with matplotlib.

matplotlib is optional (`pip install 'gems[plot]'`; scripts/setup.sh installs it): it is imported on first
use, never when gems_coverage is imported, and where it is missing the drawing functions raise
PlotUnavailable, whose message says how to get it. Figures are built with matplotlib's object API on the
Agg canvas, not through pyplot: no GUI backend is ever chosen and a caller's own pyplot state is left
alone. The functions return the Figure, so tests read back what was drawn (lines, labels, bar widths)
instead of comparing pixels.
"""
from __future__ import annotations

import math
from pathlib import Path

INSTALL_HINT = "pip install 'gems[plot]' (or: pip install matplotlib)"
DPI = 120           # ~1150 px wide: GitHub shows it at ~880 px, where 9-10 pt text stays readable
WIDTH_IN = 9.6
MODE_STYLE = {"inference": ("-", "o"), "training": ("--", "s")}
HOST_COLOR, DEVICE_COLOR = "#4c72b0", "#dd8452"
LABEL_PT = 9


class PlotUnavailable(RuntimeError):
    pass


def _new_figure(height_in: float, **kw):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(f"drawing the plot needs matplotlib: {INSTALL_HINT}") from None
    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, **kw)
    FigureCanvasAgg(fig)
    return fig


def require() -> None:
    """Raise PlotUnavailable now, before a long run whose results are to be plotted."""
    _new_figure(1.0)


def save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


# --------------------------------------------------------------------------------------------- roadmap
def roadmap_figure(history: list):
    """Two panels sharing the snapshot axis: compute ops covered, and GPU time covered."""
    from . import roadmap as RM
    series = RM.plot_series(history)
    fig = _new_figure(7.0)
    ax_ops, ax_time = fig.subplots(2, 1, sharex=True)
    # the right margin holds the latest values, the bottom one the legend
    fig.subplots_adjust(left=0.1, right=0.72, top=0.87, bottom=0.2, hspace=0.12)
    models = list(dict.fromkeys(s["model"] for s in series))
    x = list(range(len(history)))
    for ax, key, ylabel in ((ax_ops, "ops", "compute ops covered\n(% of the ops a model calls)"),
                            (ax_time, "time", "GPU time covered\n(% of its compute-op time)")):
        drawn = [s for s in series if any(v is not None for v in s[key])]
        for s in drawn:
            i = models.index(s["model"])
            style, marker = MODE_STYLE.get(s["mode"], (":", "^"))
            # models often share values (Aquila is Llama's architecture): the earlier a model, the wider
            # its line, so a line drawn on top of another leaves it visible at the edges
            width = 1.5 + 0.6 * (len(models) - 1 - i)
            ax.plot(x, [math.nan if v is None else v for v in s[key]], color=f"C{i % 10}", linestyle=style,
                    marker=marker, linewidth=width, markersize=3 + width, label=s["label"])
        _pct_axis(ax, ylabel)
        _label_latest(ax, drawn, key, models)
        if not drawn:
            ax.text(0.5, 0.5, "no GPU-timed snapshot yet:\n`gems-coverage roadmap --gpu-time` on a CUDA machine "
                    "records one", transform=ax.transAxes, ha="center", va="center", color="0.4")
    ax_time.set_xlim(-0.5, len(x) - 0.5)
    shown = _thinned(len(x))
    ax_time.set_xticks(shown, labels=[RM.plot_xlabels(history)[i] for i in shown], fontsize=9)
    ax_time.set_xlabel("snapshot: date and commit, oldest left")
    handles, labels = ax_ops.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(models))), frameon=False,
               fontsize=9, handlelength=3)
    last = history[-1]
    fig.suptitle("Gems coverage of the supported models over time", fontsize=13, fontweight="bold")
    fig.text(0.5, 0.915, f"latest {last.get('date')} ({RM.short_commit(last.get('commit', ''))}): "
             f"{last.get('registered_ops')} registered ATen overloads, {last.get('overall_pct', 0):.1f}% of all "
             "compute ops of all models and modes", ha="center", fontsize=9, color="0.25")
    return fig


def _pct_axis(ax, ylabel: str):
    ax.set_ylim(0, 100)
    ax.set_yticks(range(0, 101, 20), labels=[f"{v}%" for v in range(0, 101, 20)], fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9.5)
    ax.grid(True, color="0.9")


def _thinned(n: int, most: int = 10) -> list:
    """At most `most` tick positions, the latest snapshot always among them."""
    step = max(1, math.ceil(n / most))
    return sorted(range(n - 1, -1, -step))


def _label_latest(ax, drawn: list, key: str, models: list):
    """Each series' latest value, written beside the panel's right edge: series of one mode with the same
    value share a label ("81.0%  llama2, aquila inf"), and labels are pushed apart so none overlaps."""
    import gems_models as M
    from matplotlib.transforms import blended_transform_factory
    groups: dict = {}
    for s in drawn:
        i = max(j for j, v in enumerate(s[key]) if v is not None)
        groups.setdefault((round(s[key][i], 1), s["mode"]), []).append((i, s))
    if not groups:
        return
    order = sorted(groups)
    axes_h_in = ax.get_position().height * ax.figure.get_figheight()
    gap = LABEL_PT * 1.3 / 72 / axes_h_in * 100        # one text line, in the panel's % units
    to_right = blended_transform_factory(ax.transAxes, ax.transData)
    for (v, mode), y in zip(order, spread([v for v, _ in order], gap, 0.0, 100.0)):
        members = groups[(v, mode)]
        names = ", ".join(M.short_name(s["model"]) for _, s in members)
        color = f"C{models.index(members[0][1]['model']) % 10}" if len(members) == 1 else "0.2"
        ax.annotate(f"{v:.1f}%  {names} {'inf' if mode == 'inference' else 'train'}",
                    xy=(max(i for i, _ in members), v), xytext=(1.02, y), textcoords=to_right, va="center",
                    fontsize=LABEL_PT, color=color, annotation_clip=False,
                    arrowprops={"arrowstyle": "-", "color": "0.6", "linewidth": 0.6})


def spread(values: list, gap: float, lo: float, hi: float) -> list:
    """Positions for labels at ascending `values`: each at its value where it can be, at least `gap` apart,
    within [lo, hi] where they fit."""
    pos: list = []
    for v in values:                                   # push up
        pos.append(max(v, pos[-1] + gap if pos else lo))
    if pos and pos[-1] > hi:                           # then back down from the top
        pos[-1] = hi
        for k in range(len(pos) - 2, -1, -1):
            pos[k] = min(pos[k], pos[k + 1] - gap)
    return pos


# ----------------------------------------------------------------------------------------------- bench
BENCH_KEYS = ("model", "workload", "unit", "ops", "throughput_ratio")


def check_bench(d) -> None:
    """ValueError unless `d` is a `gems-coverage bench --format json` result with an attribution."""
    if not isinstance(d, dict) or any(k not in d for k in BENCH_KEYS):
        raise ValueError("not a `gems-coverage bench --format json` result (needs "
                         + ", ".join(BENCH_KEYS) + ")")
    if not d["ops"]:
        raise ValueError("the result has no per-op attribution (it was run with --no-attribution)")


def bench_figure(d: dict, top: int = 20):
    """The per-op attribution as horizontal bars: what each outermost ATen op adds to (> 0) or saves from
    (< 0) a step or token with Gems vs ATen, host and device stacked; the throughput ratio in the title."""
    from . import roadmap as RM
    check_bench(d)
    rows = d["ops"][:top]
    unit = d["unit"]
    fig = _new_figure(2.4 + 0.3 * len(rows), layout="constrained")
    ax = fig.subplots()
    y = list(range(len(rows)))
    host = [r["delta_host_ms"] for r in rows]
    ax.barh(y, host, height=0.7, color=HOST_COLOR, label="host: CPU time of the op (dispatch, wrapper, launch)")
    dev = [r.get("delta_device_ms") for r in rows]
    if any(v is not None for v in dev):
        dev = [v or 0.0 for v in dev]
        # stacked away from zero: a device delta of the host's sign continues its bar, one of the other
        # sign starts at zero on the other side
        left = [h if (h >= 0) == (v >= 0) else 0.0 for h, v in zip(host, dev)]
        ax.barh(y, dev, left=left, height=0.7, color=DEVICE_COLOR,
                label="device: GPU kernels launched under the op")
    ax.set_yticks(y, labels=[f"{r['op']}  ×{max(r.get('aten_calls') or 0, r.get('gems_calls') or 0):g}"
                             for r in rows], fontsize=8.5)
    ax.invert_yaxis()                                  # the largest difference on top
    ax.axvline(0, color="0.2", linewidth=0.8)
    ax.grid(True, axis="x", color="0.9")
    ax.set_axisbelow(True)
    ax.set_xlabel(f"Gems − ATen, ms per {unit}   (> 0: Gems adds time; < 0: Gems saves time)")
    ax.set_ylabel(f"outermost ATen op  ×calls per {unit}")
    ax.legend(loc="best", fontsize=8.5)
    ratio = d["throughput_ratio"]
    size = "" if d.get("size") in (None, "full") else f" ({d['size']})"
    fig.suptitle(f"{RM.display_name(d['model'])}{size} {d['workload']}: Gems / ATen throughput "
                 + ("n/a" if ratio is None else f"{ratio:.2f}x"), fontsize=12, fontweight="bold")
    ax.set_title(_bench_subtitle(d, len(rows)), fontsize=8.5, color="0.25")
    return fig


def _bench_subtitle(d: dict, shown: int) -> str:
    unit = d["unit"]
    lines = [f"{d.get('gpu') or d.get('device', '?')}; {d.get('size')}, {d.get('dtype')}, batch {d.get('batch')}, "
             f"seq {d.get('seq_len')}" + (f" + {d['new_tokens']} new tokens" if d.get("workload") == "decode" else "")
             + (f", {d['optimizer']}" if d.get("optimizer") else "")]
    a, g = d.get("aten_ms_median"), d.get("gems_ms_median")
    if a is not None and g is not None:
        lines.append(f"median ATen {a:.2f} vs Gems {g:.2f} ms/{unit} (throughput ratio > 1: Gems is faster)")
    t = d.get("totals") or {}
    line = f"top {shown} of {len(d['ops'])} ops by |Δhost| + |Δdevice|"
    timed_device = t.get("aten_device_ms") is not None
    if t:
        line += f"; all ops, per {unit}: host {t['gems_host_ms'] - t['aten_host_ms']:+.2f} ms"
        if timed_device:
            line += f", device {t['gems_device_ms'] - t['aten_device_ms']:+.2f} ms"
    lines.append(line)
    if timed_device:
        lines.append("host and device run concurrently: their deltas do not add up to the step's change")
    if d.get("meaningful") is False:
        lines.append("CPU run through the Triton interpreter: timings meaningless")
    return "\n".join(lines)


def write_roadmap(path, history: list) -> Path:
    return save(roadmap_figure(history), path)


def write_bench(path, d: dict, top: int = 20) -> Path:
    return save(bench_figure(d, top), path)
