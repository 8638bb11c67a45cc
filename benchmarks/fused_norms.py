"""gems.fused norms and gated activations vs ATen's unfused sequence (the Hugging Face module code)
and Liger-Kernel, forward and forward+backward, side by side in one process.

    python -m benchmarks.fused_norms                 # GPU, Llama-2-7B / BERT shapes, bf16
    python -m benchmarks.fused_norms --quick         # fewer cases (no 32768-row norms), shorter runs
    python -m benchmarks.fused_norms -o out.json     # also write JSON
    python -m benchmarks.fused_norms --device cpu    # tiny shapes through the Triton interpreter (smoke)

Per case: median time (`triton.testing.do_bench` on the GPU; a median of a few runs on the CPU) of
ATen (plain eager, Gems not enabled), Gems' fused op (with `gems.enable()` on, as in a model under
`gems.patch` + `gems.enable()`: a plain layer_norm is then ATen's op on Gems' kernels) and Liger's
(`import liger_kernel`: its Function classes with their defaults; the column is skipped, with the
reason printed, only when the import fails), the ratios Gems/ATen and Gems/Liger (lower is better), Gems' GB/s over the bytes that
must move (each input read once and each output written once: forward x, y; backward dy, x, dx;
residual variants add the residual, the new residual and its gradient; weights are negligible), and
Gems' forward error relative to ATen (max |gems - aten| / max |aten|).
Forward+backward times one `torch.autograd.grad` of every output w.r.t. every input after a forward
(no `.grad` accumulation). The loop columns: wall time per call of back-to-back calls synchronized once
(`_loop_us`): where a call is host-bound (decode rows, BERT's sizes) this is the number a model sees;
do_bench's L2 flush before each timed call skews its host-bound rows. The device columns (CUDA):
the kernels' own time per call (profiler sums, `benchmarks.run.device_ms`), which no host cost enters.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch   # triton is imported later, after --device cpu has set TRITON_INTERPRET

from benchmarks.interpreter import use_interpreter_for
from benchmarks.results import write_json
from benchmarks.timing import median_ms


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="fewer, shorter cases")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (implied by --device cpu)")
    p.add_argument("--only", default=None, help="cases whose name contains this")
    p.add_argument("-o", "--output", default=None, help="write results as JSON here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------- unfused ATen code
def _aten_rms(x, w, eps=1e-6):
    """Hugging Face LlamaRMSNorm.forward."""
    dt = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return w * h.to(dt)


def _aten_add_rms(x, r, w, eps=1e-6):
    s = r + x                                  # the decoder layer's residual add
    return _aten_rms(s, w, eps), s


def _aten_silu_mul(g, u):
    return torch.nn.functional.silu(g) * u     # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)


def _aten_gelu_mul(g, u):
    return torch.nn.functional.gelu(g, approximate="tanh") * u


def _aten_ln(x, w, b, eps=1e-12):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)


def _aten_add_ln(x, r, w, b, eps=1e-12):
    s = x + r                                  # BertSelfOutput: LayerNorm(hidden_states + input_tensor)
    return _aten_ln(s, w, b, eps), s


def _liger():
    """{op: callable} from Liger-Kernel, or (None, why)."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as e:  # noqa: BLE001 - any import failure only drops the column
        return None, f"{type(e).__name__}: {e}"
    return {
        # LigerRMSNorm's defaults: offset 0, casting "llama", in_place=True (dX written into dY)
        "rms_norm": lambda x, w, eps=1e-6: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", True),
        "add_rms_norm": lambda x, r, w, eps=1e-6: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama"),
        "silu_and_mul": lambda g, u: LigerSiLUMulFunction.apply(g, u),
        "gelu_and_mul": lambda g, u: LigerGELUMulFunction.apply(g, u),     # tanh approximation
        "layer_norm": lambda x, w, b, eps=1e-12: LigerLayerNormFunction.apply(x, w, b, eps),
    }, None


