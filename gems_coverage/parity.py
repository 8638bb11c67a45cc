"""Parity: run a model with and without Gems and compare; name the first ATen op whose output diverges.

Two checks:

* **End to end.** The same weights (deep copies of one random model) run once on plain ATen and once with
  Gems enabled: inference logits, greedy generated tokens (causal LMs and Llava), and one training step
  (loss, every gradient, every parameter after an AdamW step). Floating tensors are compared by relative
  error ``||gems - aten|| / ||aten||`` against a per-dtype tolerance.
* **Shadow, op by op.** During the Gems run a dispatch mode sees every ATen call; for each compute op that
  Gems registers, it also runs ATen's kernel on copies of the same inputs (Gems switched off for that call)
  and compares the two outputs element-wise. Because both see identical inputs, errors do not accumulate:
  the first op over tolerance, in call order, is the broken kernel, reported with its shapes and dtypes.

Dropout is set to 0 for parity runs on every dropout module and every `*drop*` probability of the
model and its config (``no_dropout``), and each run starts from the same seed, so a random draw that
is left (Gems serves no random op) repeats in both runs. The training step
uses SGD by default: its update is linear in the gradient, so the parameters differ exactly as much as the
gradients do. AdamW (``optimizer="adamw"``) divides by the gradient's own magnitude on its first step, which
turns rounding noise in gradients that are zero in exact arithmetic (attention key biases) into full-size
updates of either sign.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

from . import classify as C
from . import gemsinfo
from .tracer import describe_tensors, op_name, short_dtype

# Per-op (shadow) tolerances, element-wise: |g - a| <= atol * max(1, max|a|) + rtol * |a|
OP_TOL = {torch.float64: (1e-7, 1e-9), torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-3),
          torch.bfloat16: (2e-2, 1e-2)}
# End-to-end tolerances on the relative Frobenius error ||g - a|| / ||a||
E2E_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# Ops whose two runs legitimately differ (random draws)
NONDETERMINISTIC = frozenset({"native_dropout", "dropout", "bernoulli", "bernoulli_", "rand", "rand_like",
                              "randn", "randn_like", "randint", "randperm", "normal", "normal_",
                              "uniform_", "multinomial", "random_", "exponential_"})


@dataclass
class Check:
    phase: str
    name: str
    ok: bool
    detail: str
    rel_err: float = 0.0
    max_abs: float = 0.0
    tol: float = 0.0


@dataclass
class Divergence:
    index: int                # call number in the Gems run (0-based, all ATen calls counted)
    phase: str
    op: str
    inputs: str
    output: str
    max_abs: float
    allowed: float
    detail: str = ""


@dataclass
class ParityResult:
    model: str
    size: str
    device: str
    dtype: str
    backend: str
    registered_ops: int
    checks: list = field(default_factory=list)
    divergences: list = field(default_factory=list)
    shadow_calls: int = 0
    shadow_ops: set = field(default_factory=set)
    served: dict = field(default_factory=dict)      # op -> {served, fallback, reasons}
    compute_ops: set = field(default_factory=set)   # compute ops the Gems run called
    seconds: float = 0.0
    notes: list = field(default_factory=list)
    patched: bool = False                           # --patch: the Gems run's model was gems.patch'ed
    patch: Optional[dict] = None                    # gems.patch's report (what was replaced)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and not self.divergences

    @property
    def served_compute_ops(self) -> list:
        return sorted(n for n, s in self.served.items() if s.get("served") and C.classify(n) == C.COMPUTE)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "size": self.size, "device": self.device, "dtype": self.dtype,
            "backend": self.backend, "registered_ops": self.registered_ops, "ok": self.ok,
            "verdict": "PASS" if self.ok else "FAIL",
            "checks": [vars(c) for c in self.checks],
            "first_divergence": vars(self.divergences[0]) if self.divergences else None,
            "divergences": [vars(d) for d in self.divergences],
            "shadow_calls": self.shadow_calls, "shadow_ops": sorted(self.shadow_ops),
            "compute_ops_called": len(self.compute_ops),
            "served_compute_ops": self.served_compute_ops,
            "served": self.served, "seconds": round(self.seconds, 2), "notes": self.notes,
            "patched": self.patched, "patch": self.patch,
        }


# ------------------------------------------------------------------------------------------ compare
def _np(t: torch.Tensor):
    """A float64/int numpy copy. Comparisons run in numpy so that they never dispatch to Gems' kernels."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    a = t.numpy()
    return a.astype(np.float64) if a.dtype.kind == "f" else a


