"""gems.fused norms (rms_norm, add_rms_norm, layer_norm, add_layer_norm) against their PyTorch
references run in float64, forward and backward (every gradient), with per-dtype tolerances: fp32
1e-5 relative; fp16/bf16 by the flash-attention rule (error vs the fp64 reference within 2x the
error of the reference computed at the low precision, plus a small atol; harness.assert_close)."""
import os
import subprocess
import sys

import pytest
import torch

import gems.fused as F
from gems.fused import norms
from harness import DEVICE, ON_GPU, assert_close, dtype_params, make, to_ref

OURS = dict(rms_norm=F.rms_norm, add_rms_norm=F.add_rms_norm, layer_norm=F.layer_norm,
            add_layer_norm=F.add_layer_norm)
REFS = dict(rms_norm=norms.reference_rms_norm, add_rms_norm=norms.reference_add_rms_norm,
            layer_norm=norms.reference_layer_norm, add_layer_norm=norms.reference_add_layer_norm)

# hidden sizes: odd, non-power-of-2, wider than the interpreter's max_n (128: the looping path)
CPU_SHAPES = [(1, 37), (3, 5, 64), (7, 300), (2, 3, 100)]
GPU_SHAPES = [(1, 4096), (5, 4096), (3, 11008), (4, 5120), (2, 7, 768), (3, 20000), (1000, 256)]
SHAPES = CPU_SHAPES + (GPU_SHAPES if ON_GPU else [])
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def _run(ops, body, inputs, grad_seed):
    """body(ops, *leaves) -> tensor or tuple; inputs: [(tensor or None, requires_grad)]. Returns
    (outputs, grads of the leaves that require grad) for sum(out_i * g_i) with seeded random g_i."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(rg) for t, rg in inputs]
    out = body(ops, *leaves)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(grad_seed)
    gouts = [torch.empty(o.shape, dtype=torch.float64).uniform_(-1, 1, generator=gen).to(o) for o in outs]
    req = [t for t in leaves if t is not None and t.requires_grad]
    diff = [(o, g) for o, g in zip(outs, gouts) if o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in diff], req, [g for _, g in diff], allow_unused=True) if req else ()
    # an input the outputs do not depend on: None from autograd, zeros from a fused backward; compare as zeros
    grads = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(req, grads))
    return outs, grads


def check(body, inputs, dtype, *, ref_body=None, grad=True):
    """Ours vs the reference in float64 (outputs and gradients), dtypes equal to the reference's."""
    if not grad:
        inputs = [(t, False) for t, _ in inputs]
    ref_body = ref_body or body
    got_o, got_g = _run(OURS, body, inputs, 1)
    ref_o, ref_g = _run(REFS, ref_body, [(to_ref(t) if t is not None else None, rg) for t, rg in inputs], 1)
    low_o, low_g = _run(REFS, ref_body, inputs, 1)
    for g, lo in zip(got_o + got_g, low_o + low_g):
        assert g.dtype == lo.dtype, f"result dtype {g.dtype}, the reference gives {lo.dtype}"
        assert g.device == lo.device
    kw = FP32_TOL if dtype == torch.float32 else {}
    low = None if dtype == torch.float32 else (low_o, low_g)
    assert_close((got_o, got_g), (ref_o, ref_g), dtype, low, msg="outputs, grads", **kw)
    return got_o, got_g


def _w(n, dtype, offset=0.0):
    # weights around 1 (or around 0 for Gemma's 1 + w), never zero
    return make((n,), dtype, low=0.5, high=1.5) - offset


CASTINGS = [("llama", 0.0), ("gemma", 1.0), ("llama", 0.5)]


@dtype_params()
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("casting,offset", CASTINGS, ids=lambda v: str(v))
def test_rms_norm(dtype, shape, casting, offset):
    x, w = make(shape, dtype), _w(shape[-1], dtype, offset)
    check(lambda o, x, w: o["rms_norm"](x, w, 1e-6, offset=offset, casting=casting), [(x, True), (w, True)], dtype)


