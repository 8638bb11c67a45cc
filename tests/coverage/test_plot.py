"""gems-coverage's pictures (gems_coverage.plot): the files are written, and what each figure draws (lines,
legend, ticks, right-edge labels, bar lengths, titles) is what the history or the bench JSON says. No
pixels are compared. matplotlib is the optional `plot` extra; without it the tool still writes its text."""
import importlib.util
import json
import math
import sys

import pytest

from gems_coverage import cli, plot

needs_mpl = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                               reason="matplotlib (the 'plot' extra) is not installed: pip install 'gems[plot]' "
                                      "(scripts/setup.sh installs it, so CI runs these)")

LLAMA, BERT = "meta-llama/Llama-2-7b", "bert-base-uncased"


def _cell(pct, time=None):
    c = {"coverage_pct": pct, "covered": 1, "compute_ops": 2}
    return c if time is None else dict(c, time_coverage_pct=time)


HISTORY = [
    {"date": "2026-01-01", "commit": "aaaaaaaaaa", "registered_ops": 10, "overall_pct": 40.0,
     "coverage": {LLAMA: {"inference": _cell(40.0), "training": _cell(50.0)}, BERT: {"inference": _cell(30.0)}}},
    {"date": "2026-02-01", "commit": "bbbbbbbbbb", "registered_ops": 20, "overall_pct": 77.7, "gpu": "H100",
     "coverage": {LLAMA: {"inference": _cell(80.0, 95.5), "training": _cell(75.0, 90.0)},
                  BERT: {"inference": _cell(80.0)}}},
]


def _rows(n):
    return [{"op": f"op{i}", "aten_calls": 2.0, "gems_calls": 3.0, "delta_host_ms": h, "delta_device_ms": d}
            for i, (h, d) in enumerate([(1.5, 0.25), (-0.5, 0.75), (0.25, -1.0), (0.1, 0.0)][:n])]


BENCH = {"model": LLAMA, "workload": "decode", "device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "size": "full",
         "dtype": "bfloat16", "batch": 1, "seq_len": 128, "new_tokens": 64, "optimizer": None, "unit": "token",
         "aten_ms_median": 36.83, "gems_ms_median": 42.49, "throughput_ratio": 0.8668, "meaningful": True,
         "totals": {"aten_host_ms": 30.0, "gems_host_ms": 31.25, "aten_device_ms": 7.5, "gems_device_ms": 7.0},
         "ops": _rows(4)}


def _texts(items):
    return [t.get_text() for t in items]


