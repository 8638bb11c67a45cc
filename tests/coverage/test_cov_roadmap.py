"""Roadmap: snapshots in a history file and the markdown page (the plot: test_plot.py)."""
import json
from types import SimpleNamespace

from gems_coverage import roadmap
from gems_coverage.cli import main


def test_record_and_render(tmp_path, capsys):
    hist = tmp_path / "docs" / "roadmap" / "history.jsonl"
    md = tmp_path / "docs" / "roadmap.md"
    common = ["--root", str(tmp_path), "--models", "bert"]
    assert main(["-q", "roadmap", *common, "--date", "2026-01-01", "--commit", "aaaa"]) == 0
    assert main(["-q", "roadmap", *common, "--date", "2026-02-01", "--commit", "bbbb"]) == 0
    # re-running the same date and commit replaces that snapshot
    assert main(["-q", "roadmap", *common, "--date", "2026-02-01", "--commit", "bbbb"]) == 0
    out = capsys.readouterr().out
    assert "2 snapshot(s)" in out.splitlines()[-1]
    lines = [json.loads(x) for x in hist.read_text().splitlines()]
    assert [x["commit"] for x in lines] == ["aaaa", "bbbb"]
    snap = lines[-1]
    assert set(snap) >= {"date", "commit", "registered_ops", "coverage", "overall_pct"}
    assert set(snap["coverage"]["bert-base-uncased"]) == {"inference", "training"}
    text = md.read_text()
    assert "![coverage over time](roadmap/coverage.png)" in text
    assert "| 2026-02-01 | `bbbb` |" in text and "| 2026-01-01 | `aaaa` |" in text
    assert text.index("2026-02-01 | `bbbb`") < text.index("2026-01-01 | `aaaa`")   # newest first
    # render only
    assert main(["-q", "roadmap", "--root", str(tmp_path), "--no-record"]) == 0


def test_render_without_history_is_bad_input(tmp_path, capsys):
    assert main(["-q", "roadmap", "--root", str(tmp_path), "--no-record"]) == 2
    assert "no snapshots yet" in capsys.readouterr().err


def test_malformed_history_is_bad_input(tmp_path, capsys):
    h = tmp_path / "h.jsonl"
    h.write_text("{broken\n")
    assert main(["-q", "roadmap", "--root", str(tmp_path), "--history", str(h), "--no-record"]) == 2
    assert "malformed history" in capsys.readouterr().err


def test_render_markdown_lists_gaps():
    hist = [{"date": "2026-01-01", "commit": "c1", "registered_ops": 3, "overall_pct": 50.0, "overall_covered": 1,
             "overall_compute_ops": 2, "gaps": ["silu.default"],
             "coverage": {"m": {"inference": {"coverage_pct": 50.0, "covered": 1, "compute_ops": 2}}}}]
    text = roadmap.render_markdown(hist, "x.png")
    assert "`silu.default`" in text and "| m | inference | 1/2 | 50.0% |" in text


def _doc(model, mode, pct):
    return {"model": model, "mode": mode, "device": "meta",
            "summary": {"coverage_pct": pct, "covered_compute_ops": 1, "compute_ops": 2}}


def test_snapshot_records_gpu_time_and_the_page_shows_it():
    docs = [_doc("m", "inference", 50.0), _doc("m", "training", 40.0)]
    mtx = {"overall": {"coverage_pct": 45.0, "covered_compute_ops": 2, "compute_ops": 4}, "ops": []}
    gpu = {"gpu": "NVIDIA H100", "pct": {("m", "inference"): 97.5, ("m", "training"): None}}
    snap = roadmap.snapshot(docs, mtx, SimpleNamespace(registered_ops=7), date="2026-03-01", commit="c",
                            gpu_time=gpu)
    assert snap["gpu"] == "NVIDIA H100"
    assert snap["coverage"]["m"]["inference"] == {"coverage_pct": 50.0, "covered": 1, "compute_ops": 2,
                                                  "time_coverage_pct": 97.5}
    text = roadmap.render_markdown([snap], "x.png")
    assert "GPU time covered (NVIDIA H100) |" in text
    assert "| m | inference | 1/2 | 50.0% | 97.5% |" in text and "| m | training | 1/2 | 40.0% | -- |" in text
    assert "| 50.0% (time 97.5%) |" in text                      # the history table
    # a snapshot without GPU time keeps the page as it was
    plain = roadmap.snapshot(docs, mtx, SimpleNamespace(registered_ops=7), date="2026-03-01", commit="c")
    assert "gpu" not in plain and "GPU time covered (" not in roadmap.render_markdown([plain], "x.png")


def test_plot_data_follows_the_history():
    hist = [{"date": "2026-01-01", "commit": "0123456789",
             "coverage": {"bert-base-uncased": {"inference": {"coverage_pct": 30.0}},
                          "meta-llama/Llama-2-7b": {"training": {"coverage_pct": 20.0}}}},
            {"date": "2026-01-01", "commit": "abcdef0123",
             "coverage": {"meta-llama/Llama-2-7b": {"training": {"coverage_pct": 25.0, "time_coverage_pct": 90.0}}}}]
    # built-in order (Llama first), modes in MODES order; None where a snapshot lacks a value
    assert roadmap.plot_series(hist) == [
        {"model": "meta-llama/Llama-2-7b", "mode": "training", "label": "Llama-2-7b training",
         "ops": [20.0, 25.0], "time": [None, 90.0]},
        {"model": "bert-base-uncased", "mode": "inference", "label": "bert-base-uncased inference",
         "ops": [30.0, None], "time": [None, None]}]
    assert roadmap.plot_xlabels(hist) == ["2026-01-01\n0123456", "2026-01-01\nabcdef0"]


def test_gpu_time_needs_cuda_and_a_recorded_snapshot(tmp_path, capsys, monkeypatch):
    import torch
    assert main(["-q", "roadmap", "--root", str(tmp_path), "--gpu-time", "--no-record"]) == 2
    assert "drop --no-record" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["-q", "roadmap", "--root", str(tmp_path), "--gpu-time", "--models", "bert"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "docs").exists()           # nothing traced or written before the check


def test_writes_under_the_current_folder_not_the_checkout(tmp_path, capsys, monkeypatch):
    """Without --root the page and its history are the current folder's: running the tool from anywhere
    never rewrites the tracked docs/roadmap* files of the checkout the tool lives in."""
    checkout_page = roadmap.repo_root() / "docs" / "roadmap.md"
    before = checkout_page.read_bytes() if checkout_page.exists() else None
    hist = tmp_path / "docs" / "roadmap" / "history.jsonl"
    hist.parent.mkdir(parents=True)
    hist.write_text(json.dumps({"date": "2026-01-01", "commit": "c1", "registered_ops": 3, "overall_pct": 50.0,
                                "overall_covered": 1, "overall_compute_ops": 2, "gaps": [],
                                "coverage": {"m": {"inference": {"coverage_pct": 50.0, "covered": 1,
                                                                 "compute_ops": 2}}}}) + "\n")
    monkeypatch.chdir(tmp_path)
    assert main(["-q", "roadmap", "--no-record"]) == 0
    assert "| m | inference | 1/2 | 50.0% |" in (tmp_path / "docs" / "roadmap.md").read_text()
    assert (checkout_page.read_bytes() if checkout_page.exists() else None) == before
