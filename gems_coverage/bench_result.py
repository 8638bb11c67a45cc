"""What `gems-coverage bench` reports: the result of a workload run with ATen and with Gems, the per-op
attribution of the difference (from the two profiled runs), and the result as a table, markdown or JSON."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional


# ------------------------------------------------------------------------------------------ results
@dataclass
class OpRow:
    """One outermost ATen op of the profiled run, per unit (step, or decode token)."""

    op: str                                 # profiler name without "aten::" (e.g. "mm", "linear")
    aten_calls: float = 0.0                 # calls per unit
    gems_calls: float = 0.0
    aten_host_us_per_call: Optional[float] = None
    gems_host_us_per_call: Optional[float] = None
    aten_device_us_per_call: Optional[float] = None   # None on CPU (no device timeline)
    gems_device_us_per_call: Optional[float] = None
    delta_host_ms: float = 0.0              # per unit: gems calls x time - aten calls x time
    delta_device_ms: Optional[float] = None
    served: float = 0.0                     # per unit, Gems overloads that ran under this op
    fallback: float = 0.0
    gems_overloads: dict = field(default_factory=dict)   # overload -> {"served", "fallback"} per unit

    def rank(self) -> float:
        return abs(self.delta_host_ms) + abs(self.delta_device_ms or 0.0)


@dataclass
class BenchResult:
    model: str
    workload: str
    device: str
    gpu: str
    size: str
    dtype: str
    batch: int
    seq_len: int
    new_tokens: int
    steps: int
    warmup: int
    optimizer: Optional[str]
    unit: str                                   # "step" or "token"
    tokens_per_unit: int
    aten_ms: list = field(default_factory=list)
    gems_ms: list = field(default_factory=list)
    aten_peak_mib: Optional[float] = None
    gems_peak_mib: Optional[float] = None
    agreement: list = field(default_factory=list)     # [{check, ok, detail, rel_err, tol}]
    ops: list = field(default_factory=list)           # OpRow, ranked
    profiled_units: Optional[int] = None              # units in the profiled run (None: no attribution)
    totals: Optional[dict] = None                     # per unit: host/device sums, profiled wall time
    no_plan: dict = field(default_factory=dict)       # overload -> why signatures kept the full path
    # overload -> {reason: calls}: what ATen served with Gems on, and why ("aten faster": a tuned bucket
    # where cuBLAS won); counted over the profiled Gems run with attribution, else over every Gems turn
    fallbacks: dict = field(default_factory=dict)
    # overload -> served calls that ran Python (no call plan replayed from C++: ops without plans, such as
    # the _foreach_* ops, or signatures seen for the first time), same scope as fallbacks; None when
    # the C++ fast path is not loaded (then every call runs Python)
    python_path: Optional[dict] = None
    meaningful: bool = True
    notes: list = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    # decode --fresh-lengths: every warm-up and timed run decodes KV lengths no earlier run met
    fresh_lengths: bool = False
    patched: bool = False                             # --patch: the Gems turns run gems.patch(model) too
    patch: Optional[dict] = None                      # gems.patch's report (what was replaced)

    @property
    def agree(self) -> bool:
        return all(c["ok"] for c in self.agreement)

    @property
    def aten_median(self) -> Optional[float]:
        return statistics.median(self.aten_ms) if self.aten_ms else None

    @property
    def gems_median(self) -> Optional[float]:
        return statistics.median(self.gems_ms) if self.gems_ms else None

    @property
    def device_timed(self) -> bool:
        return self.device.startswith("cuda")

    def to_dict(self) -> dict:
        d = asdict(self)
        a, g = self.aten_median, self.gems_median
        d["aten_ms_median"] = _r(a, 4)
        d["gems_ms_median"] = _r(g, 4)
        d["aten_tokens_per_s"] = _r(self.tokens_per_unit / a * 1e3, 2) if a else None
        d["gems_tokens_per_s"] = _r(self.tokens_per_unit / g * 1e3, 2) if g else None
        d["throughput_ratio"] = _r(a / g, 4) if a and g else None
        d["agree"] = self.agree
        d["baseline"] = "ATen with Gems unregistered"
        return d


def _r(x, n):
    return None if x is None else round(float(x), n)


# ----------------------------------------------------------------------------------------- attribution
def attribute(aten: dict, mine: dict, units: int, with_device: bool) -> list:
    """OpRows from the two profiled runs, per unit, ranked by |delta host| + |delta device|."""
    rows: dict[str, OpRow] = {}
    for mode, prof in (("aten", aten), ("gems", mine)):
        for op, (calls, host, dev) in prof["ops"].items():
            r = rows.setdefault(op, OpRow(op))
            setattr(r, f"{mode}_calls", round(calls / units, 3))
            setattr(r, f"{mode}_host_us_per_call", round(host / calls, 2))
            if with_device:
                setattr(r, f"{mode}_device_us_per_call", round(dev / calls, 2))
    for op, r in rows.items():
        a, g = aten["ops"].get(op, (0, 0.0, 0.0)), mine["ops"].get(op, (0, 0.0, 0.0))
        r.delta_host_ms = round((g[1] - a[1]) / units / 1e3, 4)
        if with_device:
            r.delta_device_ms = round((g[2] - a[2]) / units / 1e3, 4)
    _place_stats(rows, mine["stats"], mine["inner"], units)
    return sorted(rows.values(), key=lambda r: -r.rank())


def totals(aten: dict, mine: dict, units: int, with_device: bool) -> dict:
    """Per unit and mode: the sums of host and device time over the outermost ATen ops, and the profiled
    run's wall time (profiler on: the difference to the host sum is Python outside ATen ops)."""
    out = {}
    for mode, prof in (("aten", aten), ("gems", mine)):
        vals = list(prof["ops"].values())
        out[f"{mode}_host_ms"] = round(sum(v[1] for v in vals) / units / 1e3, 4)
        out[f"{mode}_device_ms"] = round(sum(v[2] for v in vals) / units / 1e3, 4) if with_device else None
        out[f"{mode}_wall_ms"] = round(prof["wall_ms"] / units, 4)
    return out