def _allclose_elementwise(g: torch.Tensor, a: torch.Tensor):
    """(ok, max_abs_err, allowed_at_worst) for one op output."""
    if g.shape != a.shape:
        return False, float("inf"), 0.0
    if a.numel() == 0:
        return True, 0.0, 0.0
    if a.is_complex() or g.is_complex():
        return bool(torch.equal(g, a)), 0.0, 0.0
    gn, an = _np(g), _np(a)
    if not a.is_floating_point():
        n = int((gn != an).sum())
        return n == 0, float(n), 0.0
    rtol, atol = OP_TOL.get(a.dtype, OP_TOL[torch.float32])
    finite = np.isfinite(an)
    scale = max(1.0, float(np.abs(an[finite]).max())) if finite.any() else 1.0
    with np.errstate(invalid="ignore"):
        err = np.abs(gn - an)
        allowed = atol * scale + rtol * np.abs(an)
        good = (err <= allowed) | (~finite & (gn == an)) | (np.isnan(an) & np.isnan(gn))
    if good.all():
        return True, float(err[finite].max()) if finite.any() else 0.0, 0.0
    bad_err = np.where(good, 0.0, np.nan_to_num(err, nan=np.inf))
    i = int(np.argmax(bad_err))
    return False, float(bad_err.flat[i]), float(allowed.flat[i])


def compare_e2e(g: torch.Tensor, a: torch.Tensor, floor: float = 0.0, dtype=None):
    """(ok, rel_err, max_abs, tol) between a Gems and an ATen tensor of the whole model.

    rel_err = ||g - a|| / (||a|| + floor * sqrt(numel)); the tolerance is that of `dtype`, the dtype the
    runs computed in (default: the tensors' own).
    """
    if g is None and a is None:
        return True, 0.0, 0.0, 0.0
    if g is None or a is None or g.shape != a.shape:
        return False, float("inf"), float("inf"), 0.0
    gn, an = _np(g), _np(a)
    if not a.is_floating_point():
        nbad = int((gn != an).sum())
        return nbad == 0, 0.0 if nbad == 0 else 1.0, float(nbad), 0.0
    tol = E2E_TOL.get(dtype or a.dtype, E2E_TOL[torch.float32])
    if not np.isfinite(gn).all() and np.isfinite(an).all():
        return False, float("inf"), float("inf"), tol
    diff = np.nan_to_num(gn - an)
    max_abs = float(np.abs(diff).max()) if diff.size else 0.0
    na = float(np.linalg.norm(np.nan_to_num(an)))
    nd = float(np.linalg.norm(diff))
    den = na + floor * an.size ** 0.5
    rel = nd / den if den > 0 else nd
    return rel <= tol, rel, max_abs, tol


def _norm(t) -> float:
    return float(np.linalg.norm(_np(t))) if t is not None and t.is_floating_point() else 0.0


