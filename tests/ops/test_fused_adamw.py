"""_fused_adamw_ (gems/ops/foreach/fused_adam.py): AdamW(fused=True) steps with Gems on against the same steps in
float64 (plain, weight decay, amsgrad, maximize, a tensor lr), one launch per call, grad_scale's
unscaled grads written back, found_inf == 1 leaving everything unchanged, and what goes to ATen."""
import pytest
import torch

import gems
from gems.ops.foreach import fused_adam
from gems.ops.foreach import launch as foreach
from harness import DEVICE, assert_close, count_launches, dtype_params, served, optimizer_steps

A = torch.ops.aten
# 0-dim, empty, odd sizes; with the tests' chunks of 32 elements, one to three chunks, and whole
# chunks only ((2, 32): no masked chunk)
PARAM_SHAPES = [(4, 7), (37,), (), (0,), (3, 2, 5), (70,), (2, 32)]


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setitem(foreach.CONFIGS, "interpreter", dict(BLOCK=16, CHUNK=32, num_warps=1))


def _steps(make_opt, dtype, steps, on):
    return optimizer_steps(make_opt, dtype, steps, on, PARAM_SHAPES, 4321)


OPTS = {
    "plain": dict(lr=1e-2, weight_decay=0.0),
    "decay": dict(lr=1e-2, weight_decay=0.05),
    "amsgrad": dict(lr=1e-2, weight_decay=0.01, amsgrad=True),
    "maximize": dict(lr=1e-2, weight_decay=0.01, maximize=True),
    "amsgrad-maximize-betas": dict(lr=3e-2, weight_decay=0.01, amsgrad=True, maximize=True, betas=(0.8, 0.99)),
    "tensor-lr": dict(lr="tensor", weight_decay=0.01),
}


@pytest.mark.parametrize("opt", list(OPTS))
@dtype_params()
def test_adamw_fused_steps(opt, dtype):
    kw = OPTS[opt]

    def make_opt(ps):
        k = dict(kw)
        if k["lr"] == "tensor":
            k["lr"] = torch.tensor(1e-2, device=ps[0].device)
        return torch.optim.AdamW(ps, fused=True, **k)
    name = "_fused_adamw_.tensor_lr" if kw["lr"] == "tensor" else "_fused_adamw_"
    gems.reset_stats()
    with served(name, at_least=3):
        got = _steps(make_opt, dtype, 3, True)
    st = gems.stats()
    assert not any(v["fallback"] for k, v in st.items() if k.startswith("_fused_adamw_")), st
    ref = _steps(make_opt, torch.float64, 3, False)
    aten = _steps(make_opt, dtype, 3, False)
    assert_close(got, ref, dtype, aten, msg=opt)


def _call_args(dtype, amsgrad=True, n_shapes=PARAM_SHAPES):
    g = torch.Generator().manual_seed(7)
    mk = lambda s, lo=-1.0: torch.empty(s, dtype=torch.float64).uniform_(lo, 1, generator=g).to(DEVICE, dtype)  # noqa: E731
    lists = [[mk(s) for s in n_shapes] for _ in range(2)]          # params, grads
    lists += [[mk(s) for s in n_shapes], [mk(s, 0.0) for s in n_shapes]]   # exp_avgs, exp_avg_sqs (>= 0)
    lists.append([mk(s, 0.0) for s in n_shapes] if amsgrad else [])
    steps = [torch.tensor(3.0, device=DEVICE) for _ in n_shapes]
    return lists, steps


def _run(lists, steps, **kw):
    kw = dict(dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=True, maximize=False), **kw)
    A._fused_adamw_(*lists, steps, **kw)


@dtype_params()
def test_grad_scale_and_found_inf(dtype):
    # grad_scale divides the grads (and the unscaled grads are written back, as ATen's kernel does)
    lists, steps = _call_args(dtype)
    ref = [[t.clone() for t in lst] for lst in lists]
    scale = torch.tensor(4.0, device=DEVICE)
    with served("_fused_adamw_"), gems.use_gems():
        _run(lists, steps, grad_scale=scale, found_inf=torch.tensor(0.0, device=DEVICE))
    _run(ref, steps, grad_scale=scale, found_inf=torch.tensor(0.0, device=DEVICE))
    assert_close([t for lst in lists for t in lst], [t for lst in ref for t in lst], dtype, msg="grad_scale")
    # found_inf == 1: nothing changes, grads included
    before = [[t.clone() for t in lst] for lst in lists]
    with served("_fused_adamw_"), gems.use_gems():
        _run(lists, steps, grad_scale=scale, found_inf=torch.tensor(1.0, device=DEVICE))
    for a, b in zip(lists, before):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_one_launch_per_call(monkeypatch):
    launches = count_launches(monkeypatch)
    lists, steps = _call_args(torch.float32)
    with served("_fused_adamw_"), gems.use_gems():
        _run(lists, steps)
    assert launches == [fused_adam.fused_adamw_kernel.name]


def test_fallbacks_stay_correct():
    # non-contiguous, overlapping written tensors: ATen, counted
    cases = []
    lists, steps = _call_args(torch.float32)
    lists[0][0] = torch.empty(7, 4, device=DEVICE).t().copy_(lists[0][0])
    lists[1][0] = torch.empty(7, 4, device=DEVICE).t().copy_(lists[1][0])
    cases.append((lists, steps, "non-contiguous"))
    lists, steps = _call_args(torch.float32)
    lists[3][1] = lists[2][1]
    cases.append((lists, steps, "overlapping"))
    for lists, steps, why in cases:
        ref = [[t.clone() for t in lst] for lst in lists]
        try:   # ATen's CUDA kernel rejects lists whose strides differ (its CPU loop takes them)
            _run(ref, steps)
            raised = None
        except RuntimeError as e:
            raised = type(e)
        gems.reset_stats()
        with gems.use_gems():
            if raised is None:
                _run(lists, steps)
            else:
                with pytest.raises(raised):
                    _run(lists, steps)
        st = gems.stats()["_fused_adamw_.default"]
        assert st["fallback"] == 1 and any(why in r for r in st["reasons"]), (why, st)
        if why != "overlapping" and raised is None:   # aliasing: ATen's result depends on its order
            for a, b in zip(lists, ref):
                for x, y in zip(a, b):
                    assert torch.equal(x, y), why