def _place_stats(rows: dict, stats: dict, inner: dict, units: int):
    """Put each Gems overload's served/fallback counts on the outermost ops it ran under.

    Gems serves at the backend key, often below a composite op (`mm` under `linear`): the counts go
    to the rows whose profiled subtree held that ATen op, split by how many of its calls each held."""
    from .classify import packet_of
    for overload, s in stats.items():
        pk = packet_of(overload)
        holders = {outer: below[pk] for outer, below in inner.items() if below.get(pk)}
        total = sum(holders.values())
        if not total:   # not seen by the profiler: keep the counts visible under the op's own name
            holders, total = {pk: 1}, 1
        for outer, n in holders.items():
            r = rows.setdefault(outer, OpRow(outer))
            share = n / total / units
            served, fell = round(s["served"] * share, 3), round(s["fallback"] * share, 3)
            r.served = round(r.served + served, 3)
            r.fallback = round(r.fallback + fell, 3)
            r.gems_overloads[overload] = {"served": served, "fallback": fell}


# ------------------------------------------------------------------------------------------- output
def format_result(res: BenchResult, fmt: str = "table", top: int = 25, wide: bool = False) -> str:
    import json
    d = res.to_dict()
    if fmt == "json":
        return json.dumps(d, indent=1) + "\n"
    from tabulate import tabulate
    md = fmt == "markdown"
    tf = "github" if md else "simple"
    u = res.unit
    what = (f"{res.model} ({res.size}, {res.dtype}) on {res.gpu}: {res.workload}, batch {res.batch}, "
            f"seq {res.seq_len}" + (f" + {res.new_tokens} new tokens" if res.workload == "decode" else "")
            + (" (fresh lengths every run)" if res.fresh_lengths else "")
            + (f", {res.optimizer}" if res.optimizer else "")
            + f"; median of {res.steps} timed run(s) after {res.warmup} warm-up, ATen (Gems unregistered) "
              f"and Gems alternating")
    lines = [("### " if md else "bench    ") + what, ""]
    for n in res.notes:
        lines.append(("- " if md else "note     ") + n)
    if res.patched and res.patch:
        lines.append(("- " if md else "patched  ") + ("patched: " if md else "") + ", ".join(
            f"{k} x{v}" for k, v in res.patch["replaced"].items()) + "".join(f"; {n}" for n in res.patch["notes"]))
    summary = []
    for mode, label in (("aten", "ATen"), ("gems", "Gems")):
        peak = d[f"{mode}_peak_mib"]
        summary.append([label, _fmt(d[f"{mode}_ms_median"], ".3f"), _fmt(d[f"{mode}_tokens_per_s"], ".1f"),
                        "n/a (CPU)" if peak is None else f"{peak:.0f}"])
    lines += ["", tabulate(summary, headers=["mode", f"ms/{u}", "tokens/s", "peak MiB"], tablefmt=tf,
                           disable_numparse=True), ""]
    lines.append(("**ratio** " if md else "ratio    ") + f"{_fmt(d['throughput_ratio'], '.3f')} "
                 f"(Gems throughput / ATen's; > 1: Gems is faster)")
    for c in res.agreement:
        lines.append(("- agree " if md else "agree    ") + f"{'yes' if c['ok'] else 'NO'}: {c['check']}: {c['detail']}")
    if res.fallbacks:
        scope = "the profiled run" if res.profiled_units is not None else "every Gems turn"
        lines.append(("- " if md else "") + f"fell back to ATen (calls in {scope}): " + "; ".join(
            f"{k} {sum(v.values())} ({', '.join(f'{r}: {c}' for r, c in v.items())})"
            for k, v in list(res.fallbacks.items())[:12]))
    if res.python_path:
        scope = "the profiled run" if res.profiled_units is not None else "every Gems turn"
        lines.append(("- " if md else "") + f"served on the Python path, not replayed from C++ (calls in {scope}): "
                     + "; ".join(f"{k} {n}" for k, n in list(res.python_path.items())[:12]))
    if res.no_plan:
        lines.append(("- " if md else "") + "full path (no call plan): "
                     + "; ".join(f"{k}: {', '.join(v)}" for k, v in res.no_plan.items()))
    if res.profiled_units is not None:
        lines += ["", _totals_line(res.totals, u, res.profiled_units), ""]
        lines.append((_attribution_table if wide else _attribution_compact)(res.ops[:top], u, res.device_timed, tf))
        if len(res.ops) > top:
            lines.append(f"({len(res.ops) - top} more rows in --format json)")
    return "\n".join(lines) + "\n"


