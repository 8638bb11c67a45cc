"""Signature-level decisions for ATen (`Unsupported(reason, signature=True)`): recorded as the
signature's plan, so repeat calls go straight to ATen's kernel (from C++ on the fast path), counted as
fallbacks with the reason. The GEMM uses it for buckets where cuBLAS was measured faster than every
Triton config (docs/design.md, decision 12); GEMS_GEMM=triton turns that off."""
import os

import pytest
import torch

import gems
from gems import registry
from gems.runtime import settings
from gems.ops.blas import matmul as blas
from harness import DEVICE, assert_close, make, to_ref

_FAST = os.environ.get("GEMS_FAST", "1") not in ("", "0") and settings.PLANS


class _Tuner:
    """Stands in for the GEMM autotuner: every bucket answers `cfg`; counts the picks."""

    def __init__(self, cfg):
        self.cfg, self.picks = cfg, 0

    def pick(self, bucket, bench):
        self.picks += 1
        return self.cfg


@pytest.fixture
def aten_bucket(monkeypatch):
    tuner = _Tuner({"aten": True})
    monkeypatch.setattr(blas, "_tuner", lambda itemsize, triton_only=False: tuner)
    # small problems skip tuning on the GPU: make every size a tuned one for this test
    monkeypatch.setattr(blas, "TUNE_MIN_MACS", 0)
    impl = registry.get("mm.default")
    impl.set_fn(impl.fn)      # drop plans recorded by other tests for these signatures
    gems.reset_stats()
    yield tuner
    impl.set_fn(impl.fn)      # the recorded ATen decisions belonged to the stand-in tuner


def test_an_aten_bucket_is_recorded_once_and_replayed(aten_bucket):
    a, b = make((40, 24)), make((24, 17))     # M > 32: the tuned path on the GPU too
    with gems.use_gems():
        outs = [torch.mm(a, b) for _ in range(4)]
    for o in outs:
        assert_close(o, to_ref(a) @ to_ref(b), torch.float32)
    # the implementation decided once; the three repeats never reached it
    assert aten_bucket.picks == 1
    st = gems.stats()["mm.default"]
    assert st["served"] == 0 and st["fallback"] == 4, st
    assert st["reasons"] == {blas.ATEN_FASTER: 4}, st
    ps = gems.plan_stats()["mm.default"]
    assert ps["aten"] == 1 and ps["plans"] == 0, ps
    if _FAST:
        assert ps["fast_plans"] == 1, ps   # later calls were replayed as ATen from C++


def test_other_signatures_still_decide_for_themselves(aten_bucket):
    aten_bucket.cfg = blas.INTERP_CONFIG if DEVICE == "cpu" else blas._CONFIGS_16[0]
    a, b = make((33, 20)), make((20, 9))
    with gems.use_gems():
        c = torch.mm(a, b)
    assert_close(c, to_ref(a) @ to_ref(b), torch.float32)
    assert gems.stats()["mm.default"]["served"] == 1


def test_inplace_addmm_goes_to_aten_untouched(aten_bucket):
    bias, a, b = make((40, 12)), make((40, 7)), make((7, 12))     # M > 32: the tuned path on the GPU too
    want = 0.5 * to_ref(bias) + 2.0 * (to_ref(a) @ to_ref(b))
    with gems.use_gems():
        bias.addmm_(a, b, beta=0.5, alpha=2.0)
    assert_close(bias, want, torch.float32)
    assert gems.stats()["addmm_.default"]["reasons"] == {blas.ATEN_FASTER: 1}


@pytest.mark.parametrize("case", ["mm", "addmm", "bmm", "baddbmm_alpha", "bmm_bias"])
def test_the_aten_candidate_computes_what_the_kernel_computes(case):
    # the timed ATen candidate must be the same product, or the comparison means nothing
    batched = case.startswith("b")
    a = make((3, 9, 5) if batched else (9, 5))
    b = make((3, 5, 7) if batched else (5, 7))
    bias = make((3, 9, 7) if batched else (9, 7)) if case in ("addmm", "bmm_bias") else None
    alpha, beta = (0.5, 1.5) if case in ("addmm", "baddbmm_alpha", "bmm_bias") else (1.0, 1.0)
    out = torch.empty(a.shape[:-1] + b.shape[-1:], device=a.device)
    blas._aten_gemm(a, b, bias, alpha, beta, out)
    want = alpha * (to_ref(a) @ to_ref(b)) + (beta * to_ref(bias) if bias is not None else 0)
    assert_close(out, want, torch.float32)


