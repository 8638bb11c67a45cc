"""Collect the GEMMs the supported models call, at full size, into benchmarks/gemm_cases.json.

    python -m benchmarks.gemm_shapes                     # every model and workload -> gemm_cases.json
    python -m benchmarks.gemm_shapes --models bert -o x.json
    python -m benchmarks.gemm_shapes --compare cuda      # tiny models: meta's GEMMs vs a real device's

Each model is built by `gems_models.build` on the meta device (full size, bf16, no weights) and run by
gems_coverage's workload runners under gems_coverage's OpRecorder (a TorchDispatchMode), whose hook
keeps every ATen GEMM call (mm, addmm, bmm, baddbmm, ...) with its M, N, K, batch, dtype, operand
layouts, bias and alpha/beta. Workloads (see PLAN): prefill (one forward), decode (one one-token step
with the KV cache after a prompt; M = batch) and train (forward + backward; the optimizer step calls
no GEMM). Counts are per step. Identical GEMMs are merged across models into one case that lists its
sources (model, workload, batch, count, and the modules that call it: "self_attn.q_proj", or
"mlp.down_proj dW" for a weight gradient).

What the meta device changes (checked with --compare against CPU and CUDA): `linear` and `matmul`
decompose identically on every device (CompositeImplicit: a 2-D or contiguous 3-D input with bias ->
`addmm`, without bias -> `mm` on the flattened input; batched matmul -> `bmm`), and the autograd
formulas are device-independent, so those GEMMs carry over. Attention does not: on meta, SDPA takes
the math path (two fp32 `bmm`s per call and four in its backward, which CUDA never calls: it runs fused
cuDNN / flash kernels), and the math backward hands q/k/v gradients over transposed, which flips the
layouts of the q/k/v projections' backward GEMMs where no rotary embedding sits in between (CLIP,
BERT). So on meta, `scaled_dot_product_attention` is replaced by a stand-in with a fused kernel's
interface: no GEMM, the output and the gradients allocated like the inputs (`empty_like`, as the
flash and cuDNN kernels do). Checked on an H100 (torch 2.11, transformers 5.17):
`--compare cuda` found every source's GEMMs (shapes, layouts, roles, counts) identical. Against CPU
only BERT's training differs: CPU's SDPA takes the math path when dropout is on.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

OUT_FILE = str(Path(__file__).resolve().parent / "gemm_cases.json")
COMMAND = "python -m benchmarks.gemm_shapes"
PROMPT = 1024     # decode: positions before the recorded step (llava's include its image); no GEMM depends on it
DECODE_BATCHES = (1, 4, 16)


def _plan():
    """(model alias, workload, batch, tokens): tokens is the sequence length the model processes (for
    llava the image tokens count, so its text model sees the same 2048 as Llama-2's). Training sizes
    are those of the end-to-end benchmarks: 4x1024 for the 1.1B Llama, 32x128 for BERT."""
    plan = []
    for m in ("llama2", "aquila", "llava"):
        plan.append((m, "prefill", 1, 2048))
        plan += [(m, "decode", b, PROMPT) for b in DECODE_BATCHES]
        plan.append((m, "train", 1, 2048))
    plan += [("bert", "prefill", 1, 512), ("bert", "train", 32, 128), ("llama-1.1b", "train", 4, 1024)]
    return plan


PLAN = _plan()
MODELS = tuple(dict.fromkeys(p[0] for p in PLAN))
WORKLOADS = ("prefill", "decode", "train")
# overload base name -> positions of (bias, A, B) in its arguments; bias None for the plain products
GEMM_ARGS = {"mm": (None, 0, 1), "bmm": (None, 0, 1), "addmm": (0, 1, 2), "addmm_": (0, 1, 2),
             "baddbmm": (0, 1, 2), "baddbmm_": (0, 1, 2), "_addmm_activation": (0, 1, 2)}
# other products (or composites a dispatch mode should never see); counted so that a new route to a
# matrix product cannot go unnoticed: the table's header lists them (none today)
OTHER_PRODUCTS = {"mv", "addmv", "dot", "vdot", "addbmm", "addr", "outer", "matmul", "linear", "_int_mm",
                  "_scaled_mm", "tensordot", "einsum"}
_DTYPE = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.float64: "f64"}


# ------------------------------------------------------------------------------------- one call
def layout(t) -> str:
    """'N' (row-major: the last dim is contiguous), 'T' (a transposed row-major matrix: the row dim is
    contiguous) or 'strided'. A dim of size 1 can take any stride, so it never decides."""
    r, c = t.shape[-2], t.shape[-1]
    sr, sc = t.stride()[-2], t.stride()[-1]
    if sc == 1 or c == 1:
        if sr >= c or r == 1:
            return "N"
    if sr == 1 or r == 1:
        if sc >= r or c == 1:
            return "T"
    return "strided"


def compact(t) -> bool:
    """Whether the operand is a dense matrix (or dense batch of them) in its layout: any padding, gap or
    broadcast batch makes the benchmark rebuild its exact strides."""
    r, c = t.shape[-2], t.shape[-1]
    lay = layout(t)
    if lay == "strided":
        return False
    lead = t.stride()[-2] if lay == "N" else t.stride()[-1]
    if lead != (c if lay == "N" else r) and (r > 1 if lay == "N" else c > 1):
        return False
    return t.dim() == 2 or t.shape[0] == 1 or t.stride()[0] == r * c


def bias_kind(bias, out_shape) -> str:
    """How the added term is broadcast over the (.., M, N) result: row (one value per column, a
    Linear's bias), col, scalar or full."""
    st = bias.expand(out_shape).stride()
    rows, cols = st[-2] != 0 or out_shape[-2] == 1, st[-1] != 0 or out_shape[-1] == 1
    return {(True, True): "full", (False, True): "row", (True, False): "col", (False, False): "scalar"}[rows, cols]


def gemm_record(base: str, args, kwargs) -> dict:
    """The case fields of one GEMM call: op, M, N, K, batch, dtype, layouts, bias, alpha/beta."""
    ib, ia, ibb = GEMM_ARGS[base]
    a, b = args[ia], args[ibb]
    batched = a.dim() == 3
    r = {"op": base.rstrip("_") if base != "_addmm_activation" else base, "M": a.shape[-2], "N": b.shape[-1],
         "K": a.shape[-1], "batch": a.shape[0] if batched else 1, "dtype": _DTYPE.get(a.dtype, str(a.dtype)),
         "layout": layout(a) + layout(b), "bias": None}
    if base.endswith("_"):
        r["inplace"] = True
    if ib is not None:
        out = (r["batch"], r["M"], r["N"]) if batched else (r["M"], r["N"])
        r["bias"] = bias_kind(args[ib], out)
        scal = dict(zip(("beta", "alpha"), args[ibb + 1:ibb + 3]))
        scal.update({k: kwargs[k] for k in ("beta", "alpha") if k in kwargs})
        for k, v in scal.items():
            if isinstance(v, (int, float)) and v != 1:
                r[k] = v
        if base == "_addmm_activation":
            r["gelu"] = bool(args[5] if len(args) > 5 else kwargs.get("use_gelu", False))
    ops = (("a", a), ("b", b))
    if ib is not None and args[ib].dim() >= 2:    # a 1-D bias is described by its kind alone
        ops = (("bias", args[ib]),) + ops
    if not all(compact(t) for _, t in ops):
        # exact shapes and strides, so the benchmark can rebuild the same views
        r["strides"] = {k: [list(t.shape), list(t.stride())] for k, t in ops}
    return r


# ---------------------------------------------------------------------------------- who calls it
class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel looks like from outside: no GEMM call, the output allocated like
    q and the gradients like q, k, v (`empty_like`, as ATen's flash and cuDNN kernels allocate them)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        if v.shape[-1] == q.shape[-1]:
            return torch.empty_like(q)
        return q.new_empty(q.shape[:-1] + v.shape[-1:])

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


def _sdpa_standin(query, key, value, *args, **kwargs):
    return _FusedAttention.apply(query, key, value)


class _Scopes(TorchFunctionMode):
    """Which module is running: forward GEMMs take the innermost one; every autograd node is labeled
    with the module that created it, so a backward GEMM takes its forward's label.

    Forward pre/post hooks on every module keep the stack; this TorchFunctionMode (above autograd, so
    the outputs it sees carry their grad_fn) labels the new nodes after each torch call and, with
    `fused_attention`, swaps `scaled_dot_product_attention` for the stand-in above."""

    def __init__(self, model, fused_attention: bool):
        super().__init__()
        self.fused_attention = fused_attention
        self.stack: list = []          # [(role, weight shape of a Linear or None)]
        self.labels: dict = {}         # id(node) -> stack entry
        self._keep: list = []          # labeled nodes stay alive, so their ids stay unique
        self._handles = []
        for name, mod in model.named_modules():
            if not name:
                continue
            entry = (role_name(name), tuple(mod.weight.shape) if isinstance(mod, torch.nn.Linear) else None)
            self._handles.append(mod.register_forward_pre_hook(lambda m, a, e=entry: self.stack.append(e)))
            self._handles.append(mod.register_forward_hook(self._pop, always_call=True))

    def _pop(self, mod, args, out):
        self.stack.pop()      # returns None: a forward hook's non-None result would replace the output

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.fused_attention and func is torch.nn.functional.scaled_dot_product_attention:
            func = _sdpa_standin
        out = func(*args, **kwargs)
        if self.stack and torch.is_grad_enabled():
            self._label(out, self.stack[-1])
        return out

    def _label(self, out, entry):
        todo = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:   # the nodes this call created: everything not labeled before it
            n = todo.pop()
            if n is None or id(n) in self.labels:
                continue
            self.labels[id(n)] = entry
            self._keep.append(n)
            todo.extend(f for f, _ in n.next_functions)

    def role(self, rec: dict) -> str:
        """The module of the GEMM being recorded ('mlp.down_proj', 'mlp.down_proj dW', ...)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return self.stack[-1][0] if self.stack else ""
        role, wshape = self.labels.get(id(node), ("", None))
        return f"{role} {_grad_kind(rec, wshape) if wshape else 'bwd'}".strip()


def _grad_kind(rec, wshape) -> str:
    """A Linear's backward GEMM: dX multiplies by the weight (an operand of the weight's shape), dW
    reduces over the tokens (the result has the weight's shape); 'bwd' where the shapes cannot tell."""
    out_w = sorted((rec["M"], rec["N"])) == sorted(wshape)
    has_w = sorted((rec["M"], rec["K"])) == sorted(wshape) or sorted((rec["K"], rec["N"])) == sorted(wshape)
    if has_w and not out_w:
        return "dX"
    if out_w and not has_w:
        return "dW"
    return "bwd"


_FILLER = {"model", "layers", "layer", "encoder", "vision_model", "language_model", "bert", "text_model"}


def role_name(qualified: str) -> str:
    """'model.layers.3.self_attn.q_proj' -> 'self_attn.q_proj' (indices and container names dropped)."""
    parts = [p for p in qualified.split(".") if not p.isdigit() and p not in _FILLER]
    return ".".join(parts) or qualified


# ------------------------------------------------------------------------------------ one workload
def collect(model: str, workload: str, batch: int, tokens: int, *, size: str = "full", device: str = "meta",
            dtype: str = "bfloat16", bundle=None) -> tuple[list, dict]:
    """`trace_gemms` of a model (built here, or `bundle` with new inputs) at batch x tokens positions."""
    import gems_models
    if bundle is None:
        bundle = gems_models.build(model, size=size, device=device, dtype=dtype, batch=batch,
                              seq_len=text_tokens(gems_models.resolve(model), size, tokens))
    else:
        bundle.inputs, bundle.train_inputs = gems_models.make_inputs(
            bundle.kind, bundle.config, batch=batch, seq_len=text_tokens(bundle.recipe, bundle.size, tokens),
            device=torch.device(bundle.device), dtype=bundle.dtype)
    return trace_gemms(bundle, workload)


def trace_gemms(bundle, workload: str) -> tuple[list, dict]:
    """([GEMM record + role + count per step], {other product op: calls}) of one workload on a built
    gems_models.ModelBundle; on the meta device attention runs through the fused-kernel stand-in."""
    from gems_coverage import runner
    from gems_coverage.bench import mark_prompt
    from gems_coverage.tracer import OpRecorder
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r} ({', '.join(WORKLOADS)})")
    counts: dict = defaultdict(int)
    other: dict = defaultdict(int)
    recording = [workload != "decode"]    # decode: the prompt's forward is not a decode step
    scopes = _Scopes(bundle.model, fused_attention=torch.device(bundle.device).type == "meta")

    def on_call(name, func, args, kwargs, out):
        base = name.split(".")[0]
        if not recording[0] or "::" in name:
            return
        if base in GEMM_ARGS:
            rec = gemm_record(base, args, kwargs)
            rec["role"] = scopes.role(rec)
            counts[json.dumps(rec, sort_keys=True)] += 1
        elif base in OTHER_PRODUCTS:
            other[base] += 1

    def start():
        recording[0] = True

    with scopes, OpRecorder(meta_scalars=True, on_call=on_call):
        if workload == "prefill":
            runner.run_inference(bundle)
        elif workload == "decode":
            with mark_prompt(bundle.model, after=start):
                runner.run_generate(bundle, new_tokens=2)     # the prompt, then one decode step
        else:
            runner.run_training(bundle)
    return [dict(json.loads(k), count=n) for k, n in counts.items()], dict(other)


def text_tokens(recipe, size: str, tokens: int) -> int:
    """The text length that makes a model process `tokens` positions: llava's prompt also holds BOS and
    the image's tokens (gems_models.make_inputs puts them first)."""
    if recipe.kind != "llava":
        return tokens
    import gems_models
    cfg = gems_models.load_config(recipe, size)
    prefix = int(getattr(cfg, "image_seq_length", 0) or 0) + 1
    if tokens <= prefix:
        raise ValueError(f"llava: {tokens} positions do not leave room for text after BOS + image ({prefix})")
    return tokens - prefix


# ---------------------------------------------------------------------------------------- merging
KEY_FIELDS = ("op", "M", "N", "K", "batch", "dtype", "layout", "bias", "alpha", "beta", "inplace", "gelu",
              "strides")


def case_id(c: dict) -> str:
    """A short, stable name: 'addmm 2048x4096x4096 NT bf16 +row' ('b32' before the dims of a bmm)."""
    dims = f"{c['M']}x{c['N']}x{c['K']}"
    if c["batch"] > 1 or c["op"] in ("bmm", "baddbmm"):
        dims = f"b{c['batch']} {dims}"
    extra = "".join(f" {k}={c[k]}" for k in ("alpha", "beta") if k in c)
    extra += f" +{c['bias']}" if c.get("bias") else ""
    extra += " strided" if "strides" in c else ""
    return f"{c['op']} {dims} {c['layout']} {c['dtype']}{extra}"


def merge(per_source: list) -> list:
    """[(source dict, records)] -> cases: identical GEMMs merged, each with its sources and roles."""
    cases: dict = {}
    for src, recs in per_source:
        for r in recs:
            key = tuple(json.dumps(r.get(k), sort_keys=True) for k in KEY_FIELDS)
            c = cases.get(key)
            if c is None:
                c = cases[key] = {k: r[k] for k in KEY_FIELDS if k in r and r[k] is not None}
                c["sources"] = {}
            s = c["sources"].setdefault(json.dumps(src, sort_keys=True), dict(src, count=0, roles={}))
            s["count"] += r["count"]
            s["roles"][r["role"]] = s["roles"].get(r["role"], 0) + r["count"]
    out = []
    for c in cases.values():
        c["sources"] = sorted(c["sources"].values(), key=lambda s: (MODELS.index(s["model"]) if s["model"] in
                              MODELS else 99, WORKLOADS.index(s["workload"]), s["batch"]))
        for s in c["sources"]:
            s["roles"] = dict(sorted(s["roles"].items()))
        sources = c.pop("sources")
        out.append({"id": case_id(c), **c, "flops": 2 * c["M"] * c["N"] * c["K"] * c["batch"], "sources": sources})
    out.sort(key=lambda c: (c["op"], c["dtype"], c["M"], c["N"], c["K"], c["batch"],
                            c["layout"], c["id"]))
    return out


def _version(name):
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001
        return None


def build_table(plan=PLAN, progress=print) -> dict:
    """The whole document written to gemm_cases.json."""
    import gems_models
    per_source, other, bundles = [], defaultdict(int), {}
    for model, workload, batch, tokens in plan:
        if model not in bundles:
            bundles.clear()     # one full-size model alive at a time
            progress(f"building {model} (full, meta, bf16)")
            bundles[model] = gems_models.build(model, size="full", device="meta", dtype="bfloat16")
        progress(f"  {workload} batch {batch} x {tokens} tokens")
        recs, oth = collect(model, workload, batch, tokens, bundle=bundles[model])
        per_source.append(({"model": model, "workload": workload, "batch": batch, "tokens": tokens}, recs))
        for k, v in oth.items():
            other[f"{model}/{workload}: {k}"] += v
    cases = merge(per_source)
    return {
        "command": COMMAND,
        "generated_with": {"torch": torch.__version__, "transformers": _version("transformers")},
        "device": "meta", "dtype": "bfloat16", "size": "full",
        "plan": [f"{m} {w} {b}x{t}" for m, w, b, t in plan],
        "notes": [
            "plan: model workload batch x positions (llava's positions hold BOS + 576 image tokens + text); "
            "count: calls per step (prefill: one forward; decode: one one-token step with the KV cache after "
            f"a {PROMPT}-position prompt; train: forward + backward, the optimizer step calls no GEMM)",
            "M, N, K as C[M,N] = A[M,K] @ B[K,N] (x batch for bmm); layout: A's then B's, N = row-major, "
            "T = transposed (the other dim contiguous), strided = neither; 'strides' present when an "
            "operand is not a dense matrix (the benchmark rebuilds those views exactly)",
            "bias: row = one value per output column (a Linear's bias), full = a whole matrix",
            "attention: traced through a stand-in for a fused kernel (no GEMM; see benchmarks/gemm_shapes.py): "
            "on CUDA, SDPA runs fused cuDNN/flash kernels, while meta would take the fp32 math path",
            "roles: the module that calls the GEMM ('dX' / 'dW': a Linear's input / weight gradient)",
        ],
        "other_products": dict(other),
        "summary": summarize(cases, [src for src, _ in per_source]),
        "cases": cases,
    }


def _source_key(s: dict) -> str:
    return f"{s['model']}/{s['workload']}" + (f"/b{s['batch']}" if s["workload"] == "decode" else "")


def summarize(cases, plan_sources) -> dict:
    """Per model/workload: distinct cases and GEMM calls per step (a merged case counts for each source)."""
    per = {_source_key(s): {"cases": 0, "calls": 0} for s in plan_sources}
    for c in cases:
        for s in c["sources"]:
            per[_source_key(s)]["cases"] += 1
            per[_source_key(s)]["calls"] += s["count"]
    return {"cases": len(cases), "per_source": dict(per)}


def compare(device: str, models_=MODELS, progress=print) -> list:
    """Tiny variants of each model traced on meta (attention stand-in) and on `device` (its real SDPA):
    the GEMM calls that differ. Roles and counts are compared too; fp32 on CPU, bf16 elsewhere."""
    diffs = []
    dt = "float32" if device == "cpu" else "bfloat16"
    for model, workload, batch, _ in [p for p in PLAN if p[0] in models_]:
        tokens = 24 if model == "llava" else 16     # tiny llava's prompt holds BOS + 4 image tokens
        got = {}
        for dev in ("meta", device):
            recs, _ = collect(model, workload, batch, tokens, size="tiny", device=dev, dtype=dt)
            got[dev] = {json.dumps(r, sort_keys=True) for r in recs}
        same = got["meta"] == got[device]
        progress(f"{model}/{workload} b{batch}: {len(got['meta'])} GEMM kinds on meta, {len(got[device])} on "
                 f"{device}: {'same' if same else 'DIFFERENT'}")
        if not same:
            diffs.append({"source": f"{model}/{workload}/b{batch}", "meta_only": sorted(got["meta"] - got[device]),
                          f"{device}_only": sorted(got[device] - got["meta"])})
    return diffs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-o", "--output", default=OUT_FILE)
    p.add_argument("--models", default=None, help="comma-separated subset of " + ", ".join(MODELS))
    p.add_argument("--compare", metavar="DEVICE", default=None,
                   help="instead: trace the tiny variants on meta and on DEVICE (cpu, cuda); list the GEMMs "
                        "that differ (exit 1 if any)")
    a = p.parse_args(argv)
    chosen = a.models.split(",") if a.models else list(MODELS)
    bad = [m for m in chosen if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad} ({', '.join(MODELS)})")
    say = lambda s: print(s, file=sys.stderr, flush=True)   # noqa: E731
    if a.compare:
        diffs = compare(a.compare, chosen, say)
        print(json.dumps(diffs, indent=1))
        return 1 if diffs else 0
    doc = build_table([q for q in PLAN if q[0] in chosen], say)
    with open(a.output, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"{doc['summary']['cases']} cases -> {a.output}")
    for k, v in doc["summary"]["per_source"].items():
        print(f"  {k:24s} {v['cases']:3d} cases, {v['calls']:5d} GEMM calls per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
