"""multinomial, one sample per row (gems/ops/random/multinomial.py): the same distribution as ATen, not the
same bits, so the contract is tested: a chi-square statistic of many draws against p / sum(p) (a
sampler off by a few percent on a class fails it), zero-probability classes never drawn (also next to
subnormal probabilities), one-hot rows drawn exactly (row indexing), unnormalized weights, fp16,
non-contiguous (expanded, transposed) probabilities, rows longer than one block, reproducibility under
torch.manual_seed and a generator=, successive calls differ, out=, ATen's errors for invalid input,
fallbacks counted. The vocabulary split across programs: one-hot rows with the hot class in every split
and the last partial block, ties across splits to the smaller index, a chi-square over a split
vocabulary, and the draws against an independent float64 race with Philox uniforms at the documented
counters (each (row, class) its own uniform)."""
import math

import numpy as np
import pytest
import torch

import gems
from gems.ops.random import multinomial as gm
from harness import DEVICE, ON_GPU, dtype_params, make, served, raises_like_aten

mn = torch.multinomial
# draws per chi-square test (rows of one call): the interpreter runs Philox in numpy, slowly
DRAWS = 1500 if not ON_GPU else 200000
# the widest vocabulary block of this backend; VS classes: nine blocks and a partial tenth, which the
# wrapper splits over several programs per row (on the interpreter: 4 splits of up to 3 blocks)
BV = gm._CONFIGS["cuda" if ON_GPU else "interpreter"]["max_v"]
VS = 9 * BV + 12


def _draw(p, n=1, **kw):
    with served("multinomial.default"), gems.use_gems():
        return mn(p, n, **kw)


def chi2_bound(df, z=4.75):
    """Wilson-Hilferty: the chi-square quantile with upper tail ~1e-6 (z standard deviations)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts, p):
    """Pearson's statistic of the counts against probabilities p (classes with p > 0); df."""
    n = counts.sum().item()
    exp = p / p.sum() * n
    pos = p > 0
    return (((counts[pos] - exp[pos]) ** 2) / exp[pos]).sum().item(), int(pos.sum()) - 1


@dtype_params()
def test_distribution_chi_square(dtype):
    V, B = 37, DRAWS
    p = torch.rand(V, dtype=torch.float64) + 0.05
    p[[3, 17, 36]] = 0.0          # zero classes, the last one in the second vocabulary block
    p[5] = 0.004                  # a rare class
    probs = p.to(dtype).to(DEVICE)
    s = _draw(probs.expand(B, V))            # one call, B rows sharing one row of memory (stride 0)
    assert s.shape == (B, 1) and s.dtype == torch.int64
    counts = torch.bincount(s.flatten().cpu(), minlength=V).double()
    assert counts[[3, 17, 36]].sum() == 0, "a zero-probability class was drawn"
    stat, df = _chi2(counts, probs.cpu().double())
    assert stat < chi2_bound(df), f"chi-square {stat:.1f} with {df} degrees of freedom"


def test_detects_a_biased_sampler():
    # the statistic has the power the test relies on: ATen's draws pass, draws from a distribution off by
    # 5 percentage points on two classes fail (at the CPU run's number of draws)
    V, B = 10, 1500
    p = torch.linspace(1, 2, V, dtype=torch.float64)
    q = p / p.sum()
    q[0] += 0.05
    q[1] -= 0.05
    good = torch.bincount(mn(p.expand(B, V), 1).flatten(), minlength=V).double()
    bad = torch.bincount(mn(q.expand(B, V), 1).flatten(), minlength=V).double()
    assert _chi2(good, p)[0] < chi2_bound(V - 1) < _chi2(bad, p)[0]


def test_rows_are_their_own_distributions():
    # one-hot rows (times a random positive weight) must give their class exactly: row indexing, blocks
    B, V = 45, 70
    target = torch.randint(0, V, (B,))
    w = torch.zeros(B, V)
    w[torch.arange(B), target] = torch.rand(B) + 0.5
    w[0, :] = 0.0
    w[0, 66] = 1e-40              # a subnormal probability: p / E underflows, still beats zeros
    target[0] = 66
    s = _draw(w.to(DEVICE))
    assert torch.equal(s.flatten().cpu(), target)
    # the transposed layout (a column per row)
    s = _draw(w.t().contiguous().to(DEVICE).t())
    assert torch.equal(s.flatten().cpu(), target)
    # two classes per row: only those two ever appear
    w2 = torch.zeros(B, V)
    w2[:, 3] = 1.0
    w2[:, 60] = 3.0
    for _ in range(3):
        s = _draw(w2.to(DEVICE)).flatten().cpu()
        assert set(s.tolist()) <= {3, 60}


