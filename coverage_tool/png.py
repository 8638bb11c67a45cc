"""A tiny PNG line-plot writer (zlib + struct), so the roadmap plot needs no plotting library."""
from __future__ import annotations

import struct
import zlib

# 3x5 bitmap digits for axis labels
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", "%": "101001010100101",
}

PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207),
           (140, 86, 75), (227, 119, 194)]
PALETTE_NAMES = ["blue", "red", "green", "purple", "orange", "cyan", "brown", "pink"]


class Canvas:
    def __init__(self, w: int, h: int, bg=(255, 255, 255)):
        self.w, self.h = w, h
        self.px = [bytearray(bytes(bg) * w) for _ in range(h)]

    def set(self, x: int, y: int, c):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * x
            self.px[y][i:i + 3] = bytes(c)

    def rect(self, x0, y0, x1, y1, c):
        for y in range(min(y0, y1), max(y0, y1) + 1):
            for x in range(min(x0, x1), max(x0, x1) + 1):
                self.set(x, y, c)

    def line(self, x0, y0, x1, y1, c, width: int = 2, dash: int = 0):
        """Bresenham line; ``dash`` > 0 draws dash-long pieces with equal gaps."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, n = dx + dy, 0
        while True:
            if not dash or (n // dash) % 2 == 0:
                for ox in range(width):
                    for oy in range(width):
                        self.set(x0 + ox - width // 2, y0 + oy - width // 2, c)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy
            n += 1

    def text(self, x: int, y: int, s: str, c=(0, 0, 0), scale: int = 2):
        for ch in s:
            g = _GLYPHS.get(ch)
            if g:
                for i, bit in enumerate(g):
                    if bit == "1":
                        r, q = divmod(i, 3)
                        self.rect(x + q * scale, y + r * scale, x + q * scale + scale - 1,
                                  y + r * scale + scale - 1, c)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.px)

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")


def line_plot(series: list, n_points: int, w: int = 720, h: int = 360) -> bytes:
    """series: [(values (len n_points, None = missing), color, dashed)], y in 0..100 (%)."""
    cv = Canvas(w, h)
    left, right, top, bottom = 56, w - 16, 16, h - 28
    grid, axis = (225, 225, 225), (60, 60, 60)
    for pct in range(0, 101, 10):
        y = bottom - round((bottom - top) * pct / 100)
        cv.line(left, y, right, y, axis if pct == 0 else grid, width=1)
        if pct % 20 == 0:
            label = f"{pct}%"
            cv.text(left - 8 - 8 * len(label), y - 5, label, axis)
    cv.line(left, top, left, bottom, axis, width=1)

    def xpos(i):
        if n_points <= 1:
            return (left + right) // 2
        return left + 12 + round((right - left - 24) * i / (n_points - 1))
    for i in range(n_points):
        cv.line(xpos(i), bottom, xpos(i), bottom + 4, axis, width=1)
    for k, (values, color, dashed) in enumerate(series):
        off = round((k - (len(series) - 1) / 2) * 2)   # a small shift keeps equal values visible
        prev = None
        for i, v in enumerate(values):
            if v is None:
                prev = None
                continue
            p = (xpos(i) + off, bottom - round((bottom - top) * max(0.0, min(100.0, v)) / 100))
            if prev is not None:
                cv.line(prev[0], prev[1], p[0], p[1], color, width=2, dash=6 if dashed else 0)
            cv.rect(p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3, color)
            prev = p
    return cv.png()