@dtype_params()
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("casting,offset", CASTINGS[:2], ids=lambda v: str(v))
def test_add_rms_norm(dtype, shape, casting, offset):
    x, r, w = make(shape, dtype), make(shape, dtype), _w(shape[-1], dtype, offset)
    y, s = check(lambda o, x, r, w: o["add_rms_norm"](x, r, w, 1e-5, offset=offset, casting=casting),
                 [(x, True), (r, True), (w, True)], dtype)[0]
    # the new residual is exactly residual + x at the input dtype (what HF's decoder layer computes)
    assert torch.equal(s, r + x)


@pytest.mark.parametrize("xd,wd", [(torch.float16, torch.float32), (torch.float32, torch.float16)]
                         + ([(torch.bfloat16, torch.float32)] if ON_GPU else []), ids=str)
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_rms_norm_mixed_dtypes(xd, wd, casting):
    """llama: HF's `weight * h.to(input_dtype)` gives the promoted dtype; gemma: x's dtype."""
    x, w = make((3, 37), xd), _w(37, wd)
    # tolerance by the lower precision: h (llama) or the result (gemma) is rounded to x's dtype,
    # the weight gradient to w's
    (y,), _ = check(lambda o, x, w: o["rms_norm"](x, w, casting=casting), [(x, True), (w, True)],
                    xd if xd != torch.float32 else wd)
    assert y.dtype == (torch.promote_types(xd, wd) if casting == "llama" else xd)


@dtype_params()
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
def test_layer_norm(dtype, shape, affine):
    n = shape[-1]
    x = make(shape, dtype)
    w = _w(n, dtype) if affine != "none" else None
    b = make((n,), dtype, low=-0.5, high=0.5) if affine == "wb" else None
    check(lambda o, x, w, b: o["layer_norm"](x, w, b, 1e-5), [(x, True), (w, True), (b, True)], dtype)


@pytest.mark.parametrize("affine", ["wb", "none"])
def test_layer_norm_under_gems_enable_is_native_on_gems_kernels(affine):
    """With native_layer_norm served, a plain layer_norm is F.layer_norm (C++ autograd node) and both of
    its ops run Gems' kernels: the values still match the fp64 reference, forward and backward."""
    import gems
    x = make((3, 5, 300), torch.float32)
    w, b = (_w(300, torch.float32), make((300,), torch.float32, low=-0.5, high=0.5)) if affine == "wb" else (None, None)
    gems.reset_stats()
    with gems.use_gems(include=list(norms._NATIVE_LN)):
        assert norms._native_ln_served()
        y = F.layer_norm(x.clone().requires_grad_(), w, b, 1e-5)
        assert type(y.grad_fn).__name__ == "NativeLayerNormBackward0"
        check(lambda o, x, w, b: o["layer_norm"](x, w, b, 1e-5), [(x, True), (w, True), (b, True)], torch.float32)
    st = gems.stats()
    for name in norms._NATIVE_LN:
        assert st[name]["served"] >= 1 and st[name]["fallback"] == 0, st.get(name)
    with gems.use_gems(include=["native_layer_norm.default"]):     # the backward not served: the Function
        assert not norms._native_ln_served()
        assert type(F.layer_norm(x.clone().requires_grad_(), w, b).grad_fn).__name__ != "NativeLayerNormBackward0"
    assert not norms._native_ln_served()


@dtype_params()
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_layer_norm(dtype, shape):
    n = shape[-1]
    x, r = make(shape, dtype), make(shape, dtype)
    w, b = _w(n, dtype), make((n,), dtype, low=-0.5, high=0.5)
    y, s = check(lambda o, x, r, w, b: o["add_layer_norm"](x, r, w, b, 1e-12),
                 [(x, True), (r, True), (w, True), (b, True)], dtype)[0]
    assert torch.equal(s, x + r)


# ---- layouts: rows with a stride (read in place), views that need a copy, non-contiguous grads
LAYOUTS = {
    # the first N columns of a wider tensor: row stride 2N, contiguous last dim (no copy)
    "row-strided": (lambda s: s[:-1] + (2 * s[-1],), lambda t, n: t[..., :n]),
    # every second batch of a 3-D tensor: leading dims cannot be merged into rows by a view (a copy)
    "batch-step": (lambda s: (2 * s[0],) + s[1:], lambda t, n: t[::2]),
    # a transposed tensor: the last dim is not contiguous (a copy)
    "transposed": (lambda s: s[:-2] + (s[-1], s[-2]), lambda t, n: t.transpose(-1, -2)),
}


