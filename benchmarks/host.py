"""Per-call host cost of Gems vs ATen on the calls real models make (decode-sized tensors).

    python -m benchmarks.host [--device cuda] [--calls 3000] [--rounds 5] [--only SUBSTR] [--json FILE]

Each case is one call as a Llama-2-7B / BERT decode or training step makes it: size-1 dims,
broadcasts, transposed views, Python numbers, CPU 0-dim tensors, mixed dtypes, in-place and `out=`,
reductions with keepdim, small softmax / layer_norm, GEMMs with transposed weights, backward ops.
Per case and mode: `--calls` calls in a Python loop, one synchronize, divided by the calls (the GPU
keeps up with tiny kernels, so this is the host path); ATen and Gems alternate for `--rounds`
rounds and the median per mode is reported. Every case is warmed in both modes first (compilation,
call plans), and `gems.stats()` says whether Gems served the case's ops or fell back: a row that fell
back is flagged, never counted as fast. On the CPU (Triton interpreter) the times are meaningless;
the cases still run (CI checks they work and agree with ATen).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# (name, setup(dev, dt, small) -> args tuple, call(*args)); small=True shrinks dims for the interpreter
H, FF, V = 4096, 11008, 32000


def _dims(small):
    return (256, 512, 512) if small else (H, FF, V)


def _r(*shape, dev, dt, low=None):
    t = torch.randn(*shape, device=dev, dtype=torch.float32)
    if low is not None:
        t = t.abs() + low
    return t.to(dt)


CASES = [
    ("x.to(float32) [1,1,H]", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t),), lambda x: x.to(torch.float32)),
    ("xf.to(bf16) [1,1,H]", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=torch.float32),),
     lambda x: x.to(torch.float16 if x.device.type == "cpu" else torch.bfloat16)),
    ("xf.pow(2) fp32 [1,1,H]", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=torch.float32),), lambda x: x.pow(2)),
    ("xf.mean(-1, keepdim) fp32", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=torch.float32),),
     lambda x: x.mean(-1, keepdim=True)),
    ("var + 1e-6 fp32 [1,1,1]", lambda d, t, s: (_r(1, 1, 1, dev=d, dt=torch.float32),), lambda v: v + 1e-6),
    ("rsqrt(var) [1,1,1]", lambda d, t, s: (_r(1, 1, 1, dev=d, dt=torch.float32, low=0.5),), torch.rsqrt),
    ("xf * var [1,1,H]*[1,1,1]", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=torch.float32),
                                                  _r(1, 1, 1, dev=d, dt=torch.float32)), lambda a, b: a * b),
    ("w * x [H]*[1,1,H]", lambda d, t, s: (_r(_dims(s)[0], dev=d, dt=t), _r(1, 1, _dims(s)[0], dev=d, dt=t)),
     lambda a, b: a * b),
    ("q * cos (transposed q)", lambda d, t, s: (_r(1, 1, 32, 128, dev=d, dt=t).transpose(1, 2),
                                                _r(1, 1, 1, 128, dev=d, dt=t)), lambda q, c: q * c),
    ("-q[..., 64:]", lambda d, t, s: (_r(1, 32, 1, 128, dev=d, dt=t),), lambda q: -q[..., 64:]),
    ("cat(-q2, q1) rotate_half", lambda d, t, s: (_r(1, 32, 1, 128, dev=d, dt=t),),
     lambda q: torch.cat((-q[..., 64:], q[..., :64]), -1)),
    ("cat KV cache [1,32,S,128]+[1,32,1,128]", lambda d, t, s: (_r(1, 32, 128, 128, dev=d, dt=t),
                                                              _r(1, 32, 1, 128, dev=d, dt=t)),
     lambda past, new: torch.cat([past, new], -2)),
    ("x.clone() [1,1,H]", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t),), lambda x: x.clone()),
    ("silu(h) [1,1,FF]", lambda d, t, s: (_r(1, 1, _dims(s)[1], dev=d, dt=t),), F.silu),
    ("silu(g) * u", lambda d, t, s: (_r(1, 1, _dims(s)[1], dev=d, dt=t), _r(1, 1, _dims(s)[1], dev=d, dt=t)),
     lambda g, u: F.silu(g) * u),
    ("x + x", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t),), lambda x: x + x),
    ("x + 1 (int)", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t),), lambda x: x + 1),
    ("x * 2.0 (float)", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t),), lambda x: x * 2.0),
    ("x * cpu 0-dim tensor", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t), torch.tensor(0.5)),
     lambda x, c: x * c),
    ("x + y fp32 (promotion)", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t),
                                                _r(1, 1, _dims(s)[0], dev=d, dt=torch.float32)), lambda a, b: a + b),
    ("x.add_(y) in-place", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t), _r(1, 1, _dims(s)[0], dev=d, dt=t)),
     lambda a, b: a.add_(b).mul_(0.5)),
    ("x.mul_(0.5) in-place", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t),), lambda a: a.mul_(0.5)),
    ("add(x, y, out=o)", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t), _r(1, 1, _dims(s)[0], dev=d, dt=t),
                                          _r(1, 1, _dims(s)[0], dev=d, dt=t)), lambda a, b, o: torch.add(a, b, out=o)),
    ("softmax fp32 [1,32,1,129]", lambda d, t, s: (_r(1, 32, 1, 129, dev=d, dt=torch.float32),),
     lambda x: torch.softmax(x, -1)),
    ("layer_norm [1,1,768]", lambda d, t, s: (_r(1, 1, 768, dev=d, dt=t), _r(768, dev=d, dt=t), _r(768, dev=d, dt=t)),
     lambda x, w, b: F.layer_norm(x, (768,), w, b)),
    ("sum(x, -1)", lambda d, t, s: (_r(1, 8, _dims(s)[0], dev=d, dt=t),), lambda x: torch.sum(x, -1)),
    ("amax(x, -1, keepdim)", lambda d, t, s: (_r(1, 8, _dims(s)[0], dev=d, dt=t),),
     lambda x: torch.amax(x, -1, keepdim=True)),
    ("linear(x, W) M=1", lambda d, t, s: (_r(1, 1, _dims(s)[0], dev=d, dt=t), _r(_dims(s)[1], _dims(s)[0], dev=d, dt=t)),
     F.linear),
    ("linear(x, W, b) M=1", lambda d, t, s: (_r(1, _dims(s)[0], dev=d, dt=t), _r(_dims(s)[0], _dims(s)[0], dev=d, dt=t),
                                             _r(_dims(s)[0], dev=d, dt=t)), F.linear),
    ("bmm [32,1,128]x[32,128,129]", lambda d, t, s: (_r(32, 1, 128, dev=d, dt=t), _r(32, 128, 129, dev=d, dt=t)),
     torch.bmm),
    ("x.contiguous() of x.T", lambda d, t, s: (_r(64, 128, dev=d, dt=t).t(),), lambda x: x.contiguous()),
    ("embedding(W, ids[1,1])", lambda d, t, s: (_r(_dims(s)[2], _dims(s)[0], dev=d, dt=t),
                                               torch.randint(0, _dims(s)[2], (1, 1), device=d)),
     lambda w, i: F.embedding(i, w)),
    ("silu_backward [1,8,FF]", lambda d, t, s: (_r(1, 8, _dims(s)[1], dev=d, dt=t), _r(1, 8, _dims(s)[1], dev=d, dt=t)),
     torch.ops.aten.silu_backward),
    ("_softmax_backward_data", lambda d, t, s: (_r(1, 8, 64, 64, dev=d, dt=t), torch.softmax(_r(1, 8, 64, 64, dev=d, dt=t), -1)),
     lambda g, y: torch.ops.aten._softmax_backward_data(g, y, -1, g.dtype)),
    ("native_layer_norm_backward", lambda d, t, s: _ln_bwd_args(d, t),
     lambda g, x, m, r, w, b: torch.ops.aten.native_layer_norm_backward(g, x, [768], m, r, w, b, [True, True, True])),
    ("embedding_dense_backward", lambda d, t, s: (_r(8, _dims(s)[0], dev=d, dt=t),
                                                 torch.randint(0, _dims(s)[2], (8,), device=d), _dims(s)[2]),
     lambda g, i, v: torch.ops.aten.embedding_dense_backward(g, i, v, -1, False)),
    ("mm of transposed grads g.t() @ x", lambda d, t, s: (_r(8, _dims(s)[0], dev=d, dt=t), _r(8, _dims(s)[0], dev=d, dt=t)),
     lambda g, x: g.t() @ x),
    # AdamW(foreach)'s calls over BERT-base's 202 parameters (small tensors: the host path is per tensor);
    # the gradients are new tensors every step (zero_grad(set_to_none=True)): two sets alternate
    ("foreach addcmul_ x202, new grads", lambda d, t, s: _adam_lists(d, t, s),
     lambda e, g1, g2, flip: torch._foreach_addcmul_(e, *((g1, g1) if flip() else (g2, g2)), value=0.001)),
    ("foreach sqrt x202", lambda d, t, s: _adam_lists(d, t, s)[:1], torch._foreach_sqrt),
    ("foreach mul_ x202", lambda d, t, s: _adam_lists(d, t, s)[:1], lambda e: torch._foreach_mul_(e, 0.999)),
    # generate's sampling on one row of logits (fp32: transformers casts them) and BERT's dropout (the models call them)
    ("argmax(logits, -1) [1,V] fp32", lambda d, t, s: (_logits(d, s),), lambda x: x.argmax(-1)),
    ("topk(logits, 50) [1,V] fp32", lambda d, t, s: (_logits(d, s),), lambda x: torch.topk(x, 50)),
    ("sort(logits) [1,V] fp32", lambda d, t, s: (_logits(d, s),), lambda x: torch.sort(x, descending=True)),
    ("cumsum(probs, -1) [1,V] fp32", lambda d, t, s: (_logits(d, s).softmax(-1),), lambda p: p.cumsum(-1)),
    ("gather(logits, 1, order) [1,V]", lambda d, t, s: (_logits(d, s), _logits(d, s).argsort(-1)),
     lambda x, i: x.gather(1, i)),
    ("scatter(mask, 1, order, mask) [1,V]", lambda d, t, s: (_logits(d, s) > 0, _logits(d, s).argsort(-1)),
     lambda m, i: m.scatter(1, i, m)),
    ("multinomial(probs, 1) [1,V] fp32", lambda d, t, s: (_logits(d, s).softmax(-1),), lambda p: torch.multinomial(p, 1)),
    # decode with transformers' DynamicCache: the KV cache grows a token per step, so every step is a new
    # signature for the ops that see its length (cat, SDPA): each call here takes a length not seen for
    # NEW_LENGTHS calls, past both plan caches' bounds (512 signatures), as decode meets them
    ("cat KV cache, a new length every call", lambda d, t, s: _growing(d, t, s),
     lambda kv, x, n: torch.cat([kv[:, :, :n()], x], 2)),
    ("SDPA decode, a new length every call", lambda d, t, s: _growing(d, t, s),
     lambda kv, q, n: F.scaled_dot_product_attention(q, kv[:, :, :n()], kv[:, :, :n.last])),
    ("native_dropout p=0.1 [32,128,768]", lambda d, t, s: (_r(*((2, 4, 16) if s else (32, 128, 768)), dev=d, dt=t),),
     lambda x: torch.ops.aten.native_dropout(x, 0.1, True)),
]


NEW_LENGTHS = 2048


class _Lengths:
    """Calls return 1, 2, ..., NEW_LENGTHS, 1, ...; `last` is the latest."""

    def __init__(self):
        self.last = 0

    def __call__(self):
        self.last = self.last % NEW_LENGTHS + 1
        return self.last


def _growing(dev, dt, small):
    """(a KV cache [1, heads, NEW_LENGTHS, head dim] read as its first n positions, one token's query /
    key [1, heads, 1, head dim], the lengths)."""
    h, d = (2, 16) if small else (32, 128)
    return _r(1, h, NEW_LENGTHS, d, dev=dev, dt=dt), _r(1, h, 1, d, dev=dev, dt=dt), _Lengths()


def _logits(dev, small):
    return _r(1, _dims(small)[2], dev=dev, dt=torch.float32)


def _adam_lists(dev, dt, small):
    """(exp_avg_sq, grads, other grads, a function alternating True/False): 202 tensors (20 on the CPU)."""
    shapes = [(64, 12), (768,)] * (10 if small else 101)
    lists = [[_r(*sh, dev=dev, dt=dt, low=0.1) for sh in shapes] for _ in range(3)]
    state = [False]

    def flip():
        state[0] = not state[0]
        return state[0]
    return (*lists, flip)


def _ln_bwd_args(dev, dt):
    x, w, b = _r(1, 8, 768, dev=dev, dt=dt), _r(768, dev=dev, dt=dt), _r(768, dev=dev, dt=dt)
    _, m, r = torch.ops.aten.native_layer_norm(x, [768], w, b, 1e-5)
    return _r(1, 8, 768, dev=dev, dt=dt), x, m, r, w, b


def _per_call(fn, args, calls, sync):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def run_case(name, setup, fn, device, calls, rounds):
    """{'case', 'aten_us', 'gems_us', 'ratio', 'served', 'fell_back'} for one case."""
    import gems
    small = device == "cpu"
    dt = torch.float32 if small else torch.bfloat16
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    args = setup(device, dt, small)
    with torch.no_grad():
        fn(*args)
        gems.reset_stats()
        with gems.use_gems():
            fn(*args)
            fn(*args)   # the second call records the signature's plan (GEMS_PLAN_AFTER)
        st = gems.stats()
        aten, gem = [], []
        for _ in range(rounds):
            # ATen with Gems unregistered: a registered overload passes through Gems' Python kernel even
            # when Gems is off for the call, which is not what users without Gems pay (call plans
            # survive the unregistration)
            gems.disable()
            aten.append(_per_call(fn, args, calls, sync))
            with gems.use_gems():
                gem.append(_per_call(fn, args, calls, sync))
        gems.disable()
    a, g = statistics.median(aten), statistics.median(gem)
    fell = {op: s["reasons"] for op, s in st.items() if s["fallback"]}
    return {"case": name, "aten_us": a, "gems_us": g, "ratio": g / a, "served": sorted(op for op, s in st.items()
            if s["served"]), "fell_back": fell}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=None, help="calls per timing (default 3000 on cuda, 2 on cpu)")
    p.add_argument("--rounds", type=int, default=None, help="alternating ATen/Gems rounds (default 5; 1 on cpu)")
    p.add_argument("--only", default=None, help="only cases whose name contains this")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    calls = a.calls or (3000 if cuda else 2)
    rounds = a.rounds or (5 if cuda else 1)
    rows = []
    for name, setup, fn in CASES:
        if a.only and a.only not in name:
            continue
        rows.append(run_case(name, setup, fn, a.device, calls, rounds))
        r = rows[-1]
        print(f"  {r['case']:34s} aten {r['aten_us']:8.2f} us  gems {r['gems_us']:8.2f} us  {r['ratio']:5.2f}x"
              + (f"  FELL BACK {r['fell_back']}" if r["fell_back"] else ""), file=sys.stderr, flush=True)
    if not cuda:
        print("device cpu: Triton interpreter, times are meaningless (the cases ran and were served)")
    print(f"{'case':34s} {'ATen us':>8s} {'Gems us':>8s} {'ratio':>6s}  served / fell back")
    for r in rows:
        fb = "; ".join(f"{op}: {', '.join(why)}" for op, why in r["fell_back"].items())
        print(f"{r['case']:34s} {r['aten_us']:8.2f} {r['gems_us']:8.2f} {r['ratio']:6.2f}  "
              f"{','.join(r['served']) or '-'}{'  FELL BACK ' + fb if fb else ''}")
    ok = [r["ratio"] for r in rows if r["ratio"] > 0]
    if ok:
        worst = max(rows, key=lambda r: r["ratio"])
        print(f"geomean ratio {math.exp(sum(map(math.log, ok)) / len(ok)):.3f}; worst {worst['case']} "
              f"{worst['ratio']:.2f}x; rows over 1.1x: {sum(r > 1.1 for r in ok)}, over 1.4x: {sum(r > 1.4 for r in ok)}")
    if a.json:
        info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                "calls": calls, "rounds": rounds, "rows": rows}
        with open(a.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