def test_gemm_policy_values():
    assert blas._parse_policy("triton") == "triton"
    assert blas._parse_policy(" AUTO ") == "auto"
    assert blas._parse_policy("") == "auto"
    with pytest.raises(ValueError, match="GEMS_GEMM"):
        blas._parse_policy("cublas")


def test_triton_policy_has_no_aten_candidate(monkeypatch):
    monkeypatch.setattr(blas, "_TUNERS", {})
    monkeypatch.setattr(blas, "backend", lambda: type("B", (), {"name": "cuda"})())
    before = blas.gemm_policy()
    try:
        blas.set_gemm_policy("triton")
        t = blas._tuner(2)
        # "dqw": the Gluon deep, wave and wide tiles in the search space (blas.CANDIDATES, on by default)
        assert t.name == "mm16v4dqw" and not any(c.get("aten") for c in t.configs)
        blas.set_gemm_policy("auto")
        t = blas._tuner(2)
        assert t.name == "mm16v4dqw-auto2" and t.configs[-1] == {"aten": True}
        # the interpreter cannot time kernels: it takes the first config, never ATen
        assert not t.configs[0].get("aten")
    finally:
        blas.set_gemm_policy(before)


def test_switching_the_policy_drops_recorded_aten_decisions(aten_bucket):
    a, b = make((40, 24)), make((24, 17))
    with gems.use_gems():
        torch.mm(a, b)
    assert gems.plan_stats()["mm.default"]["aten"] == 1
    before = blas.gemm_policy()
    try:
        blas.set_gemm_policy("triton")
        assert gems.plan_stats().get("mm.default", {}).get("aten", 0) == 0
    finally:
        blas.set_gemm_policy(before)


def test_aten_candidate_carries_its_host_cost(monkeypatch):
    # ATen's GEMM is timed on the device, plus _ATEN_HOST_MS for the host time a cuBLAS call costs
    # beyond a Triton launch where that matters (device time under _HOST_BOUND_MS): equal device times
    # leave such a bucket to Triton; a large GEMM is judged by device time alone
    seen = {}

    class Timing(_Tuner):
        def pick(self, bucket, bench):
            seen["triton"], seen["aten"] = bench(self.cfg), bench(blas._ATEN)
            return self.cfg

    cfg = blas.INTERP_CONFIG if DEVICE == "cpu" else blas._CONFIGS_16[0]
    monkeypatch.setattr(blas, "_tuner", lambda itemsize, triton_only=False: Timing(cfg))
    monkeypatch.setattr(blas, "TUNE_MIN_MACS", 0)
    monkeypatch.setattr(blas, "bench_ms", lambda fn: 0.020)
    impl = registry.get("mm.default")
    impl.set_fn(impl.fn)
    a, b = make((40, 24)), make((24, 17))
    try:
        with gems.use_gems():
            got = torch.mm(a, b)
    finally:
        impl.set_fn(impl.fn)
    assert seen["aten"] == pytest.approx(0.020 + blas._ATEN_HOST_MS) and seen["triton"] == 0.020
    assert blas._aten_time(0.5) == 0.5
    assert_close(got, to_ref(a) @ to_ref(b), torch.float32)


def test_dispatcher_checks_record_aten_plans():
    # the dispatcher's own checks that the signature decides (here: a dtype the overload does not
    # declare) are recorded as ATen plans too: the repeats skip the Python kernel
    impl = registry.get("silu.default")
    impl.set_fn(impl.fn)
    x = make((4, 6)).to(torch.float64)
    gems.reset_stats()
    with gems.use_gems():
        outs = [torch.nn.functional.silu(x) for _ in range(3)]
    for o in outs:
        assert_close(o, torch.nn.functional.silu(to_ref(x)), torch.float64)
    st = gems.stats()["silu.default"]
    assert st["fallback"] == 3 and st["reasons"] == {"dtype torch.float64": 3}, st
    ps = gems.plan_stats()["silu.default"]
    assert ps["aten"] >= 1, ps
    if _FAST:
        # the first call went through the Python kernel, the two repeats were replayed from C++
        assert gems.dispatch.op_runtime(impl.name).counts[1] == 1 and ps["fast_plans"] >= 1, (gems.dispatch.op_runtime(impl.name).counts, ps)