def _totals_line(t: dict, u: str, units: int) -> str:
    dev = ("device n/a (CPU)" if t["aten_device_ms"] is None else
           f"device {t['aten_device_ms']:.2f} -> {t['gems_device_ms']:.2f} ms")
    return (f"attribution per {u} (one profiled run per mode, {units} {u}(s), outermost ATen ops, ATen -> "
            f"Gems): host {t['aten_host_ms']:.2f} -> {t['gems_host_ms']:.2f} ms, {dev}; profiled wall "
            f"{t['aten_wall_ms']:.2f} -> {t['gems_wall_ms']:.2f} ms")


def _attribution_table(rows: list, u: str, device: bool, tf: str) -> str:
    from tabulate import tabulate
    table = []
    for r in rows:
        table.append([r.op, _fmt(r.aten_calls, "g"), _fmt(r.gems_calls, "g"),
                      _fmt(r.aten_host_us_per_call, ".1f"), _fmt(r.gems_host_us_per_call, ".1f"),
                      _fmt(r.aten_device_us_per_call, ".1f"), _fmt(r.gems_device_us_per_call, ".1f"),
                      f"{r.delta_host_ms:+.3f}", "-" if r.delta_device_ms is None else f"{r.delta_device_ms:+.3f}",
                      f"{r.served:g}/{r.fallback:g}" if (r.served or r.fallback) else "-"])
    headers = ["op", f"calls/{u} A", f"calls/{u} G", "host us/call A", "host us/call G", "dev us/call A",
               "dev us/call G", f"Δhost ms/{u}", f"Δdev ms/{u}", "served/fell back"]
    if not device:
        headers[5:7] = ["dev us/call A (n/a)", "dev us/call G (n/a)"]
    return tabulate(table, headers=headers, tablefmt=tf, disable_numparse=True)


OP_WIDTH = 34   # the compact table's op column; longer names keep their head and tail


def _short(name: str) -> str:
    if len(name) <= OP_WIDTH:
        return name
    half = (OP_WIDTH - 1) // 2
    return name[:half] + "…" + name[-(OP_WIDTH - 1 - half):]


def _attribution_compact(rows: list, u: str, device: bool, tf: str) -> str:
    """The attribution table in ~120 columns: calls as ATen/Gems in one column, the device columns only
    where there is device time, op names shortened (--wide and --format json have it all)."""
    from tabulate import tabulate
    table = []
    for r in rows:
        row = [_short(r.op), f"{_fmt(r.aten_calls, 'g')}/{_fmt(r.gems_calls, 'g')}",
               _fmt(r.aten_host_us_per_call, ".1f"), _fmt(r.gems_host_us_per_call, ".1f")]
        if device:
            row += [_fmt(r.aten_device_us_per_call, ".1f"), _fmt(r.gems_device_us_per_call, ".1f")]
        row.append(f"{r.delta_host_ms:+.3f}")
        if device:
            row.append("-" if r.delta_device_ms is None else f"{r.delta_device_ms:+.3f}")
        row.append(f"{r.served:g}/{r.fallback:g}" if (r.served or r.fallback) else "-")
        table.append(row)
    headers = ["op", "calls A/G", "host A", "host G"] + (["dev A", "dev G"] if device else []) \
        + ["Δhost ms"] + (["Δdev ms"] if device else []) + ["srv/fb"]
    return (tabulate(table, headers=headers, tablefmt=tf, disable_numparse=True)
            + f"\n(per {u}; A = ATen, G = Gems; host, dev: us per call; srv/fb: Gems served / fell back; "
              f"--wide or --format json: all)")


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)