@dtype_params()
def test_one_d_and_unnormalized(dtype):
    w = make((300,), dtype, low=0.0, high=5.0)       # weights, not probabilities; 300 > one block
    s = _draw(w)
    assert s.shape == (1,) and 0 <= s.item() < 300
    torch.manual_seed(7)
    a = [_draw(w).item() for _ in range(6)]
    torch.manual_seed(7)
    b = [_draw(w).item() for _ in range(6)]
    assert a == b, "torch.manual_seed does not make the draws reproducible"
    assert len(set(a)) > 1, "successive calls drew the same class six times out of 300"
    # without replacement is the same for one sample
    assert _draw(w, replacement=True).shape == (1,)


def test_generator_argument():
    p = make((4, 50), low=0.1, high=1.0)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    a = _draw(p, generator=g)
    g.manual_seed(3)
    b = _draw(p, generator=g)
    assert torch.equal(a, b)
    c = _draw(p, generator=g)
    d = _draw(p, generator=g)
    assert not (torch.equal(a, c) and torch.equal(c, d)), "the generator's state did not advance"


def test_decode_pattern():
    # what sampling decoders call: softmax of top-k-masked logits [batch, vocab]
    logits = make((2, 500))
    kth = torch.topk(logits, 20).values[..., -1, None]
    masked = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(masked, -1)
    for _ in range(3):
        s = _draw(probs)
        assert (probs.gather(1, s) > 0).all(), "a token outside the top-k was drawn"


def test_out_variant():
    p = make((3, 40), low=0.1, high=1.0)
    out = torch.empty(0, dtype=torch.int64, device=DEVICE)
    with served("multinomial.out"), gems.use_gems():
        got = mn(p, 1, out=out)
    assert got is out and out.shape == (3, 1) and ((out >= 0) & (out < 40)).all()


def _value_rejects(dev):
    """Calls ATen rejects for their values (negative, inf, NaN; a row summing to 0), on `dev`."""
    t = lambda v, **k: torch.tensor(v, device=dev, **k)   # noqa: E731
    nan, inf = float("nan"), float("inf")
    return [lambda: mn(t([0.2, -0.1, 0.5]), 1),
            lambda: mn(t([0.2, inf]), 1),
            lambda: mn(t([[0.2, 0.3], [nan, 1.0]]), 1),
            lambda: mn(t([[0.2, 0.3], [0.0, 0.0]]), 1),              # a row summing to 0
            lambda: mn(t([[0.0, 0.0], [0.0, -1.0]]), 1),             # both: the bad value is reported
            lambda: mn(t([0.0, 0.0], dtype=torch.float16), 1)]


def _rejects():
    t = lambda v, **k: torch.tensor(v, device=DEVICE, **k)   # noqa: E731
    return [lambda: mn(t(1.0), 1),                                   # 0-dim
            lambda: mn(torch.ones(2, 3, 4, device=DEVICE), 1),       # 3-D
            lambda: mn(torch.ones(3, dtype=torch.long, device=DEVICE), 1),
            lambda: mn(torch.ones(3, device=DEVICE), 0),
            lambda: mn(torch.ones(2, 0, device=DEVICE), 1),
            lambda: mn(torch.ones(3, device=DEVICE), 1, out=torch.empty(1, dtype=torch.int32, device=DEVICE))]


