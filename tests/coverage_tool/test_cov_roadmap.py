"""Roadmap: snapshots in a history file, markdown rendering and the dependency-free PNG plot."""
import json
import struct
import zlib

from coverage_tool import png, roadmap
from coverage_tool.cli import main


def decode_png(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h = 8, b"", None, None
    while pos < len(data):
        n, = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        crc, = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body)
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert (depth, ctype) == (8, 2)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = 3 * w + 1
    rows = [raw[i * stride + 1:(i + 1) * stride] for i in range(h)]
    return w, h, rows


def test_png_writer_draws_lines():
    data = png.line_plot([([0.0, 50.0, 100.0], (255, 0, 0), False), ([None, 20.0, 30.0], (0, 0, 255), True)], 3,
                         w=200, h=120)
    w, h, rows = decode_png(data)
    assert (w, h) == (200, 120)
    colors = {bytes(r[i:i + 3]) for r in rows for i in range(0, len(r), 3)}
    assert bytes((255, 0, 0)) in colors and bytes((0, 0, 255)) in colors and bytes((255, 255, 255)) in colors


def test_record_and_render(tmp_path, capsys):
    hist = tmp_path / "docs" / "roadmap" / "history.jsonl"
    md = tmp_path / "docs" / "roadmap.md"
    pngf = tmp_path / "docs" / "roadmap" / "coverage.png"
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
    w, h, _ = decode_png(pngf.read_bytes())
    assert (w, h) == (720, 360)
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