@dtype_params()
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm"])
def test_layouts(dtype, layout, op):
    shape = (3, 4, 37)
    big_shape, view = LAYOUTS[layout]
    n = shape[-1]
    src_shape = big_shape(shape)
    x, r = make(src_shape, dtype), make(src_shape, dtype)
    w, b = _w(n, dtype), make((n,), dtype, low=-0.5, high=0.5)

    def body(o, x, r, w, b):
        xv, rv = view(x, n), view(r, n)
        assert xv.shape == shape
        if op == "rms_norm":
            out = o[op](xv, w)
        elif op == "add_rms_norm":
            out = o[op](xv, rv, w)
        elif op == "layer_norm":
            out = o[op](xv, w, b)
        else:
            out = o[op](xv, rv, w, b)
        # a non-contiguous gradient flows back: the loss sees the outputs transposed
        return tuple(t.transpose(0, 1) for t in (out if isinstance(out, tuple) else (out,)))
    check(body, [(x, True), (r, True), (w, True), (b, True)], dtype)


def test_layouts_read_in_place(monkeypatch):
    """Row-strided inputs (a slice of a wider tensor) reach the kernel without a copy."""
    seen = []
    real = norms.rms_fwd

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((args[0].data_ptr(), args[8]))
                return real[grid](*args, **kw)
            return launch
    monkeypatch.setattr(norms, "rms_fwd", Spy())
    big = make((4, 74), torch.float32)
    x = big[:, :37]
    F.rms_norm(x, _w(37, torch.float32))
    assert seen == [(big.data_ptr(), 74)]


# ---- gradients autograd needs only partly, outputs used only partly
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("need", ["x", "w", "r", "xr", "rw"])
@pytest.mark.parametrize("op", ["add_rms_norm", "add_layer_norm"])
def test_partial_grads(dtype, need, op):
    shape, n = (7, 300), 300
    x, r, w, b = make(shape, dtype), make(shape, dtype), _w(n, dtype), make((n,), dtype, low=-0.5, high=0.5)
    ins = [(x, "x" in need), (r, "r" in need), (w, "w" in need)]
    if op == "add_rms_norm":
        check(lambda o, x, r, w: o[op](x, r, w), ins, dtype)
    else:
        check(lambda o, x, r, w, b: o[op](x, r, w, b), ins + [(b, "w" in need)], dtype)


@pytest.mark.parametrize("use", ["normed", "residual"])
@pytest.mark.parametrize("op", ["add_rms_norm", "add_layer_norm"])
def test_one_output_used(use, op):
    dtype, shape, n = torch.float32, (5, 37), 37
    x, r, w, b = make(shape, dtype), make(shape, dtype), _w(n, dtype), make((n,), dtype)
    i = 0 if use == "normed" else 1
    if op == "add_rms_norm":
        check(lambda o, x, r, w: o[op](x, r, w)[i], [(x, True), (r, True), (w, True)], dtype)
    else:
        check(lambda o, x, r, w, b: o[op](x, r, w, b)[i], [(x, True), (r, True), (w, True), (b, True)], dtype)


def test_grad_of_shared_input():
    """add_rms_norm(x, x, w): both gradients land in x (ATen's add returns one tensor for both)."""
    x, w = make((4, 37), torch.float32), _w(37, torch.float32)
    check(lambda o, x, w: o["add_rms_norm"](x, x, w), [(x, True), (w, True)], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 300)], ids=str)
def test_forward_without_graph(dtype, shape):
    """Inputs that need no gradient launch without the autograd.Function: same results."""
    n = shape[-1]
    x, r, w, b = make(shape, dtype), make(shape, dtype), _w(n, dtype), make((n,), dtype)
    ins = [(x, False), (r, False), (w, False), (b, False)]
    got = check(lambda o, x, r, w, b: (o["rms_norm"](x, w, offset=0.5),) + o["add_rms_norm"](x, r, w, casting="gemma")
                + (o["layer_norm"](x, w, b),) + o["add_layer_norm"](x, r, w, b), ins, dtype)[0]
    assert not any(t.requires_grad for t in got)