def test_errors_like_aten():
    raises_like_aten(_rejects())
    if not ON_GPU:
        raises_like_aten(_value_rejects(DEVICE))
        return
    # ATen's CUDA kernel checks the values with a device-side assert, which ends the process's CUDA
    # context (docs/known-differences.md): Gems raises ATen's CPU error for the same call on the GPU
    for k, (cpu, gpu) in enumerate(zip(_value_rejects("cpu"), _value_rejects(DEVICE))):
        with pytest.raises(RuntimeError) as want:
            cpu()
        gems.reset_stats()
        try:
            with gems.use_gems():
                gpu()
        except Exception as e:   # noqa: BLE001 - compared below, with what Gems did (the stats)
            got = e
        else:
            raise AssertionError(f"case {k}: Gems accepted it")
        # (an implementation's RuntimeError makes the dispatcher run ATen, whose device-side assert
        # ended the CUDA context on an H100 before multinomial raised registry.AtenError)
        assert type(got) is RuntimeError and str(got).split("\n")[0] == str(want.value).split("\n")[0], \
            f"case {k}: {got!r}"
        # raised by Gems (registry.AtenError: neither served nor a fallback), ATen never ran it
        assert "multinomial.default" not in gems.stats()
        torch.cuda.synchronize()


def test_fallbacks_counted():
    gems.reset_stats()
    p = make((3, 6), low=0.1, high=1.0)
    with gems.use_gems():
        s = mn(p, 3)                        # more than one sample: ATen
        e = mn(torch.ones(0, 4, device=DEVICE), 1)
    assert s.shape == (3, 3) and e.shape == (0, 1)
    st = gems.stats()["multinomial.default"]
    assert st["fallback"] == 2 and "num_samples != 1" in st["reasons"]


def test_split_vocabulary_one_hot():
    # one-hot rows of a vocabulary split over programs: the hot class in every split, at block edges, in the
    # last partial block; the other splits see only zeros (or nothing), the combine must keep the hot one.
    # 70 rows: two row tiles on the interpreter, the second partial
    B, V = 70, VS
    edges = [0, 1, BV - 1, BV, 3 * BV + 5, 4 * BV - 1, 5 * BV, 7 * BV + 3, 9 * BV, 9 * BV + 7, V - 1]
    target = torch.randint(0, V, (B,))
    target[:len(edges)] = torch.tensor(edges)
    target[len(edges):2 * len(edges)] = torch.tensor(edges).flip(0)
    w = torch.zeros(B, V)
    w[torch.arange(B), target] = torch.rand(B) + 0.5
    w[1, :] = 0.0
    target[1] = V - 2
    for dtype, tiny in ((torch.float32, 1e-40), (torch.float16, 6e-8)):
        w[1, V - 2] = tiny        # subnormal, in the last block: still beats the zeros of the other splits
        s = _draw(w.to(dtype).to(DEVICE))
        assert torch.equal(s.flatten().cpu(), target), dtype
    s = _draw(w.t().contiguous().to(DEVICE).t())
    assert torch.equal(s.flatten().cpu(), target)