# ------------------------------------------------------------------------------------------- cases
def _cases(smoke, quick):
    """(name, op, shape, dtype bytes, passes fwd, passes fwd+bwd)."""
    if smoke:
        norm_rows, hid, inter, bert = [(1, "decode")], 96, 160, (8, 48)
        silu_rows = [(5, "")]
    else:
        norm_rows = [(1, "decode"), (4096, "")] + ([] if quick else [(32768, "")])
        hid, inter, bert = 4096, 11008, (32 * 128, 768)
        silu_rows = [(1, "decode"), (16384, "")]
    out = []
    for rows, tag in norm_rows:
        out.append(("rms_norm", (rows, hid), 2, 5, tag))
        out.append(("add_rms_norm", (rows, hid), 4, 8, tag))
    for rows, tag in silu_rows:
        out.append(("silu_and_mul", (rows, inter), 3, 8, tag))
    if not quick or smoke:
        out.append(("gelu_and_mul", (silu_rows[-1][0] // 4 or 1, inter), 3, 8, ""))
    out.append(("layer_norm", bert, 2, 5, ""))
    out.append(("add_layer_norm", bert, 4, 8, ""))
    return out


def _inputs(op, shape, dtype, device, grad):
    def t(shp, scale=1.0, shift=0.0):
        return (torch.randn(shp, device=device, dtype=dtype) * scale + shift).requires_grad_(grad)
    n = shape[-1]
    if op in ("rms_norm",):
        return [t(shape), t((n,), 0.1, 1.0)]
    if op == "add_rms_norm":
        return [t(shape), t(shape), t((n,), 0.1, 1.0)]
    if op in ("silu_and_mul", "gelu_and_mul"):
        return [t(shape), t(shape)]
    if op == "layer_norm":
        return [t(shape), t((n,), 0.1, 1.0), t((n,), 0.1)]
    return [t(shape), t(shape), t((n,), 0.1, 1.0), t((n,), 0.1)]


def _impls(liger):
    import gems.fused as F
    gems_fns = {
        "rms_norm": lambda x, w: F.rms_norm(x, w, 1e-6),
        "add_rms_norm": lambda x, r, w: F.add_rms_norm(x, r, w, 1e-6),
        "silu_and_mul": F.silu_and_mul,
        "gelu_and_mul": lambda g, u: F.gelu_and_mul(g, u, approximate="tanh"),
        "layer_norm": lambda x, w, b: F.layer_norm(x, w, b, 1e-12),
        "add_layer_norm": lambda x, r, w, b: F.add_layer_norm(x, r, w, b, 1e-12),
    }
    aten_fns = {"rms_norm": _aten_rms, "add_rms_norm": _aten_add_rms, "silu_and_mul": _aten_silu_mul,
                "gelu_and_mul": _aten_gelu_mul, "layer_norm": _aten_ln, "add_layer_norm": _aten_add_ln}
    return {"aten": aten_fns, "gems": gems_fns, "liger": liger or {}}


def _step(fn, inputs, grads):
    """forward only (grads None) or forward + one autograd.grad of every output."""
    if grads is None:
        return lambda: fn(*inputs)

    def run():
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(outs, inputs, grads[:len(outs)])
    return run


@contextlib.contextmanager
def _gems_on(on):
    """Gems' column runs as a patched model runs (gems.patch + gems.enable(): the unfused remainder and a
    plain layer_norm on Gems' ATen ops); the others with Gems unregistered (plain ATen)."""
    if not on:
        yield
        return
    import gems
    gems.enable()
    try:
        yield
    finally:
        gems.disable()


def _loop_us(fn, device, quick):
    """Wall time per call of back-to-back calls, synchronized once (what a host-bound model sees).
    do_bench flushes L2 with a 256 MiB fill before each call; when the call is host-bound, that
    fill's device time lets the host run ahead, so its event times understate host time by a
    varying amount. This column has no such offset."""
    from benchmarks.run import host_us    # imports triton: after main() has chosen the backend
    return host_us(fn, 20 if device == "cpu" else (100 if quick else 300), warmup=3,
                   sync=torch.cuda.synchronize if device == "cuda" else (lambda: None))


def _time(fn, device, quick):
    return median_ms(fn, device, warmup=10 if quick else 25, rep=40 if quick else 100,
                     cpu_runs=1 if quick else 3)


def _err(a, b):
    a, b = (a[0] if isinstance(a, tuple) else a), (b[0] if isinstance(b, tuple) else b)
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main(argv=None):
    args = _parse(argv)
    smoke = args.smoke or args.device == "cpu"
    use_interpreter_for(args.device)   # before triton is imported (gems imports it)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: use --device cpu for the interpreter smoke run", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float16   # the interpreter leaves bf16 out
    liger, why = (None, "CPU smoke run (Liger's kernels need a GPU)") if args.device == "cpu" else _liger()
    if liger is None:
        print(f"Liger column skipped: {why}")
    impls = _impls(liger)
    esize = torch.empty((), dtype=dtype).element_size()
    rows = []
    torch.manual_seed(0)
    for op, shape, p_fwd, p_bwd, tag in _cases(smoke, args.quick):
        name = f"{op} {'x'.join(map(str, shape))}" + (f" ({tag})" if tag else "")
        if args.only and args.only not in name:
            continue
        for mode in ("fwd", "fwd+bwd"):
            grad = mode != "fwd"
            inputs = _inputs(op, shape, dtype, args.device, grad)
            grads = ([torch.randn(shape, device=args.device, dtype=dtype) for _ in range(2)] if grad else None)
            row = dict(case=name, op=op, shape=list(shape), dtype=str(dtype).replace("torch.", ""), mode=mode)
            outs, grad_res = {}, {}
            for impl in ("aten", "gems", "liger"):
                fn = impls[impl].get(op)
                if fn is None:
                    row[f"{impl}_ms"] = None
                    continue
                try:
                    with _gems_on(impl == "gems"), torch.no_grad() if not grad else torch.enable_grad():
                        outs[impl] = fn(*inputs)
                        if grad and impl != "liger":    # Liger's rms_norm writes dx into dy: left out
                            o = outs[impl] if isinstance(outs[impl], tuple) else (outs[impl],)
                            grad_res[impl] = torch.autograd.grad(o, inputs, grads[:len(o)])
                        row[f"{impl}_ms"] = _time(_step(fn, inputs, grads), args.device, args.quick or smoke)
                        row[f"{impl}_loop_us"] = _loop_us(_step(fn, inputs, grads), args.device, args.quick or smoke)
                        if args.device == "cuda":
                            from benchmarks.run import device_ms
                            row[f"{impl}_device_us"] = device_ms(_step(fn, inputs, grads)) * 1e3
                except Exception as e:  # noqa: BLE001 - a failing column is reported, not fatal
                    if impl == "gems":
                        raise
                    row[f"{impl}_ms"] = None
                    row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:200]
            a, g, li = row["aten_ms"], row["gems_ms"], row.get("liger_ms")
            row["gems_vs_aten"] = g / a if a else None
            row["gems_vs_liger"] = g / li if li else None
            la, lg = row.get("aten_loop_us"), row.get("gems_loop_us")
            row["gems_vs_aten_loop"] = lg / la if la and lg else None
            da, dg = row.get("aten_device_us"), row.get("gems_device_us")
            row["gems_vs_aten_device"] = dg / da if da and dg else None
            nbytes = (p_fwd if mode == "fwd" else p_bwd) * shape[0] * shape[1] * esize
            row["gems_gbps"] = nbytes / (g * 1e-3) / 1e9 if g else None
            row["err_vs_aten"] = _err(outs["gems"], outs["aten"])
            if grad:   # worst gradient (over the inputs) relative to ATen's
                row["grad_err_vs_aten"] = max(_err(g, a) for g, a in zip(grad_res["gems"], grad_res["aten"]))
            rows.append(row)
            del inputs, grads, outs, grad_res

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    hdr = (f"{'case':34} {'mode':8} {'ATen ms':>9} {'Gems ms':>9} {'Liger ms':>9} {'G/ATen':>7} {'G/Liger':>7} "
           f"{'GB/s':>7} {'err':>8} {'grad err':>8} {'loop us A/G/L':>20} {'G/A loop':>8} {'dev us A/G/L':>16} "
           f"{'G/A dev':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['case']:34} {r['mode']:8} {f(r['aten_ms'], '9.4f')} {f(r['gems_ms'], '9.4f')} "
              f"{f(r.get('liger_ms'), '9.4f')} {f(r['gems_vs_aten'], '7.2f')} {f(r['gems_vs_liger'], '7.2f')} "
              f"{f(r['gems_gbps'], '7.0f')} {f(r['err_vs_aten'], '8.1e')} {f(r.get('grad_err_vs_aten'), '8.1e')} "
              f"{'/'.join(f(r.get(k + '_loop_us'), '.0f') for k in ('aten', 'gems', 'liger')):>20} "
              f"{f(r.get('gems_vs_aten_loop'), '8.2f')} "
              f"{'/'.join(f(r.get(k + '_device_us'), '.0f') for k in ('aten', 'gems', 'liger')):>16} "
              f"{f(r.get('gems_vs_aten_device'), '7.2f')}")
    for r in rows:
        for impl in ("aten", "liger"):
            if f"{impl}_error" in r:
                print(f"{r['case']} {r['mode']}: {impl} failed: {r[f'{impl}_error']}")
    if args.output:
        write_json(args.output, rows, args.device, liger=why or "imported", quick=args.quick, smoke=smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