def test_sum_backward():
    """y.sum().backward(): the incoming gradient is an expanded (stride 0) tensor."""
    x, r, w, b = make((4, 37), torch.float32), make((4, 37), torch.float32), _w(37, torch.float32), make((37,))
    check(lambda o, x, r, w: o["add_rms_norm"](x, r, w)[0].sum() + o["rms_norm"](x, w).sum(),
          [(x, True), (r, True), (w, True)], torch.float32)
    check(lambda o, x, w, b: o["layer_norm"](x, w, b).sum(), [(x, True), (w, True), (b, True)], torch.float32)


def test_no_grad_and_empty():
    x, w = make((3, 37), torch.float32), _w(37, torch.float32)
    with torch.no_grad():
        y = F.rms_norm(x, w)
    assert not y.requires_grad
    assert_close(y, norms.reference_rms_norm(to_ref(x), to_ref(w)), torch.float32)
    e = torch.empty((0, 37), device=DEVICE, requires_grad=True)
    wg = w.clone().requires_grad_()
    y = F.rms_norm(e, wg)
    assert y.shape == (0, 37)
    y.sum().backward()
    assert e.grad.shape == (0, 37) and torch.equal(wg.grad, torch.zeros_like(w))


def test_deterministic_weight_grad():
    """dw from per-program partial sums + a fixed-order column sum: identical bits run to run."""
    m, n = (4096, 4096) if ON_GPU else (24, 100)
    x, w = make((m, n), torch.float32), _w(n, torch.float32)
    g = make((m, n), torch.float32)
    res = []
    for _ in range(2):
        wl = w.clone().requires_grad_()
        F.rms_norm(x, wl).backward(g)
        res.append(wl.grad)
    assert torch.equal(res[0], res[1])


# ---- fallbacks and errors
def test_float64_runs_reference():
    x, w = make((3, 37), torch.float64, requires_grad=True), _w(37, torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: F.rms_norm(x, w), (x, w))
    assert torch.equal(F.layer_norm(x, w, None), norms.reference_layer_norm(x, w, None))


def test_meta_device_runs_reference():
    x = torch.empty((2, 3, 64), device="meta", dtype=torch.bfloat16)
    w = torch.empty((64,), device="meta", dtype=torch.bfloat16)
    y, s = F.add_rms_norm(x, x, w)
    assert y.shape == x.shape and y.device.type == "meta" and s.dtype == torch.bfloat16


def test_errors():
    x, w = make((3, 37), torch.float32), _w(37, torch.float32)
    with pytest.raises(ValueError, match="weight shape"):
        F.rms_norm(x, _w(36, torch.float32))
    with pytest.raises(ValueError, match="residual shape"):
        F.add_rms_norm(x, make((3, 36), torch.float32), w)
    with pytest.raises(ValueError, match="residual dtype"):
        F.add_rms_norm(x, x.half(), w)
    with pytest.raises(ValueError, match="casting"):
        F.rms_norm(x, w, casting="t5")
    with pytest.raises(ValueError, match="floating-point"):
        F.rms_norm(torch.ones((3, 37), dtype=torch.int32, device=DEVICE), w)
    with pytest.raises(ValueError, match="bias shape"):
        F.layer_norm(x, w, _w(5, torch.float32))
    with pytest.raises(ValueError, match="empty"):
        F.rms_norm(torch.ones((3, 0), device=DEVICE), torch.ones((0,), device=DEVICE))


def test_check_can_fail():
    """The comparison above catches a wrong answer (a different offset, a different eps)."""
    x, w = make((3, 37), torch.float32), _w(37, torch.float32)
    with pytest.raises(AssertionError):
        check(lambda o, x, w: o["rms_norm"](x, w, offset=0.01), [(x, True), (w, True)], torch.float32,
              ref_body=lambda o, x, w: o["rms_norm"](x, w))
    x16, w16 = x.half(), w.half()
    with pytest.raises(AssertionError):
        check(lambda o, x, w: o["layer_norm"](x, w, None, 1e-2), [(x16, True), (w16, True)], torch.float16,
              ref_body=lambda o, x, w: o["layer_norm"](x, w, None, 1e-5))


def test_benchmark_smoke(tmp_path):
    """benchmarks.fused_norms runs end to end on tiny shapes (CPU interpreter or the GPU)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "b.json"
    dev = "cuda" if ON_GPU else "cpu"
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "benchmarks.fused_norms", "--smoke", "--device", dev, "-o", str(out)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert out.exists() and "rms_norm" in r.stdout
