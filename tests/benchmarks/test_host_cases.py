"""benchmarks/host.py: every case runs with Gems on, is served, and agrees with ATen (CPU, interpreter)."""
import pytest
import torch

import gems
from benchmarks import host
from harness import DEVICE, assert_close, to_ref

# the slowest cases under the interpreter (big GEMMs, backward reductions) are exercised by the op tests
# (the "new length" cases differ between calls by design: test_new_length_cases_take_new_signatures)
_FAST = [c for c in host.CASES if not any(k in c[0] for k in ("linear", "bmm", "backward", "grads", "cat", "softmax",
                                                                  "foreach", "new length"))]


@pytest.mark.parametrize("name,setup,fn", _FAST, ids=[c[0] for c in _FAST])
def test_case_agrees_with_aten(name, setup, fn):
    torch.manual_seed(0)
    small = DEVICE == "cpu"
    dt = torch.float32 if small else torch.bfloat16
    args = setup(DEVICE, dt, small)
    inplace = "in-place" in name
    ref = fn(*[to_ref(a) if isinstance(a, torch.Tensor) else a for a in args])
    gems.reset_stats()
    with gems.use_gems():
        got = fn(*[a.clone() if inplace and isinstance(a, torch.Tensor) else a for a in args])
    st = gems.stats()
    assert not any(s["fallback"] for s in st.values()), st
    if any(k in name for k in ("multinomial", "dropout")):   # random: the same contract, not the same draws
        got, ref = (got if isinstance(got, tuple) else (got,)), (ref if isinstance(ref, tuple) else (ref,))
        assert [g.shape for g in got] == [r.shape for r in ref] and st, st     # (ref: float64 inputs)
        return
    if any(k in name for k in ("sort(", "topk(")):
        # equal values may come in either order (ATen's default sort is unstable; a row of 32000 random
        # fp32 logits holds a few ties): the values must agree, and each index must point at its value
        assert_close(got[0], ref[0], torch.float32)
        assert torch.equal(args[0].gather(-1, got[1]), got[0])
        return
    assert_close(got, ref, dt if dt != torch.float32 else torch.float32, rtol=2e-2 if not small else None)


def test_main_prints_a_table(capsys):
    assert host.main(["--device", DEVICE, "--calls", "1", "--rounds", "1", "--only", "x +"]) == 0
    out = capsys.readouterr().out
    assert "x + x" in out and "geomean ratio" in out


def test_foreach_cases_are_served(capsys):
    # the optimizer rows (their results are checked by tests/ops/test_foreach.py): served, no fallback
    assert host.main(["--device", DEVICE, "--calls", "1", "--rounds", "1", "--only", "foreach"]) == 0
    out = capsys.readouterr().out
    assert out.count("_foreach_") == 3 and "FELL BACK" not in out, out


def _at(length):
    """Lengths whose next call returns `length` (the one a call just used)."""
    same = host._Lengths()
    same.last = length - 1
    return same


@pytest.mark.parametrize("name,setup,fn", [c for c in host.CASES if "new length" in c[0]],
                         ids=[c[0] for c in host.CASES if "new length" in c[0]])
def test_new_length_cases_take_new_signatures(name, setup, fn):
    # each call reads a length the case has not used for NEW_LENGTHS calls: a new signature every call,
    # answered correctly (checked against float64 ATen at the same length)
    torch.manual_seed(0)
    dt = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    kv, x, n = setup(DEVICE, dt, DEVICE == "cpu")
    lengths = []
    for _ in range(3):
        with gems.use_gems():
            got = fn(kv, x, n)
        lengths.append(n.last)
        ref, aten = (fn(*args, _at(n.last)) for args in ((to_ref(kv), to_ref(x)), (kv, x)))
        # ATen's own result at the dtype: the attention rule (a 16-bit P before P V, as in flash
        # attention and cuDNN, costs up to 2^-9 |v| where values cancel); exact for the KV-cache cat
        assert_close(got, ref, dt, aten=aten)
    assert lengths == [1, 2, 3]
    n.last = host.NEW_LENGTHS
    assert n() == 1
