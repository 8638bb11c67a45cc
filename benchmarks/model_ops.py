"""The ops the models call beyond the core set, at the shapes the models call them: ATen vs Gems
side by side in one process, with the same table as `benchmarks.run`.

    python -m benchmarks.model_ops                 # every case (GPU)
    python -m benchmarks.model_ops --only sort     # cases whose name contains 'sort'
    python -m benchmarks.model_ops --only sort,cat # ... 'sort' or 'cat'

Shapes: Llama-2-7B (hidden 4096, 32 heads x 128, vocab 32000, prefill 2048, decode batch 16 for the
sampling ops), BERT-base (32 x 128 x 768), Llava-1.5 (CLIP ViT-L/14-336 patch embedding, 576 image
tokens merged into 600 text tokens). Each case is `setup(device, dtype, small) -> fn`; `small` gives
tiny shapes for the CPU smoke test (tests/benchmarks/test_model_ops_cases.py), which runs every case
with Gems on under the interpreter and checks it is served. Bytes are what must move: each input read
once, each output written once.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

import gems

CASES = []   # (name, setup, bytes(dtype size) or None, deterministic)


def case(name, nbytes=None, deterministic=True):
    def deco(setup):
        CASES.append((name, setup, nbytes, deterministic))
        return setup
    return deco


def first(x):
    """The first output of an op that returns several (sort, topk, native_dropout)."""
    return x[0] if isinstance(x, (tuple, list)) else x


def _r(shape, dev, dt):
    return torch.randn(shape, device=dev, dtype=dt)


# --------------------------------------------------------------------------------- training / prefill
@case("cat: KV-cache append [1,32,2048,128] + [1,32,1,128]", lambda e: 2 * 2 * 32 * 2049 * 128 * e)
def _(dev, dt, small):
    s = (1, 4, 9, 8) if small else (1, 32, 2048, 128)
    past, new = _r(s, dev, dt), _r(s[:2] + (1,) + s[3:], dev, dt)
    return lambda: torch.cat([past, new], dim=2)


@case("clone of a transposed [4,32,1024,128] (attention output)", lambda e: 2 * 4 * 32 * 1024 * 128 * e)
def _(dev, dt, small):
    x = _r((2, 3, 5, 8) if small else (4, 1024, 32, 128), dev, dt).transpose(1, 2)
    return lambda: x.clone(memory_format=torch.contiguous_format)


@case("nll_loss forward, log-probs [8192,32000] fp32", lambda e: 8192 * 8)
def _(dev, dt, small):
    n, c = (7, 33) if small else (8192, 32000)
    lp = torch.log_softmax(_r((n, c), dev, torch.float32), -1)
    t = torch.randint(0, c, (n,), device=dev)
    return lambda: F.nll_loss(lp, t)


@case("nll_loss backward, [8192,32000] fp32", lambda e: 8192 * 32000 * 4)
def _(dev, dt, small):
    n, c = (7, 33) if small else (8192, 32000)
    lp = torch.log_softmax(_r((n, c), dev, torch.float32), -1)
    t = torch.randint(0, c, (n,), device=dev)
    g = torch.ones((), device=dev)
    tw = torch.tensor(float(n), device=dev)
    return lambda: torch.ops.aten.nll_loss_backward(g, lp, t, None, 1, -100, tw)


@case("slice_backward: rotate_half grad [1,32,2048,64] -> [..,128]", lambda e: (1 + 2) * 32 * 2048 * 64 * e)
def _(dev, dt, small):
    s = (1, 4, 9, 8) if small else (1, 32, 2048, 128)
    g = _r(s[:3] + (s[3] // 2,), dev, dt)
    return lambda: torch.ops.aten.slice_backward(g, list(s), 3, s[3] // 2, s[3], 1)


@case("constant_pad_nd: [32,128,767] -> 768", lambda e: 2 * 32 * 128 * 768 * e)
def _(dev, dt, small):
    x = _r((3, 5, 7) if small else (32, 128, 767), dev, dt)
    return lambda: F.pad(x, (0, 1), value=0.5)


@case("dropout p=0.1 (BERT) [32,128,768]", lambda e: 2 * 32 * 128 * 768 * e + 32 * 128 * 768,
      deterministic=False)
def _(dev, dt, small):
    x = _r((3, 5, 7) if small else (32, 128, 768), dev, dt)
    return lambda: torch.ops.aten.native_dropout(x, 0.1, True)


@case("_is_all_true of an attention mask [16,2048] bool", lambda e: 16 * 2048)
def _(dev, dt, small):
    m = torch.ones((3, 9) if small else (16, 2048), device=dev, dtype=torch.bool)
    return lambda: torch.ops.aten._is_all_true(m)


@case("tril of the causal mask ones(2048,2048) bool", lambda e: 2 * 2048 * 2048)
def _(dev, dt, small):
    m = torch.ones((9, 9) if small else (2048, 2048), device=dev, dtype=torch.bool)
    return lambda: m.tril()


@case("_safe_softmax [1,32,2048,2048] with masked rows", lambda e: 2 * 32 * 2048 * 2048 * e)
def _(dev, dt, small):
    x = _r((1, 2, 9, 9) if small else (1, 32, 2048, 2048), dev, dt)
    x[..., 0, :] = float("-inf")
    return lambda: torch.ops.aten._safe_softmax(x, -1)


@case("masked_scatter: Llava image features [576,4096] into [1,1176,4096]",
      lambda e: (2 * 1176 + 576) * 4096 * e + 1176)
def _(dev, dt, small):
    s, n_img, h = (11, 4, 8) if small else (1176, 576, 4096)
    emb = _r((1, s, h), dev, dt)
    mask = torch.zeros((1, s, 1), device=dev, dtype=torch.bool)
    mask[0, 3:3 + n_img] = True
    src = _r((n_img, h), dev, dt)
    return lambda: emb.masked_scatter(mask.expand_as(emb), src)


@case("convolution: CLIP patch embedding [1,3,336,336] * [1024,3,14,14] /14", lambda e: None)
def _(dev, dt, small):
    x = _r((2, 3, 28, 28) if small else (1, 3, 336, 336), dev, dt)
    w = _r((16, 3, 14, 14) if small else (1024, 3, 14, 14), dev, dt)
    return lambda: F.conv2d(x, w, stride=14)


@case("convolution_backward: CLIP patch embedding, grad of the weight", lambda e: None)
def _(dev, dt, small):
    x = _r((2, 3, 28, 28) if small else (8, 3, 336, 336), dev, dt)
    w = _r((16, 3, 14, 14) if small else (1024, 3, 14, 14), dev, dt)
    g = _r((2, 16, 2, 2) if small else (8, 1024, 24, 24), dev, dt)
    return lambda: torch.ops.aten.convolution_backward(g, x, w, None, [14, 14], [0, 0], [1, 1], False, [0, 0], 1,
                                                       [False, True, False])[1]


# ------------------------------------------------------------------------------- generate (sampling)
def _logits(dev, small):
    return _r((3, 37) if small else (16, 32000), dev, torch.float32)


@case("argmax: greedy token of logits [16,32000] fp32", lambda e: 16 * 32000 * 4)
def _(dev, dt, small):
    x = _logits(dev, small)
    return lambda: x.argmax(-1)


@case("topk k=50 of logits [16,32000] fp32 (TopKLogitsWarper)", lambda e: 16 * 32000 * 4)
def _(dev, dt, small):
    x = _logits(dev, small)
    return lambda: torch.topk(x, 5 if small else 50)[0]


@case("sort of logits [16,32000] fp32 (TopPLogitsWarper)", lambda e: 16 * 32000 * (4 + 4 + 8))
def _(dev, dt, small):
    x = _logits(dev, small)
    return lambda: torch.sort(x, descending=False)[0]


@case("cumsum of probabilities [16,32000] fp32", lambda e: 2 * 16 * 32000 * 4)
def _(dev, dt, small):
    p = torch.softmax(_logits(dev, small), -1)
    return lambda: p.cumsum(-1)


@case("scatter back to vocab order [16,32000] bool (top-p)", lambda e: 16 * 32000 * (1 + 8 + 1))
def _(dev, dt, small):
    x = _logits(dev, small)
    idx = torch.argsort(x, -1)
    remove = torch.rand(x.shape, device=dev) < 0.5
    return lambda: remove.scatter(1, idx, remove)


@case("gather of sorted logits [16,32000] fp32", lambda e: 16 * 32000 * (4 + 8 + 4))
def _(dev, dt, small):
    x = _logits(dev, small)
    idx = torch.argsort(x, -1)
    return lambda: torch.gather(x, 1, idx)


@case("multinomial 1 sample of probs [16,32000] fp32", lambda e: 16 * 32000 * 4, deterministic=False)
def _(dev, dt, small):
    p = torch.softmax(_logits(dev, small), -1)
    return lambda: torch.multinomial(p, 1)


@case("stack of 64 generated tokens, 64 x [16] int64", lambda e: 2 * 64 * 16 * 8)
def _(dev, dt, small):
    toks = [torch.randint(0, 32000, (16,), device=dev) for _ in range(64)]
    return lambda: torch.stack(toks, dim=1)


# ----------------------------------------------------------------------------------------- optimizer
@case("AdamW(foreach) step, 201 params of TinyLlama-1.1B-like shapes", lambda e: None, deterministic=False)
def _(dev, dt, small):
    # TinyLlama: hidden 2048, MLP 5632, 4 KV heads of 64; 22 layers of 9 tensors + embeddings and norm
    h, f, kv = (8, 12, 4) if small else (2048, 5632, 256)
    layers = 2 if small else 22
    shapes = [(32 if small else 32000, h)]
    for _ in range(layers):
        shapes += [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    shapes += [(h,), (32 if small else 32000, h)]
    params = [torch.nn.Parameter(_r(s, dev, torch.float32)) for s in shapes]
    for p in params:
        p.grad = _r(p.shape, dev, torch.float32)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
    opt.step()   # state created outside the timed call

    def step():
        opt.step()
        return params[1]
    return step


def main(argv=None):
    from benchmarks import run
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "model_ops.json"))
    args = ap.parse_args(argv)
    env = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "gems": gems.__version__}
    rows = []
    wanted = [w for w in args.only.split(",") if w]
    for name, setup, nbytes, deterministic in CASES:
        if wanted and not any(w in name for w in wanted):
            continue
        r = {"case": name, "target": 1.0}
        try:
            torch.manual_seed(0)
            r.update(run.measure(setup("cuda", torch.bfloat16, False), deterministic))
            b = nbytes(2) if nbytes else None
            if b:
                r["aten_GBps"], r["gems_GBps"] = b / r["aten_ms"] / 1e6, b / r["gems_ms"] / 1e6
        except Exception as e:  # one broken case must not hide the others
            gems.disable()
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.empty_cache()
        rows.append(r)
        print(json.dumps(r), flush=True)
    with open(args.json, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    run.print_table(env, rows)


if __name__ == "__main__":
    sys.exit(main())