def _without_matplotlib(monkeypatch):
    """Imports of matplotlib fail from here on, as where it is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)


# ----------------------------------------------------------------------------------------------- roadmap
@needs_mpl
def test_roadmap_figure_draws_the_history():
    fig = plot.roadmap_figure(HISTORY)
    ops, time = fig.axes
    labels = ["Llama-2-7b inference", "Llama-2-7b training", "bert-base-uncased inference"]
    assert _texts(fig.legends[0].get_texts()) == labels
    assert [ln.get_label() for ln in ops.get_lines()] == labels
    assert [list(ln.get_ydata()) for ln in ops.get_lines()] == [[40.0, 80.0], [50.0, 75.0], [30.0, 80.0]]
    # GPU time: only the series that have it; the snapshot without it is a gap
    assert [ln.get_label() for ln in time.get_lines()] == labels[:2]
    ys = [list(ln.get_ydata()) for ln in time.get_lines()]
    assert math.isnan(ys[0][0]) and [y[1] for y in ys] == [95.5, 90.0]
    assert _texts(time.get_xticklabels()) == ["2026-01-01\naaaaaaa", "2026-02-01\nbbbbbbb"]
    assert ops.get_ylim() == (0, 100) and "compute ops covered" in ops.get_ylabel()
    assert "GPU time covered" in time.get_ylabel() and "date and commit" in time.get_xlabel()
    # the latest values at the right edge; equal values of one mode share a label
    assert sorted(_texts(ops.texts)) == ["75.0%  llama2 train", "80.0%  llama2, bert inf"]
    assert sorted(_texts(time.texts)) == ["90.0%  llama2 train", "95.5%  llama2 inf"]
    assert "coverage" in fig.get_suptitle()
    assert any("20 registered ATen overloads" in t and "77.7%" in t for t in _texts(fig.texts))


@needs_mpl
def test_roadmap_without_gpu_time_says_how_to_record_it():
    fig = plot.roadmap_figure(HISTORY[:1])
    time = fig.axes[1]
    assert time.get_lines() == [] and any("roadmap --gpu-time" in t for t in _texts(time.texts))


def test_labels_are_spread_without_overlap():
    assert plot.spread([10.0, 50.0], 5.0, 0.0, 100.0) == [10.0, 50.0]             # room: at their values
    assert plot.spread([80.0, 80.0, 81.0], 5.0, 0.0, 100.0) == [80.0, 85.0, 90.0]
    assert plot.spread([99.0, 99.5, 100.0], 5.0, 0.0, 100.0) == [90.0, 95.0, 100.0]  # pushed back from the top


def test_at_most_ten_snapshot_ticks_the_latest_among_them():
    assert plot._thinned(3) == [0, 1, 2]
    assert plot._thinned(25) == [0, 3, 6, 9, 12, 15, 18, 21, 24]


@needs_mpl
def test_roadmap_command_writes_the_png(tmp_path, capsys):
    hist = tmp_path / "h.jsonl"
    hist.write_text("".join(json.dumps(h) + "\n" for h in HISTORY))
    png = tmp_path / "c.png"
    assert cli.main(["-q", "roadmap", "--root", str(tmp_path), "--history", str(hist), "--png", str(png),
                     "--no-record"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "docs" / "roadmap.md").exists() and capsys.readouterr().err == ""


def test_roadmap_without_matplotlib_writes_the_page_and_says_how_to_get_the_plot(tmp_path, capsys, monkeypatch):
    _without_matplotlib(monkeypatch)
    hist = tmp_path / "h.jsonl"
    hist.write_text(json.dumps(HISTORY[0]) + "\n")
    png = tmp_path / "c.png"
    assert cli.main(["-q", "roadmap", "--root", str(tmp_path), "--history", str(hist), "--png", str(png),
                     "--no-record"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and "not drawn" in out[1] and "pip install 'gems[plot]'" in out[1]
    assert (tmp_path / "docs" / "roadmap.md").exists() and not png.exists()


# ------------------------------------------------------------------------------------------------- bench
@needs_mpl
def test_bench_figure_stacks_host_and_device_per_op():
    fig = plot.bench_figure(BENCH, top=3)
    ax = fig.axes[0]
    host, dev = ax.containers
    assert [b.get_width() for b in host] == [1.5, -0.5, 0.25]
    assert [b.get_width() for b in dev] == [0.25, 0.75, -1.0]
    # a device delta of the host's sign continues its bar; one of the other sign starts at zero
    assert [b.get_x() for b in dev] == [1.5, 0.0, 0.0]
    assert _texts(ax.get_yticklabels()) == ["op0  ×3", "op1  ×3", "op2  ×3"]
    assert [t.split(":")[0] for t in _texts(ax.get_legend().get_texts())] == ["host", "device"]
    assert fig.get_suptitle() == "Llama-2-7b decode: Gems / ATen throughput 0.87x"
    sub = ax.get_title()
    assert sub.startswith("NVIDIA H100 80GB HBM3; full, bfloat16, batch 1, seq 128 + 64 new tokens\n")
    assert "36.83 vs Gems 42.49 ms/token" in sub and "top 3 of 4 ops" in sub
    assert "host +1.25 ms" in sub and "device -0.50 ms" in sub
    assert "per token" in ax.get_xlabel()


@needs_mpl
def test_bench_figure_on_cpu_has_no_device_bars_and_says_timings_are_meaningless():
    d = dict(BENCH, device="cpu", gpu="cpu", size="tiny", meaningful=False, throughput_ratio=None,
             totals=dict(BENCH["totals"], aten_device_ms=None, gems_device_ms=None),
             ops=[dict(r, delta_device_ms=None) for r in _rows(2)])
    fig = plot.bench_figure(d)
    ax = fig.axes[0]
    assert len(ax.containers) == 1 and [b.get_width() for b in ax.containers[0]] == [1.5, -0.5]
    assert fig.get_suptitle() == "Llama-2-7b (tiny) decode: Gems / ATen throughput n/a"
    assert "meaningless" in ax.get_title() and "host +1.25 ms" in ax.get_title() and ", device" not in ax.get_title()


def test_bench_json_is_checked():
    with pytest.raises(ValueError, match="not a `gems-coverage bench"):
        plot.check_bench({"model": "x"})
    with pytest.raises(ValueError, match="--no-attribution"):
        plot.check_bench(dict(BENCH, ops=[]))


@needs_mpl
def test_bench_plot_command_draws_a_saved_json(tmp_path):
    src, png = tmp_path / "b.json", tmp_path / "b.png"
    src.write_text(json.dumps(BENCH))
    assert cli.main(["-q", "bench-plot", str(src), "-o", str(png), "--top", "2"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content,msg", [("{", "not JSON"), ("[]", "not a `gems-coverage bench"),
                                          (json.dumps(dict(BENCH, ops=[])), "--no-attribution")])
def test_bench_plot_bad_input_exits_2(tmp_path, capsys, content, msg):
    pytest.importorskip("matplotlib", reason="the check for matplotlib comes first")
    src = tmp_path / "b.json"
    src.write_text(content)
    assert cli.main(["-q", "bench-plot", str(src), "-o", str(tmp_path / "b.png")]) == 2
    assert msg in capsys.readouterr().err and not (tmp_path / "b.png").exists()


def test_bench_plot_needs_matplotlib_before_running(tmp_path, capsys, monkeypatch):
    _without_matplotlib(monkeypatch)
    for argv in (["bench", "llama2", "--plot", str(tmp_path / "c.png")],
                 ["bench-plot", str(tmp_path / "b.json"), "-o", str(tmp_path / "c.png")]):
        assert cli.main(["-q", *argv]) == 2
        assert "pip install 'gems[plot]'" in capsys.readouterr().err


def test_bench_plot_needs_the_attribution(tmp_path, capsys):
    assert cli.main(["-q", "bench", "llama2", "--no-attribution", "--plot", str(tmp_path / "c.png")]) == 2
    assert "drop --no-attribution" in capsys.readouterr().err


@needs_mpl
def test_bench_plot_option_draws_what_the_json_says(tmp_path, monkeypatch):
    """A real (tiny, CPU) bench run with --plot: the chart holds the JSON's rows, in its order."""
    drawn = []
    save = plot.save
    monkeypatch.setattr(plot, "save", lambda fig, path: drawn.append(fig) or save(fig, path))
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert cli.main(["-q", "bench", "llama2", "--device", "cpu", "--steps", "1", "--warmup", "0", "--seq-len", "6",
                     "--include", "rsqrt", "--top", "5", "--format", "json", "-o", str(out),
                     "--plot", str(png)]) == 0
    d = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = drawn[0].axes[0]
    assert [b.get_width() for b in ax.containers[0]] == [r["delta_host_ms"] for r in d["ops"][:5]]
    assert [t.split()[0] for t in _texts(ax.get_yticklabels())] == [r["op"] for r in d["ops"][:5]]
    assert f"{d['throughput_ratio']:.2f}x" in drawn[0].get_suptitle()
