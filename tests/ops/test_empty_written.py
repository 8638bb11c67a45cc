"""Empty tensors written to (in place or as out=) whose strides repeat addresses (a 0 stride beside a
0-size dim): they have no elements, so ATen writes nothing and raises nothing. Gems' overlap rule
(gems.codegen.layout.internal_overlap, gems.ops.memory.has_internal_overlap) must skip them in every
family; an error there would reach the user under GEMS_STRICT (the suite sets it) and otherwise warn
and switch the signature off."""
from __future__ import annotations

import warnings

import pytest
import torch

import gems
from harness import DEVICE


def _empty_zero_strided(dtype=torch.float32):
    return torch.empty_strided((5, 1, 4, 0), (0, 0, 0, 1), dtype=dtype, device=DEVICE)


def _y(dtype=torch.float32):
    return torch.empty((5, 1, 4, 0), dtype=dtype, device=DEVICE)


def _mask():
    return torch.empty((5, 1, 4, 0), dtype=torch.bool, device=DEVICE)


# (label, call on the zero-strided empty x); each returns what the user gets back
CALLS = {
    "zero_": lambda x: x.zero_(),
    "fill_": lambda x: x.fill_(2.5),
    "sin_": lambda x: x.sin_(),
    "neg_": lambda x: x.neg_(),
    "exp_": lambda x: x.exp_(),
    "relu_": lambda x: x.relu_(),
    "sigmoid_": lambda x: x.sigmoid_(),
    "clamp_": lambda x: x.clamp_(0, 1),
    "clamp_min_": lambda x: x.clamp_min_(0.5),
    "add_ scalar": lambda x: x.add_(1.5),
    "mul_ tensor": lambda x: x.mul_(_y()),
    "addcmul_": lambda x: x.addcmul_(_y(), _y(), value=2.0),
    "lerp_": lambda x: x.lerp_(_y(), 0.5),
    "copy_": lambda x: x.copy_(_y()),
    "copy_ int": lambda x: x.copy_(_y(torch.int32)),
    "masked_fill_": lambda x: x.masked_fill_(_mask(), 1.0),
    "cumsum_": lambda x: x.cumsum_(-3),
    "cumsum out": lambda x: torch.cumsum(_y(), 0, out=x),
    "minimum out": lambda x: torch.minimum(x, _y(), out=x),
    "maximum out": lambda x: torch.maximum(_y(), _y(), out=x),
    "add out": lambda x: torch.add(_y(), _y(), alpha=2, out=x),
    "sin out": lambda x: torch.sin(_y(), out=x),
    "where out": lambda x: torch.where(_mask(), _y(), _y(), out=x),
    "tril_": lambda x: x.tril_(),
    "triu out": lambda x: torch.triu(_y(), out=x),
    "masked_scatter_": lambda x: x.masked_scatter_(_mask(), _y()),
    "index_fill_": lambda x: x.index_fill_(0, torch.tensor([1, 3], device=DEVICE), 2.0),
}


def _outcome(fn):
    x = _empty_zero_strided()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # Gems' "raised ...; ATen served the call" warning
        r = fn(x)
    return r, x


@pytest.mark.parametrize("label", list(CALLS))
def test_empty_zero_strided_output_like_aten(label):
    fn = CALLS[label]
    gems.disable()
    want, x = _outcome(fn)
    want_self = want is x
    gems.reset_stats()
    with gems.use_gems():
        for _ in range(2):   # the second call replays the first call's plan
            got, x = _outcome(fn)
            assert (got is x) == want_self
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    errors = {n: s["reasons"] for n, s in gems.stats().items() if any("gems error" in r for r in s["reasons"])}
    assert not errors, errors


@pytest.mark.parametrize("shape", [(2, 3, 0, 4), (2, 3, 4, 0)], ids=str)
@pytest.mark.parametrize("label", ["zero_", "neg_", "sin_", "clamp_", "add_ scalar"])
def test_empty_channels_last_written_like_aten(label, shape):
    # an empty channels_last tensor has a 0 stride beside its 0-size dim too
    fn = CALLS[label]

    def outcome():
        x = torch.empty(shape, device=DEVICE, memory_format=torch.channels_last)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            r = fn(x)
        return r is x, r.shape, r.stride()
    gems.disable()
    want = outcome()
    gems.reset_stats()
    with gems.use_gems():
        got = [outcome() for _ in range(3)]
    assert got == [want] * 3
    errors = {n: s["reasons"] for n, s in gems.stats().items() if any("gems error" in r for r in s["reasons"])}
    assert not errors, errors
