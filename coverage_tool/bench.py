"""The model benchmark: a workload with ATen and with Gems, end to end, and where the difference goes.

    gems-coverage bench llama2 --device cuda --workload decode

Both modes run the same model object on the same inputs (training restores the same starting weights
before each mode's parity step), warmed up, then timed step by step in alternation (ATen, Gems, ATen,
...), so drift hits both. Reported: ms per step (per token for decode), tokens/s, the throughput ratio
Gems/ATen, peak memory, whether the outputs agree (the parity tool's end-to-end rule on logits and
losses; greedy tokens position by position), and the attribution: one profiled step per mode, each
outermost ATen op's calls, host time per call (its CPU time, the Python kernel included) and device
time per call (the kernels launched under it), and what it adds to or saves from the step.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

WORKLOADS = ("prefill", "decode", "train")
OPTIMIZERS = ("adamw", "adamw-fused", "sgd")


@dataclass
class OpCost:
    op: str
    aten_calls: int = 0
    gems_calls: int = 0
    aten_host_us: float = 0.0      # per step, all calls
    gems_host_us: float = 0.0
    aten_device_us: float = 0.0
    gems_device_us: float = 0.0
    served: int = 0
    fallback: int = 0

    @property
    def delta_host_ms(self) -> float:
        return (self.gems_host_us - self.aten_host_us) / 1e3

    @property
    def delta_device_ms(self) -> float:
        return (self.gems_device_us - self.aten_device_us) / 1e3

    def row(self) -> dict:
        d = asdict(self)
        d["delta_host_ms"] = round(self.delta_host_ms, 4)
        d["delta_device_ms"] = round(self.delta_device_ms, 4)
        for k in ("aten_host_us", "gems_host_us", "aten_device_us", "gems_device_us"):
            d[k] = round(d[k], 2)
        return d


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
    unit: str                                  # "step" or "token"
    tokens_per_unit: int
    aten_ms: list = field(default_factory=list)
    gems_ms: list = field(default_factory=list)
    aten_peak_mib: Optional[float] = None
    gems_peak_mib: Optional[float] = None
    agree: bool = True
    agreement: list = field(default_factory=list)     # [{'check', 'ok', 'detail'}]
    ops: list = field(default_factory=list)           # OpCost rows
    meaningful: bool = True
    versions: dict = field(default_factory=dict)
    no_plan: dict = field(default_factory=dict)       # overload -> why signatures kept the full path

    @property
    def aten_median(self) -> float:
        return statistics.median(self.aten_ms) if self.aten_ms else float("nan")

    @property
    def gems_median(self) -> float:
        return statistics.median(self.gems_ms) if self.gems_ms else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ops"] = [o.row() if isinstance(o, OpCost) else o for o in self.ops]
        a, g = self.aten_median, self.gems_median
        d["aten_ms_median"] = round(a, 4)
        d["gems_ms_median"] = round(g, 4)
        d["aten_tokens_per_s"] = round(self.tokens_per_unit / a * 1e3, 2) if a == a and a > 0 else None
        d["gems_tokens_per_s"] = round(self.tokens_per_unit / g * 1e3, 2) if g == g and g > 0 else None
        d["throughput_ratio"] = round(a / g, 4) if g == g and g > 0 else None
        rows = self.ops
        d["totals"] = {k: round(sum(getattr(o, k) for o in rows) / 1e3, 4) for k in
                       ("aten_host_us", "gems_host_us", "aten_device_us", "gems_device_us")}
        d["totals"] = {k.replace("_us", "_ms"): v for k, v in d["totals"].items()}
        return d


# ------------------------------------------------------------------------------------------- workloads
class _Workload:
    """One workload on one built model: `step()` runs the timed unit and returns what parity compares."""

    def __init__(self, bundle, kind, new_tokens, optimizer):
        import torch
        self.b, self.kind, self.torch = bundle, kind, torch
        self.new_tokens = new_tokens
        self.opt = None
        if kind == "train":
            self.b.model.train()
            params = [p for p in self.b.model.parameters() if p.requires_grad]
            self.opt = _make_optimizer(params, optimizer, bundle.device)
            self.start = {k: v.detach().clone() for k, v in self.b.model.state_dict().items()}
        else:
            self.b.model.eval()

    def restore(self):
        """Training: the starting weights and a fresh optimizer state (parity steps start equal)."""
        with self.torch.no_grad():
            for k, v in self.b.model.state_dict().items():
                v.copy_(self.start[k])
        self.opt.state.clear()

    def step(self):
        torch = self.torch
        if self.kind == "prefill":
            with torch.no_grad():
                return _logits(_forward(self.b))
        if self.kind == "train":
            from models import training_loss
            self.opt.zero_grad(set_to_none=True)
            loss = training_loss(_forward(self.b, train=True))
            loss.backward()
            self.opt.step()
            return loss.detach()
        return self.decode()

    def decode(self, times: Optional[list] = None, sync: Callable = lambda: None):
        """Greedy decoding with the KV cache; the prefill is not timed, each decode step is."""
        from . import runner
        return runner.run_generate(self.b, self.new_tokens, times=times, sync=sync)


def _make_optimizer(params, name, device):
    import torch
    on_cuda = str(device).startswith("cuda")
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    # what users run: PyTorch's default (foreach on CUDA); the per-parameter loop elsewhere
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=on_cuda or None)


def _forward(bundle, train=False):
    from . import runner
    return runner.forward(bundle, train=train)


def _logits(out):
    import torch
    lg = getattr(out, "logits", None)
    if lg is None and isinstance(out, (tuple, list)):
        lg = next((t for t in out if isinstance(t, torch.Tensor)), None)
    return lg.detach() if lg is not None else None


# ------------------------------------------------------------------------------------------ the bench
def bench(model: str, *, workload: str = "prefill", device: str = "cpu", size: Optional[str] = None,
          dtype: Optional[str] = None, batch: int = 1, seq_len: Optional[int] = None, new_tokens: int = 16,
          steps: Optional[int] = None, warmup: Optional[int] = None, optimizer: str = "adamw",
          include=None, exclude=None, attribution: bool = True,
          progress: Callable[[str], None] = lambda s: None) -> BenchResult:
    import torch
    import gems
    import models as M
    if workload not in WORKLOADS:
        raise M.ModelError(f"unknown workload '{workload}' ({', '.join(WORKLOADS)})")
    if optimizer not in OPTIMIZERS:
        raise M.ModelError(f"unknown optimizer '{optimizer}' ({', '.join(OPTIMIZERS)})")
    dev_type = torch.device(device).type
    if dev_type == "meta":
        raise M.ModelError("bench runs real kernels: --device cuda (full size) or cpu (tiny, Triton interpreter)")
    on_cuda = dev_type == "cuda"
    size, dtype_name, _, seq_len = M.run_defaults(dev_type, size, dtype, seq_len)
    steps = steps or (5 if on_cuda else 1)
    warmup = 2 if warmup is None and on_cuda else (1 if warmup is None else warmup)
    recipe = M.resolve(model)
    progress(f"building {recipe.name} ({size}, {dtype_name}) on {device}")
    bundle = M.build(recipe, size=size, device=device, dtype=dtype_name, batch=batch, seq_len=seq_len, seed=0,
                     dropout=0.0 if workload == "train" else None)
    if workload == "decode":
        from . import runner
        runner.check_mode(bundle, "generate")
    wl = _Workload(bundle, workload, new_tokens, optimizer)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    scope = lambda: gems.use_gems(include=include, exclude=exclude)  # noqa: E731
    unit = "token" if workload == "decode" else "step"
    per_unit = batch * (seq_len if workload != "decode" else 1)
    res = BenchResult(recipe.name, workload, device, torch.cuda.get_device_name() if on_cuda else "cpu", size,
                      dtype_name, batch, seq_len, new_tokens if workload == "decode" else 0, steps, unit, per_unit,
                      meaningful=on_cuda,
                      versions={"torch": torch.__version__, "triton": _version("triton"),
                                "transformers": _version("transformers"), "gems": gems.__version__})

    def run(mode_on: bool, times: Optional[list] = None):
        if not mode_on:
            # ATen as users without Gems run it: once registered, every registered overload passes
            # through Gems' Python kernel even when Gems is off for the call; unregister (call plans
            # survive it) so the baseline pays nothing of Gems
            gems.disable()
        ctx = scope() if mode_on else _null()
        with ctx:
            if workload == "decode":
                return wl.decode(times, sync)
            sync()
            t0 = time.perf_counter()
            out = wl.step()
            sync()
            if times is not None:
                times.append((time.perf_counter() - t0) * 1e3)
            return out

    # parity first, from equal starting points
    progress("parity: one ATen and one Gems run on the same inputs")
    if workload == "train":
        wl.restore()
    ref = run(False)
    if workload == "train":
        wl.restore()
    got = run(True)
    res.agreement = _agreement(workload, got, ref)
    res.agree = all(c["ok"] for c in res.agreement)
    # warm-up and timing, alternating
    for i in range(warmup):
        progress(f"warm-up {i + 1}/{warmup}")
        run(False)
        run(True)
    for i in range(steps):
        progress(f"timed {i + 1}/{steps}")
        for on, times in ((False, res.aten_ms), (True, res.gems_ms)):
            if on_cuda:
                torch.cuda.reset_peak_memory_stats()
            run(on, times)
            if on_cuda:
                peak = torch.cuda.max_memory_allocated() / 2**20
                key = "gems_peak_mib" if on else "aten_peak_mib"
                setattr(res, key, round(max(getattr(res, key) or 0.0, peak), 1))
    if attribution:
        progress("attribution: one profiled step per mode")
        res.ops = _attribute(run, on_cuda)
    res.no_plan = {k: v["reasons"] for k, v in gems.plan_stats().items() if v["no_plan"]}
    return res


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _version(name):
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001
        return None


def _agreement(workload, got, ref) -> list:
    from .parity import compare_e2e
    if workload == "decode":
        n = min(got.shape[1], ref.shape[1])
        same = (got[:, :n] == ref[:, :n]).all(dim=0)
        first = int((~same).nonzero()[0]) if not bool(same.all()) else None
        detail = (f"greedy tokens equal at all {n} positions" if first is None else
                  f"greedy tokens diverge at position {first} of {n} (random weights leave near-ties among "
                  f"logits; the prefill logits check is the numeric one)")
        return [{"check": "tokens", "ok": first is None or first > 0, "detail": detail}]
    # the tolerance follows the model's dtype (parity's end-to-end table): a bf16 model is judged as bf16
    what = "loss (first step, same start)" if workload == "train" else "logits"
    ok, rel, max_abs, tol = compare_e2e(got, ref)
    if workload == "train":
        detail = f"loss gems {float(got):.6g} vs aten {float(ref):.6g}, rel err {rel:.2e} (tol {tol:.0e})"
    else:
        detail = f"rel err {rel:.2e} (tol {tol:.0e}), max abs {max_abs:.3g}"
    if not ok:
        # deep low-precision models can be noisier than the quick rule against ATen's own run; the
        # decisive rule compares both runs with an fp32 reference and names the first divergent op
        detail += "; run `gems-coverage parity MODEL --device ...` for the fp32-referenced rule"
    return [{"check": what, "ok": bool(ok), "detail": detail}]


# ----------------------------------------------------------------------------------------- attribution
def _attribute(run, on_cuda) -> list:
    import gems
    aten = _profile_step(lambda: run(False), on_cuda)
    gems.reset_stats()
    mine = _profile_step(lambda: run(True), on_cuda)
    stats = gems.stats()
    rows: dict[str, OpCost] = {}
    for src, pre in ((aten, "aten"), (mine, "gems")):
        for op, (calls, host, dev) in src.items():
            r = rows.setdefault(op, OpCost(op))
            setattr(r, f"{pre}_calls", calls)
            setattr(r, f"{pre}_host_us", host)
            setattr(r, f"{pre}_device_us", dev)
    for name, s in stats.items():
        r = rows.get(name.split(".", 1)[0])
        if r is not None:
            r.served += s["served"]
            r.fallback += s["fallback"]
    return sorted(rows.values(), key=lambda r: -(abs(r.delta_host_ms) + abs(r.delta_device_ms)))


def _profile_step(fn, on_cuda) -> dict:
    """{op base name: (calls, host us, device us)} over the outermost ATen ops of one step."""
    import warnings
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=acts) as prof:
            fn()
            if on_cuda:
                torch.cuda.synchronize()
        events = prof.events()
    out: dict[str, list] = {}
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        if p is not None:
            continue   # counted inside its outermost ATen op
        r = out.setdefault(e.name[6:], [0, 0.0, 0.0])
        r[0] += 1
        r[1] += float(e.cpu_time_total)
        if on_cuda:
            r[2] += float(getattr(e, "device_time_total", 0.0))
    return {k: tuple(v) for k, v in out.items()}


# ------------------------------------------------------------------------------------------- output
def format_result(res: BenchResult, fmt: str = "table", top: int = 25) -> str:
    import json
    d = res.to_dict()
    if fmt == "json":
        return json.dumps(d, indent=1)
    from tabulate import tabulate
    tf = "github" if fmt == "markdown" else "simple"
    u = res.unit
    lines = []
    head = (f"model    {res.model} ({res.size}, {res.dtype}) on {res.gpu}; workload {res.workload}, batch {res.batch}, "
            f"seq {res.seq_len}" + (f", {res.new_tokens} new tokens" if res.workload == "decode" else "")
            + f"; {res.steps} timed {u}s (median)")
    lines.append(head)
    if not res.meaningful:
        lines.append("timings  meaningless (CPU interpreter): this run checks that the workload runs and agrees")
    a, g = d["aten_ms_median"], d["gems_ms_median"]
    lines.append(f"ATen     {a:.3f} ms/{u}  {d['aten_tokens_per_s']} tokens/s"
                 + (f"  peak {res.aten_peak_mib} MiB" if res.aten_peak_mib is not None else ""))
    lines.append(f"Gems     {g:.3f} ms/{u}  {d['gems_tokens_per_s']} tokens/s"
                 + (f"  peak {res.gems_peak_mib} MiB" if res.gems_peak_mib is not None else ""))
    lines.append(f"ratio    {d['throughput_ratio']} (Gems throughput / ATen's)")
    for c in res.agreement:
        lines.append(f"agree    {'yes' if c['ok'] else 'NO'}: {c['check']}: {c['detail']}")
    if res.no_plan:
        lines.append("full path (no call plan): " + "; ".join(f"{k}: {', '.join(v)}" for k, v in res.no_plan.items()))
    if res.ops:
        t = d["totals"]
        lines.append(f"profiled step: host {t['aten_host_ms']:.2f} -> {t['gems_host_ms']:.2f} ms, "
                     f"device {t['aten_device_ms']:.2f} -> {t['gems_device_ms']:.2f} ms (outermost ATen ops)")
        rows = []
        for o in res.ops[:top]:
            rows.append([o.op, o.aten_calls, o.gems_calls, _per(o.aten_host_us, o.aten_calls),
                         _per(o.gems_host_us, o.gems_calls), _per(o.aten_device_us, o.aten_calls),
                         _per(o.gems_device_us, o.gems_calls), f"{o.delta_host_ms:+.3f}", f"{o.delta_device_ms:+.3f}",
                         f"{o.served}/{o.fallback}" if (o.served or o.fallback) else "-"])
        lines.append("")
        lines.append(tabulate(rows, headers=["op", "calls A", "calls G", "host us/call A", "host us/call G",
                                             "dev us/call A", "dev us/call G", "Δhost ms", "Δdev ms",
                                             "served/fell back"], tablefmt=tf, floatfmt=".1f"))
    return "\n".join(lines) + "\n"


def _per(total, calls):
    return round(total / calls, 1) if calls else "-"