def test_ties_across_splits_go_to_the_smaller_index():
    # p = FLT_MAX: p / E overflows to +inf whenever E < 1 (probability 0.63 per class), so such classes tie
    # at +inf. Each row has 40 of them early in the vocabulary and 10 in the last partial block (another
    # split): the early group holds an inf score but with probability 0.37^40 ~ 5e-18, so the winner must
    # be in it; a combine that resolved ties toward the larger index or the later split picks the late group
    B, V = 32, VS
    fmax = torch.finfo(torch.float32).max
    w = torch.zeros(B, V)
    lows = []
    for r in range(B):
        lo = (r % 8) * BV + (r % 5) * 3
        w[r, lo:lo + 40] = fmax
        w[r, V - 10:] = fmax
        lows.append(lo)
    s = _draw(w.to(DEVICE)).flatten().cpu()
    for r in range(B):
        assert lows[r] <= s[r] < lows[r] + 40, f"row {r}: drew {s[r].item()}, the tie group is at {lows[r]}"
    # two finite classes, far apart (different splits): both drawn, with the right frequencies
    w2 = torch.zeros(V)
    w2[[BV + 2, V - 1]] = torch.tensor([1.0, 3.0])
    s = _draw(w2.to(DEVICE).expand(DRAWS // 2, V)).flatten().cpu()
    assert set(s.tolist()) <= {BV + 2, V - 1}
    counts = torch.bincount(s, minlength=V).double()
    stat, df = _chi2(counts, w2.double())
    assert stat < chi2_bound(df)


def test_chi_square_across_splits():
    # 40 positive classes spread over a vocabulary split over programs (the first and the last class
    # included), zeros between them
    V, B = VS, DRAWS
    p = torch.zeros(V, dtype=torch.float64)
    cls = torch.linspace(0, V - 1, 40).round().long()
    p[cls] = torch.rand(40, dtype=torch.float64) + 0.3
    s = _draw(p.float().to(DEVICE).expand(B, V))
    counts = torch.bincount(s.flatten().cpu(), minlength=V).double()
    assert counts[p == 0].sum() == 0, "a zero-probability class was drawn"
    stat, df = _chi2(counts, p)
    assert stat < chi2_bound(df), f"chi-square {stat:.1f} with {df} degrees of freedom"


_M32 = np.uint64(0xFFFFFFFF)


def _philox4x32_10(seed, ctr):
    """Philox4x32 with 10 rounds (Salmon et al., SC 2011): counter (ctr low, ctr high, 0, 0), key (seed
    low, seed high); ctr a numpy uint64 array. The 4 outputs as uint64 arrays holding 32-bit words."""
    c0, c1 = ctr & _M32, ctr >> np.uint64(32)
    c2 = c3 = np.zeros_like(ctr)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    for _ in range(10):
        m0 = np.uint64(0xD2511F53) * c0      # 32 x 32 -> 64-bit products
        m1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (m1 >> np.uint64(32)) ^ c1 ^ k0, m1 & _M32, (m0 >> np.uint64(32)) ^ c3 ^ k1, m0 & _M32
        k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
    return c0, c1, c2, c3


def _uniform(x):
    """Triton's uint32 -> [0, 1) float32: the word as int32, negatives folded (-x - 1), times 2^-31 (fp32)."""
    i = x.astype(np.uint32).view(np.int32).astype(np.int64)
    i = np.where(i < 0, -i - 1, i)
    return i.astype(np.float32) * np.float32(4.6566127342e-10)


def test_draws_match_an_independent_race():
    # the documented counter layout: class v of row b takes uniform j = (v % BV) // Q of counter
    # offset + b * C + (v // BV) * Q + v % Q (Q = BV / 4, C = cdiv(V, BV) * Q). Rebuilt here with an
    # independent Philox and the race in float64, compared draw for draw (rows whose best two scores lie
    # within 1e-5 are skipped: fp32 rounding may order them either way). Catches a uniform shared by two
    # (row, class) pairs, a wrong split range or combine, a wrong row tile.
    B, V = 70, VS                 # two row tiles on the interpreter
    Q = BV // 4
    C = -(-V // BV) * Q
    p = torch.rand(B, V, dtype=torch.float64)
    p[torch.rand(B, V) < 0.3] = 0.0
    p32 = p.float()
    for layout in ("contiguous", "transposed"):
        g = torch.Generator(device=DEVICE).manual_seed(1234)
        if ON_GPU:
            seed, offset = g.initial_seed() & 0x7FFFFFFFFFFFFFFF, g.get_offset()
        else:   # the wrapper draws the seed from the CPU generator
            ref = torch.Generator().manual_seed(1234)
            seed, offset = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64, generator=ref)), 0
        x = p32.to(DEVICE) if layout == "contiguous" else p32.t().contiguous().to(DEVICE).t()
        s = _draw(x, generator=g).flatten().cpu().numpy()
        v = np.arange(V)
        ctr = (offset + np.arange(B)[:, None] * C + (v // BV) * Q + v % Q).astype(np.uint64)
        words = _philox4x32_10(seed, ctr)
        j = (v % BV) // Q
        u = np.choose(np.broadcast_to(j, (B, V)), [_uniform(w) for w in words])
        e = -np.log((np.float32(1) - u).astype(np.float64))
        pn = p32.double().numpy()
        with np.errstate(divide="ignore"):
            score = np.where(pn > 0, np.where(e > 0, pn / e, np.inf), -1.0)
        top = np.sort(score, 1)[:, ::-1]
        clear = top[:, 0] > top[:, 1] * (1 + 1e-5)
        assert clear.sum() >= B - 2
        want = score.argmax(1)
        assert np.array_equal(s[clear], want[clear]), f"{layout}: {s[clear]} vs {want[clear]}"
