"""The verdict of a distributed run: per step, parity's end-to-end rule on the losses; what Gems did with
each op of the traced step (and inside FSDP2's custom ops); the Gems errors that fell back on a rank."""
from __future__ import annotations

import math
from typing import Optional

from .training import RunResult

# ATen ops that FSDP2's custom ops call inside (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, read
# in torch 2.13): they run below a dispatch mode, so the trace sees only the custom op; Gems would serve them
# at the backend key like any other call if it registered them (gems.stats() then counts them).
FSDP_INNER = {"fsdp::all_gather_copy_in.default": ("_foreach_copy_.default",),
              "fsdp::split_with_sizes_copy.default": ("split_with_sizes_copy.out",),
              "fsdp::chunk_cat.default": ("_chunk_cat.out",)}


def agreement(aten: RunResult, mine: RunResult, compute_dtype, ref: Optional[RunResult]) -> dict:
    """Per step, parity's end-to-end rule on the loss (see the module docstring)."""
    import torch
    from .. import parity as P
    tol = P.E2E_TOL.get(compute_dtype, P.E2E_TOL[torch.float32])
    rows = []
    for i, (a_, g_) in enumerate(zip(aten.losses, mine.losses)):
        a_t = torch.tensor([a_], dtype=torch.float64)
        g_t = torch.tensor([g_], dtype=torch.float64)
        _, rel, mx, _ = P.compare_e2e(g_t, a_t)
        ok = rel <= tol
        detail = f"rel err {rel:.2e} (tol {tol:.0e}, {str(compute_dtype).replace('torch.', '')})"
        if ref is not None:
            h = torch.tensor([ref.losses[i]], dtype=torch.float64)
            ok2, eg, ea = P.lowp_rule(g_t, a_t, h)
            detail += f"; vs fp32: Gems {eg:.2e}, ATen {ea:.2e}"
            ok = ok or ok2
        if not (math.isfinite(a_) and math.isfinite(g_)):
            ok = False
            detail = (f"non-finite loss (ATen {a_}, Gems {g_})" +
                      ("; ATen diverged too: nothing to compare (pure fp16 without loss scaling? use bf16 or "
                       "--mixed-precision)" if not math.isfinite(a_) else ""))
        ga, gg = aten.grad_norms[i], mine.grad_norms[i]
        rows.append({"step": i, "aten_loss": a_, "gems_loss": g_, "rel_err": rel, "tol": tol, "ok": bool(ok),
                     "detail": detail, "aten_grad_norm": ga, "gems_grad_norm": gg,
                     "grad_norm_rel_err": (abs(gg - ga) / abs(ga) if ga else abs(gg - ga))
                     if math.isfinite(ga) and math.isfinite(gg) else float("inf")})
    bad = [r["step"] for r in rows if not r["ok"]]
    return {
        "rule": "gems_coverage.parity end-to-end rule per step: |gems - aten| / |aten| <= E2E_TOL of the compute "
                "dtype" + ("; or Gems' error vs an fp32 ATen run <= 2x ATen's own + 1e-4" if ref else ""),
        "ok": not bad, "first_failing_step": bad[0] if bad else None, "failing_steps": len(bad),
        "max_rel_err": max((r["rel_err"] for r in rows), default=0.0),
        "grad_norm_max_rel_err": max((r["grad_norm_rel_err"] for r in rows), default=0.0),
        "steps": rows,
    }


def op_report(run: RunResult, registered: set, enabled: set, strategy: str) -> dict:
    """The traced step's ops across ranks: collectives, and per compute op what Gems did with it."""
    from .. import classify as C
    ops: dict = {}
    for rank, (tr, served) in enumerate(zip(run.trace, run.served)):
        for name, s in (tr or {}).items():
            o = ops.setdefault(name, {"op": name, "category": s["category"], "calls_per_rank": {}, "origins": {},
                                      "dtypes": set(), "example": s["example"]})
            o["calls_per_rank"][rank] = s["calls"]
            o["dtypes"] |= set(s["dtypes"])
            for k, v in s["origins"].items():
                o["origins"][k] = o["origins"].get(k, 0) + v
    collectives, compute, gaps = [], [], []
    for name, o in sorted(ops.items(), key=lambda kv: -sum(kv[1]["calls_per_rank"].values())):
        o["dtypes"] = sorted(o["dtypes"])
        if name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::")):
            collectives.append(o)
            continue
        if o["category"] != C.COMPUTE:
            continue
        fell, srv, reasons = 0, 0, {}
        for st in run.served:
            s = st.get(name)
            if s:
                srv += s["served"]
                fell += s["fallback"]
                for r, n in s["reasons"].items():
                    reasons[r] = reasons.get(r, 0) + n
        if name not in registered:
            o["gems"] = "not registered"
        elif name not in enabled:
            o["gems"] = "left to ATen by --include/--exclude"
        elif not srv and not fell:
            o["gems"] = "no call reached Gems"
        elif fell and not srv:
            o["gems"] = "fell back"
        elif fell:
            o["gems"] = "served, some calls fell back"
        else:
            o["gems"] = "served"
        o["fallback_reasons"] = reasons
        compute.append(o)
        if o["gems"] != "served" and not o["gems"].startswith("left to ATen"):
            gaps.append(o)
    for name, inner in FSDP_INNER.items():
        if name not in ops:
            continue
        o = ops[name]
        o["inner_aten_ops"] = {}
        for n in inner:
            srv = sum((st.get(n) or {}).get("served", 0) for st in run.served)
            state = ("not registered" if n not in registered else "left to ATen by --include/--exclude"
                     if n not in enabled else "served" if srv else "no call reached Gems")
            o["inner_aten_ops"][n] = state
            if state in ("not registered", "no call reached Gems"):
                gaps.append({"op": n, "category": C.COMPUTE, "gems": state, "origins": {strategy: 0},
                             "inside": name, "calls_per_rank": o["calls_per_rank"], "fallback_reasons": {},
                             "dtypes": o["dtypes"], "example": o["example"]})
    around = [o for o in compute if strategy in o["origins"]]
    wrapper = [{"op": o["op"], "category": o["category"], "calls": sum(o["calls_per_rank"].values()),
                "gems": o.get("gems", "collective" if o in collectives else "-"),
                **({"inner_aten_ops": o["inner_aten_ops"]} if "inner_aten_ops" in o else {})} for o in ops.values() if strategy in o["origins"] and o["category"] != C.VIEW]
    return {"traced": "step 0 of the Gems run, every rank (TorchDispatchMode: the ops the step dispatches; "
                      "ops inside DTensor and fsdp:: custom ops run below it)",
            "collectives": collectives, "compute": compute, "gaps": gaps,
            "around_collectives": around, "wrapper_ops": wrapper,
            "fallback_reasons_note": "fallback reasons are gems.stats() over the whole Gems run, all ranks",
            "served_compute_ops": sum(1 for o in compute if o["gems"].startswith("served")),
            "compute_ops": len(compute)}


def faults(run: RunResult) -> list:
    out = []
    for rank, st in enumerate(run.served):
        for name, s in st.items():
            errs = {r: n for r, n in s["reasons"].items() if r.startswith("gems error")}
            if errs:
                out.append({"rank": rank, "op": name, "reasons": errs, "fallback_calls": s["fallback"],
                            "served_calls": s["served"]})
    return out