# ------------------------------------------------------------------------------------------- shadow
class ShadowMode(TorchDispatchMode):
    """Runs every Gems-registered compute op twice (Gems, then ATen on copies of the inputs) and compares."""

    def __init__(self, names: set, result: ParityResult, phase: str, max_divergences: int = 5):
        super().__init__()
        self.names = names
        self.result = result
        self.phase = phase
        self.max_div = max_divergences
        self.calls = 0
        self.compute_ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import gems
        kwargs = kwargs or {}
        name = op_name(func)
        idx = self.calls
        self.calls += 1
        cat = C.classify(name)
        if cat == C.COMPUTE:
            self.compute_ops.add(name)
        if name not in self.names or cat != C.COMPUTE or C.packet_of(name) in NONDETERMINISTIC:
            return func(*args, **kwargs)
        aten = gems.use_gems(include=[])   # the tool's own work (copies, comparisons) runs on ATen
        with aten:
            ref_args, ref_kwargs = tree_map(_clone, (args, kwargs))
        inputs = describe_tensors(args, kwargs)
        out = func(*args, **kwargs)
        with aten:
            ref = func(*ref_args, **ref_kwargs)
            self._compare(idx, name, inputs, drop_rng_state(func, out), drop_rng_state(func, ref))
        return out

    def _compare(self, idx, name, inputs, out, ref):
        self.result.shadow_calls += 1
        self.result.shadow_ops.add(name)
        if len(self.result.divergences) < self.max_div:
            g_leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            a_leaves = [t for t in tree_leaves(ref) if isinstance(t, torch.Tensor)]
            if len(g_leaves) != len(a_leaves):
                self._diverged(idx, name, inputs, out, float("inf"), 0.0, "different number of outputs")
            else:
                for i, (g, a) in enumerate(zip(g_leaves, a_leaves)):
                    ok, err, allowed = _allclose_elementwise(g, a)
                    if not ok:
                        self._diverged(idx, name, inputs, out, err, allowed,
                                       f"output {i}" if len(g_leaves) > 1 else "")
                        break

    def _diverged(self, idx, name, inputs, out, err, allowed, detail):
        outs = ", ".join(f"{short_dtype(t.dtype)}[{','.join(map(str, t.shape))}]"
                         for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.result.divergences.append(Divergence(index=idx, phase=self.phase, op=name, inputs=inputs,
                                                  output=outs, max_abs=err, allowed=allowed, detail=detail))


# results that hold a random generator's state (SDPA's fused overloads return their Philox seed/offset,
# placeholders without dropout): opaque to the caller and legitimately different between two generators
_RNG_STATE_RESULTS = frozenset(["philox_seed", "philox_offset", "rng_state", "unused", "seed", "offset"])


def drop_rng_state(func, out):
    """`out` without the results the schema names as generator state (replaced by None)."""
    rets = func._schema.returns
    if not isinstance(out, tuple) or len(out) != len(rets):
        return out
    return tuple(None if r.name in _RNG_STATE_RESULTS else o for r, o in zip(rets, out))


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return x


# ---------------------------------------------------------------------------------------------- run
def parity(model: str, *, modes=("inference", "training"), device: str = "cpu", size: Optional[str] = None,
           dtype=None, batch: int = 1, seq_len: Optional[int] = None, new_tokens: int = 4,
           shadow: bool = True, include=None, exclude=None, seed: int = 0, optimizer: str = "sgd",
           patch: bool = False, progress: Optional[Callable[[str], None]] = None) -> ParityResult:
    """patch: the Gems run's model copy is also patched by `gems.patch` (fused ops); the ATen run's is not.
    True for gems.patch's defaults, or a dict of its options."""
    import gems
    import gems_models
    from . import runner

    popts, patch = runner.patch_options(patch), runner.patched(patch)

    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    info = gemsinfo.load()
    dev_type = torch.device(device).type
    if dev_type == "meta":
        raise gems_models.ModelError("parity needs data: use --device cpu (tiny, Triton interpreter) or cuda")
    if dev_type == "cuda" and not torch.cuda.is_available():
        raise gems_models.ModelError("--device cuda: no CUDA device on this machine")
    if not info.available:
        raise gems_models.ModelError(f"parity needs Gems: {info.error}")
    if info.backend is None or info.backend_device != dev_type:
        why = info.error or f"the active Gems backend '{info.backend}' serves {info.backend_device} tensors"
        raise gems_models.ModelError(f"Gems cannot run on device {device}: {why}")
    for m in modes:
        if m not in ("inference", "training"):
            raise gems_models.ModelError(f"unknown parity mode '{m}' (inference, training)")
    size, dtype, dt, seq_len = gems_models.run_defaults(dev_type, size, dtype, seq_len)
    # ops that only move data (copies, gathers, scatters) are exact in any dtype: they cannot make a run
    # compare Gems' arithmetic with ATen's, so a dtype counts as served only through an op that computes
    served_dtypes = {d for im in info.impls.values() if im.category not in ("copy", "index") for d in im.dtypes}
    if dt not in served_dtypes:
        what = "; use --device cuda" if dt == torch.bfloat16 and info.backend == "interpreter" else ""
        raise gems_models.ModelError(f"Gems serves no {short_dtype(dt)} op on the '{info.backend}' backend, so parity "
                                f"would compare ATen with itself{what} (served: "
                                f"{', '.join(sorted(short_dtype(d) for d in served_dtypes if d.is_floating_point))})")
    if optimizer not in ("sgd", "adamw"):
        raise gems_models.ModelError(f"unknown optimizer '{optimizer}' (sgd, adamw)")
    lr = 1e-2 if optimizer == "sgd" else 1e-3
    try:
        scope = gems.use_gems(include=include, exclude=exclude)
    except ValueError as e:
        raise gems_models.ModelError(str(e)) from None
    recipe = gems_models.resolve(model)
    generates = "inference" in modes and recipe.kind in ("causal_lm", "llava")
    runner.check_model(recipe, size, mode="generate" if generates else "inference", seq_len=seq_len, batch=batch,
                       new_tokens=new_tokens)
    runner.check_memory(recipe, size, device, dt, _copies(modes, optimizer, dt), "parity")

    say(f"building {model} ({size}, {device}, {short_dtype(dt)}, dropout 0) ...")
    base = gems_models.build(recipe, size=size, device=device, dtype=dt, batch=batch, seq_len=seq_len,
                        seed=seed, dropout=0.0)
    no_dropout(base.model)
    res = ParityResult(model=base.recipe.name, size=size, device=device, dtype=str(dt).replace("torch.", ""),
                       backend=info.backend, registered_ops=info.registered_ops)
    if patch:
        # a model gems.patch refuses or replaces nothing in: bad input, before any run
        res.patch = runner.patch_report(base.model, popts, model)
    names = set(scope.cfg) if shadow else set()
    before = gemsinfo.stats()

    def gems_copy():
        """A copy of the base model for the Gems run (patched with --patch)."""
        b = copy.deepcopy(base)
        if patch:
            try:
                res.patch = gems.patch(b.model, **popts).to_dict()
            except (ValueError, TypeError, RuntimeError) as e:
                raise gems_models.ModelError(f"--patch: {e}") from None
            res.patched = True
        return b

    def gems_run(phase, fn):
        sh = ShadowMode(names, res, phase)   # with no names it only lists the compute ops called
        torch.manual_seed(seed + 1)   # any random draw left (see no_dropout) repeats the ATen run's
        with scope:
            with sh:
                out = fn()
        if dev_type == "cuda":
            torch.cuda.synchronize()
        res.compute_ops |= sh.compute_ops
        return out

    def aten_run(fn):
        torch.manual_seed(seed + 1)
        with gems.use_gems(include=[]):
            return fn()

    lowp = dt in (torch.bfloat16, torch.float16)

    def hi_copy():
        """An fp32 copy of the same weights and inputs: the reference for the low-precision rule."""
        h = copy.deepcopy(base)
        h.model.float()
        for d in (h.inputs, h.train_inputs):
            for k, v in d.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    d[k] = v.float()
        return h

    if "inference" in modes:
        hi_logits = None
        if lowp:
            say("inference: ATen in float32 (reference for the low-precision rule) ...")
            hb = hi_copy()
            hi_logits = main_output(aten_run(lambda: runner.run_inference(hb)))
            del hb
        say("inference: ATen ...")
        ref_b, gem_b = copy.deepcopy(base), gems_copy()
        ref_logits = main_output(aten_run(lambda: runner.run_inference(ref_b)))
        say("inference: Gems ...")
        gem_logits = main_output(gems_run("inference", lambda: runner.run_inference(gem_b)))
        res.checks.append(e2e_check("inference", "logits", gem_logits, ref_logits, hi_logits))
        if base.kind in ("causal_lm", "llava"):
            say(f"generate ({new_tokens} greedy tokens): ATen, Gems ...")
            ref_steps, gem_steps = [], []
            ref_tok = aten_run(lambda: generate_greedy(ref_b, new_tokens, ref_steps))
            gem_tok = gems_run("generate", lambda: generate_greedy(gem_b, new_tokens, gem_steps))
            res.checks.append(token_check(gem_tok, ref_tok, ref_steps, gem_steps))
        del ref_b, gem_b
    if "training" in modes:
        hi = None
        if lowp:
            say("training step: ATen in float32 (reference for the low-precision rule) ...")
            hb, hi_grads = hi_copy(), {}
            hi_loss = aten_run(lambda: runner.run_training(hb, optimizer, lr, after_backward=_grab(hi_grads)))
            hi = (hi_loss, hi_grads, {k: v.detach() for k, v in hb.model.named_parameters()})
            del hb
        say("training step: ATen ...")
        ref_b, gem_b = copy.deepcopy(base), gems_copy()
        ref_grads, gem_grads = {}, {}
        ref_loss = aten_run(lambda: runner.run_training(ref_b, optimizer, lr,
                                                        after_backward=_grab(ref_grads)))
        say("training step: Gems ...")
        gem_loss = gems_run("training", lambda: runner.run_training(gem_b, optimizer, lr,
                                                                    after_backward=_grab(gem_grads)))
        res.checks.append(e2e_check("training", "loss", gem_loss, ref_loss, hi[0] if hi else None))
        res.checks.append(_many("training", "gradients", gem_grads, ref_grads, hi[1] if hi else None))
        res.checks.append(_many("training", f"params after {optimizer} step",
                                dict(gem_b.model.named_parameters()), dict(ref_b.model.named_parameters()),
                                hi[2] if hi else None))
    if lowp:
        res.notes.append("low precision: a tensor passes when it is within tolerance of ATen's, or when its "
                         "error against an fp32 ATen run is at most 2x ATen's own error (+1e-4)")
    res.served = gemsinfo.stats_delta(before, gemsinfo.stats())
    res.seconds = time.perf_counter() - t0
    return res


def _copies(modes, optimizer, dt) -> float:
    """Peak memory of a parity run in copies of the weights: the base model and the ATen and Gems
    copies; training adds a gradient per copy, the two stored gradient sets, AdamW's two states, and
    for bf16/fp16 the fp32 reference's weights and gradients (2x the bytes each)."""
    copies = 3.0
    if "training" in modes:
        lowp = dt in (torch.bfloat16, torch.float16)
        copies = 7.0 + (4.0 if optimizer == "adamw" else 0.0) + (4.0 if lowp else 0.0)
    return copies


def no_dropout(model):
    """Put a model in no-dropout mode whatever its architecture: p = 0 on every dropout module and 0.0
    for every float attribute or config value whose name says drop (`attention_dropout`, GPT-2's
    `resid_pdrop`, `drop_path_rate`, `layerdrop`, ...). Config keys alone miss the modules that copied
    them at build time. Whatever random draw is left repeats in both runs (each is seeded alike)."""
    def zero(obj):
        for k, v in list(vars(obj).items()):
            if isinstance(v, float) and not isinstance(v, bool) and 0.0 < v <= 1.0 and "drop" in k.lower():
                setattr(obj, k, 0.0)

    seen = set()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        zero(m)
        cfg = getattr(m, "config", None)
        for c in (cfg, getattr(cfg, "text_config", None), getattr(cfg, "vision_config", None)):
            if c is not None and id(c) not in seen and hasattr(c, "__dict__"):
                seen.add(id(c))
                zero(c)


def main_output(out):
    """The logits of a transformers output, else the first tensor of whatever the model returned."""
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    leaves = [t for t in tree_leaves(out.to_tuple() if hasattr(out, "to_tuple") else out)
              if isinstance(t, torch.Tensor)]
    return leaves[0] if leaves else None


def _grab(store: dict):
    def f(model):
        for n, p in model.named_parameters():
            store[n] = None if p.grad is None else p.grad.detach().clone()
    return f


def generate_greedy(bundle, n, steps: list):
    from . import runner
    orig = bundle.model.forward

    def fwd(*a, **k):
        out = orig(*a, **k)
        steps.append(out.logits[:, -1, :].detach().clone())
        return out
    had, prev = "forward" in bundle.model.__dict__, bundle.model.__dict__.get("forward")   # gems.patch's
    bundle.model.forward = fwd
    try:
        return runner.run_generate(bundle, n)
    finally:
        del bundle.model.forward
        if had:
            bundle.model.forward = prev


LOWP_FLOOR = 1e-4


def lowp_rule(g, a, hi, floor: float = 0.0):
    """(ok, err_gems, err_aten) of the low-precision rule: Gems' error against the fp32 run is at most
    twice ATen's own (plus a small floor)."""
    eg = compare_e2e(g, hi, floor)[1]
    ea = compare_e2e(a, hi, floor)[1]
    return eg <= 2 * ea + LOWP_FLOOR, eg, ea


def e2e_check(phase, name, g, a, hi=None) -> Check:
    ok, rel, mx, tol = compare_e2e(g, a)
    detail = f"rel err {rel:.2e}, max abs {mx:.2e} (tol {tol:.0e})"
    if hi is not None and g is not None and g.is_floating_point():
        ok2, eg, ea = lowp_rule(g, a, hi)
        detail += f"; vs fp32: Gems {eg:.2e}, ATen {ea:.2e}"
        ok = ok or ok2
    return Check(phase, name, ok, detail, rel, mx, tol)


def _many(phase, name, g: dict, a: dict, hi: Optional[dict] = None) -> Check:
    """Compare a group of tensors (gradients, parameters).

    Each tensor's error is measured against its own norm plus the group's RMS magnitude times
    sqrt(numel): some gradients are zero in exact arithmetic (e.g. attention key biases, which softmax
    ignores) and hold only rounding noise, so their own norm is no yardstick.
    """
    worst, worst_name, bad, mx_all, tol = 0.0, "", [], 0.0, 0.0
    sq, n_el = 0.0, 0
    for t in a.values():
        if t is not None and t.is_floating_point():
            sq += _norm(t) ** 2
            n_el += t.numel()
    rms = (sq / n_el) ** 0.5 if n_el else 0.0
    for k in a:
        ok, rel, mx, t = compare_e2e(g.get(k), a[k], floor=rms)
        if not ok and hi is not None and hi.get(k) is not None and g.get(k) is not None:
            ok = lowp_rule(g[k], a[k], hi[k], floor=rms)[0]
        tol = max(tol, t)
        mx_all = max(mx_all, mx)
        if not ok:
            bad.append(k)
        if rel >= worst:
            worst, worst_name = rel, k
    n = len(a)
    detail = f"{n} tensors, worst {worst_name}: rel err {worst:.2e} (tol {tol:.0e})"
    if bad:
        detail = f"{len(bad)}/{n} over tolerance (first: {bad[0]}); " + detail
    return Check(phase, f"{name} ({n})", not bad, detail, worst, mx_all, tol)


def token_check(g: torch.Tensor, a: torch.Tensor, ref_steps: list, got_steps: Optional[list] = None,
                dtype=None, reference: Optional[Callable] = None) -> Check:
    """Greedy tokens equal, up to a flip that rounding explains.

    At the first step where the tokens differ both runs decoded the same context, so the flip is judged
    there: it is accepted where ATen's own top-2 logits are within tolerance (a tie), or, given Gems'
    logits of that step (`got_steps`), where the two runs' logits of that step agree by the end-to-end rule
    (a flip then only says the margin was below the rounding both runs are allowed), or, given
    `reference(step, row)` (ATen's logits of that context computed in fp32), by the low-precision rule:
    Gems' logits are at most twice as far from fp32 as ATen's. Later steps decode different contexts and
    are not compared. `dtype`: what the runs computed in, whose tolerances apply (generate hands its
    logits over in fp32 whatever the model's dtype); default the logits' own."""
    n = a.numel()
    if torch.equal(g, a):
        return Check("inference", "greedy tokens", True, f"{n}/{n} equal")
    diff = (g != a).nonzero()
    b, s = int(diff[0, 0]), int(diff[0, 1])
    logits = _np(ref_steps[s][b])
    margin = float(logits[int(a[b, s])] - logits[int(g[b, s])])
    tol = E2E_TOL.get(dtype or ref_steps[s].dtype, 1e-4) * max(1.0, float(np.abs(logits).max()))
    same = int((g == a).sum())
    if margin <= tol:
        return Check("inference", "greedy tokens", True,
                     f"{same}/{n} equal; step {s} differs on a near tie (margin {margin:.1e})")
    where = (f"{same}/{n} equal; first difference at step {s} (batch {b}): {int(g[b, s])} vs {int(a[b, s])},"
             f" ATen margin {margin:.2e}")
    if got_steps is None or s >= len(got_steps):
        return Check("inference", "greedy tokens", False, where)
    ok, rel, _, etol = compare_e2e(got_steps[s][b], ref_steps[s][b], dtype=dtype)
    detail = f"{where}; that step's logits (same context): rel err {rel:.2e} (tol {etol:.0e})"
    if not ok and reference is not None:
        ok, eg, ea = lowp_rule(got_steps[s][b], ref_steps[s][b], reference(s, b))
        detail += f"; vs fp32: Gems {eg:.2e}, ATen {ea:.2e}"
    return Check("inference", "greedy tokens", ok, f"{detail}: {'within' if ok else 'outside'} the rule")


# ------------------------------------------------------------------------------------------- format
def format_result(r: ParityResult, fmt: str = "table") -> str:
    import json
    if fmt == "json":
        return json.dumps(r.to_dict(), indent=2) + "\n"
    md = fmt == "markdown"
    lines = [f"parity  {r.model} ({r.size}, {r.device}, {r.dtype}); Gems backend '{r.backend}', "
             f"{r.registered_ops} registered overloads"]
    if r.patched and r.patch:
        lines.append("patched gems.patch on the Gems run: " + ", ".join(
            f"{k} x{v}" for k, v in r.patch["replaced"].items()) + "".join(f"; {n}" for n in r.patch["notes"])
            + "".join(f"; not proven, left as is: {e['module']} ({e['op']}: {e['why']})"
                      for e in r.patch.get("left", []) if e["strict"]))
    phase = None
    for c in r.checks:
        if c.phase != phase:
            phase = c.phase
            lines.append(f"{phase}")
        lines.append(f"  {'ok  ' if c.ok else 'FAIL'}  {c.name:<34} {c.detail}")
    lines.append(f"shadow  {r.shadow_calls} calls of {len(r.shadow_ops)} Gems ops compared with ATen op by op")
    if r.divergences:
        d = r.divergences[0]
        lines.append(f"FIRST DIVERGENT OP  aten::{d.op}  (call #{d.index} of the {d.phase} run"
                     f"{', ' + d.detail if d.detail else ''})")
        lines.append(f"  inputs  {d.inputs}")
        lines.append(f"  output  {d.output}: max abs err {d.max_abs:.3e} > allowed {d.allowed:.3e}")
        for e in r.divergences[1:]:
            lines.append(f"  then    aten::{e.op} (call #{e.index}, {e.phase})")
    else:
        lines.append("        no divergence")
    served = [n for n in r.served_compute_ops if n in r.compute_ops]
    inner = [n for n in r.served_compute_ops if n not in r.compute_ops]
    fell = sorted(n for n, s in r.served.items() if s.get("fallback") and not s.get("served"))
    lines.append(f"served  Gems served {len(served)} of the {len(r.compute_ops)} compute ops the model called"
                 + (f": {', '.join(served)}" if served else ""))
    if inner:
        lines.append(f"        and, called from inside ATen kernels: {', '.join(inner)}")
    if fell:
        reasons = []
        for n in fell:
            rs = r.served[n].get("reasons") or {}
            reasons.append(f"{n} ({', '.join(rs) or 'fallback'})")
        lines.append(f"        fell back to ATen: {'; '.join(reasons)}")
    for n in r.notes:
        lines.append(f"note    {n}")
    lines.append(f"verdict {'PASS' if r.ok else 'FAIL'}  ({r.seconds:.1f} s)")
    if md:
        return "```\n" + "\n".join(lines) + "\n```\n"
    return "\n".join(lines) + "\n"
