import pytest
import torch
import torch.nn.functional as F

import gems
from gems.ops.shape import embedding as emb_mod
from harness import DEVICE, ON_GPU, assert_close, check_grad, check_op, dtype_params, layouts, make, served

# the interpreter's backward cuts sorted positions into chunks of this many; the index lists below
# hold runs shorter than, equal to, and spanning several chunks
CHUNK = emb_mod._CHUNK["cuda" if DEVICE == "cuda" else "interpreter"]


def idx(shape, V, dtype=torch.int64):
    return torch.randint(0, V, shape, dtype=dtype).to(DEVICE)


def runs_indices(V, dtype=torch.int64):
    """Indices with runs of every interesting length once sorted (1, CHUNK, several chunks), shuffled."""
    parts = [torch.full((n,), v) for v, n in [(1, 1), (3, CHUNK), (4, 3 * CHUNK + 1), (0, 2), (V - 1, CHUNK + 1),
                                              (5, 2 * CHUNK + 1)]]
    t = torch.cat(parts)
    return t[torch.randperm(t.numel())].to(dtype).to(DEVICE)


@dtype_params()
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 2)], ids=str)
@pytest.mark.parametrize("itype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_forward(shape, itype, dtype):
    w = make((13, 37), dtype)
    check_op(F.embedding, (idx(shape, 13, itype), w), dtype=dtype, served_ops=["embedding"])


@dtype_params()
def test_forward_layouts(dtype):
    # non-contiguous tables (transposed, step-sliced, expanded) and index tensors
    for name, w in layouts((11, 20), dtype):
        check_op(F.embedding, (idx((6,), 11), w), dtype=dtype, served_ops=["embedding"])
    i = idx((4, 6), 11)
    check_op(F.embedding, (i.t(), make((11, 20), dtype)), dtype=dtype, served_ops=["embedding"])
    check_op(F.embedding, (i[:, ::2], make((11, 20), dtype)), dtype=dtype, served_ops=["embedding"])
    # rows wider than one column block, padding_idx (forward ignores it)
    check_op(F.embedding, (idx((3,), 7), make((7, 2100), dtype)), {"padding_idx": 2}, dtype=dtype,
             served_ops=["embedding"])


def test_forward_bf16_copy():
    # a gather moves bits only, so bf16 is exact; the interpreter backend leaves every bf16 call to
    # ATen (its casts truncate), so only the GPU serves it
    w = make((9, 16), torch.bfloat16)
    i = idx((7,), 9)
    with served("embedding", at_least=int(ON_GPU)), gems.use_gems():
        out = F.embedding(i, w)
    assert torch.equal(out.cpu(), w.cpu()[i.cpu()])


def test_forward_out_empty_and_errors():
    w = make((10, 6))
    i = idx((2, 3), 10)
    with gems.use_gems():
        out = torch.full((2, 3, 6), float("nan"), device=DEVICE)
        with served("embedding.out"):
            torch.ops.aten.embedding.out(w, i, out=out)
        assert torch.equal(out.cpu(), w.cpu()[i.cpu()])
        wrong = torch.full((4,), float("nan"), device=DEVICE)
        with served("embedding.out"), pytest.warns(UserWarning, match="resized"):
            torch.ops.aten.embedding.out(w, i, out=wrong)
        assert torch.equal(wrong.cpu(), w.cpu()[i.cpu()])
        assert F.embedding(idx((0, 4), 10), w).shape == (0, 4, 6)
        assert F.embedding(idx((3,), 10), make((10, 0))).shape == (3, 0)
        with pytest.raises(RuntimeError):
            F.embedding(torch.tensor([1.0, 2.0], device=DEVICE), w)   # float indices
        with pytest.raises(RuntimeError):
            torch.embedding(make((10,)), i)                            # 1-D weight
        if DEVICE == "cpu":  # CUDA reports out-of-range indices with a device-side assert (no host sync)
            with pytest.raises(IndexError):
                F.embedding(torch.tensor([0, 10], device=DEVICE), w)
            with pytest.raises(IndexError):
                F.embedding(torch.tensor([-1], device=DEVICE), w)


def test_forward_fallback():
    gems.reset_stats()
    w = make((8, 5), torch.float64)
    i = idx((4,), 8)
    with gems.use_gems():
        out = F.embedding(i, w)
    assert torch.equal(out, w[i])
    st = gems.stats()["embedding.default"]
    assert st["fallback"] == 1 and st["served"] == 0


@pytest.fixture(params=["few", "sorted"])
def bwd_path(request, monkeypatch):
    """Run the backward through its few-indices kernel (every test list here is short) or through the
    sort / bounds / chunk kernels. Plans recorded on the other path are dropped before and after."""
    impls = [gems.registry.get(n) for n in ("embedding_dense_backward", "embedding_dense_backward.out")]
    monkeypatch.setattr(emb_mod, "_FEW", 1 << 20 if request.param == "few" else 0)
    for impl in impls:
        impl.set_fn(impl.fn)
    yield request.param
    for impl in impls:
        impl.set_fn(impl.fn)


@dtype_params()
@pytest.mark.parametrize("padding_idx", [None, 4, 0], ids=["nopad", "pad4", "pad0"])
@pytest.mark.parametrize("scale", [False, True], ids=["sum", "freq"])
def test_backward(padding_idx, scale, dtype, bwd_path):
    V = 9
    i = runs_indices(V).reshape(2, -1)
    fn = lambda w, i: F.embedding(i, w, padding_idx=padding_idx, scale_grad_by_freq=scale)  # noqa: E731
    check_grad(fn, [make((V, 21), dtype), i], dtype=dtype, served_ops=["embedding", "embedding_dense_backward"])


@dtype_params()
def test_backward_shapes(dtype, bwd_path):
    # random indices (mostly short runs, untouched rows), int32 indices, a wide row (several column blocks)
    fn = lambda w, i: F.embedding(i, w)  # noqa: E731
    check_grad(fn, [make((17, 7), dtype), idx((3, 5), 17)], dtype=dtype, served_ops=["embedding_dense_backward"])
    check_grad(fn, [make((6, 5), dtype), runs_indices(6, torch.int32)], dtype=dtype,
               served_ops=["embedding_dense_backward"])
    check_grad(fn, [make((5, 1500), dtype), idx((11,), 5)], dtype=dtype, served_ops=["embedding_dense_backward"])
    check_grad(fn, [make((4, 3), dtype), idx((), 4)], dtype=dtype, served_ops=["embedding_dense_backward"])


@dtype_params()
def test_dense_backward_direct(dtype, bwd_path):
    V, D = 12, 10
    i = runs_indices(V)
    n = i.numel()
    # a non-contiguous gradient (transposed storage) is read through its strides
    g = make((D, n), dtype).t()
    for pad, scale in [(-1, False), (3, True), (V - 1, False)]:
        check_op(torch.ops.aten.embedding_dense_backward, (g, i, V, pad, scale), dtype=dtype,
                 served_ops=["embedding_dense_backward"])
    # a broadcast gradient (stride 0 rows), as sum().backward() produces
    check_op(torch.ops.aten.embedding_dense_backward, (make((1, D), dtype).expand(n, D), i, V, -1, False),
             dtype=dtype, served_ops=["embedding_dense_backward"])


def test_dense_backward_deterministic_out_empty(bwd_path):
    V, D = 7, 9
    i = runs_indices(V)
    g = make((i.numel(), D))
    op = torch.ops.aten.embedding_dense_backward
    with served("embedding_dense_backward", at_least=2), gems.use_gems():
        r1 = op(g, i, V, -1, False)
        r2 = op(g, i, V, -1, False)
    assert torch.equal(r1, r2)
    with gems.use_gems():
        out = torch.full((V, D), float("nan"), device=DEVICE)
        with served("embedding_dense_backward.out"):
            op.out(g, i, V, 2, True, out=out)
        assert_close(out, op(g.double().cpu(), i.cpu(), V, 2, True), torch.float32)
        wrong = torch.full((3,), float("nan"), device=DEVICE)
        with pytest.warns(UserWarning, match="resized"):
            op.out(g, i, V, -1, False, out=wrong)
        assert_close(wrong, op(g.double().cpu(), i.cpu(), V, -1, False), torch.float32)
        # no indices: an all-zero gradient (every row written by the row kernel)
        with served("embedding_dense_backward"):
            z = op(make((0, D)), idx((0,), V), V, -1, False)
        assert torch.equal(z.cpu(), torch.zeros(V, D))
        with pytest.raises(RuntimeError):
            op(g, i.float(), V, -1, False)
        with pytest.raises(RuntimeError):
            op(make((i.numel() + 1, D)), i, V, -1, False)



@pytest.mark.parametrize("int32", [False, True], ids=["int64", "int32"])
def test_dense_backward_sorts_in_a_kernel_and_plans(int32, monkeypatch):
    # up to _SORT_MAX indices the sort and run bounds are Gems kernels, so the call gets a plan (a
    # torch.sort inside would keep it on the full host path); beyond it torch.sort, same result
    V, D = 13, 6
    i = runs_indices(V, torch.int32 if int32 else torch.int64)
    g = make((i.numel(), D))
    op = torch.ops.aten.embedding_dense_backward
    monkeypatch.setattr(emb_mod, "_FEW", 0)    # this short list would take the one-kernel path
    impl = gems.registry.get("embedding_dense_backward")
    impl.set_fn(impl.fn)                        # no plan recorded on that path for this signature
    ref = op(g.double().cpu(), i.cpu(), V, 4, True)
    # plan statistics are per process (other tests' signatures count too): compare before and after
    before = gems.dispatch.op_runtime(impl.name).plans.info() if gems.dispatch.op_runtime(impl.name).plans is not None else {"plans": 0, "reasons": {}}
    with gems.use_gems():
        for _ in range(3):
            assert_close(op(g, i, V, 4, True), ref, torch.float32)
    info = gems.dispatch.plan_stats()["embedding_dense_backward.default"]
    assert info["plans"] == before["plans"] + 1 and info["reasons"] == before["reasons"], (before, info)
    monkeypatch.setattr(emb_mod, "_SORT_MAX", 4)
    with served("embedding_dense_backward"), gems.use_gems():
        assert_close(op(g[:-1], i[:-1], V, -1, False), op(g.double().cpu()[:-1], i.cpu()[:-1], V, -1, False),
                     torch.float32)
    impl.set_fn(impl.fn)


@dtype_params()
def test_dense_backward_paths_by_count(dtype):
    # the default threshold: a few indices take the one-kernel path, more take the sorted path; both
    # against float64, with repeated indices and a wide row
    op = torch.ops.aten.embedding_dense_backward
    for n in (emb_mod._FEW, emb_mod._FEW + 1, 3 * emb_mod._FEW):
        i = idx((n,), 9)
        g = make((n, 130), dtype)
        check_op(op, (g, i, 9, 2, False), dtype=dtype, served_ops=["embedding_dense_backward"])


@pytest.mark.parametrize("sort_max", [None, 4], ids=["sort-kernel", "torch-sort"])
def test_dense_backward_queues_each_launch_it_makes_ahead(sort_max, monkeypatch):
    # with background compilation every kernel of the sorted path is handed over before the first
    # launch (each reads the last one's output: a deferred call would otherwise meet one per step);
    # what is handed over must be exactly what is launched, or the queued compile is of no use
    from gems.runtime import launch, plan
    if sort_max is not None:
        monkeypatch.setattr(emb_mod, "_SORT_MAX", sort_max)
    monkeypatch.setattr(emb_mod, "_FEW", 0)    # this short list would take the one-kernel path
    ahead, launched = [], []
    run, queue = launch.LaunchCache.run, launch.LaunchCache.ahead

    def recording_run(self, grid, args, num_warps=4, *rest):
        # while a call plan records (on the GPU) run() re-enters itself once for the real launch: the
        # inner call is the launch
        if self.name.startswith("embedding_bwd") and (plan.active() is None or self.interpreted):
            launched.append((self.name, args, num_warps))
        return run(self, grid, args, num_warps, *rest)

    def recording_ahead(self, args, num_warps=4, *rest):
        ahead.append((self.name, args, num_warps))
        assert not launched, "handed over after a launch"
        return queue(self, args, num_warps, *rest)
    monkeypatch.setattr(launch.LaunchCache, "run", recording_run)
    monkeypatch.setattr(launch.LaunchCache, "ahead", recording_ahead)
    V, D = 13, 6
    i = runs_indices(V)
    g = make((i.numel(), D))
    op = torch.ops.aten.embedding_dense_backward
    impl = gems.registry.get("embedding_dense_backward")
    impl.set_fn(impl.fn)                        # the signature's first call: the implementation runs
    with served("embedding_dense_backward"), gems.use_gems():
        out = op(g, i, V, -1, False)
    impl.set_fn(impl.fn)
    assert_close(out, op(g.double().cpu(), i.cpu(), V, -1, False), torch.float32)
    names = [a[0] for a in ahead]
    assert names == (["embedding_bwd_chunks", "embedding_bwd_rows"] if sort_max else
                     ["embedding_bwd_sort", "embedding_bwd_bounds", "embedding_bwd_chunks", "embedding_bwd_rows"])
    assert len(launched) == len(ahead)
    for (n1, a1, w1), (n2, a2, w2) in zip(ahead, launched):
        assert n1 == n2 and w1 == w2 and len(a1) == len(a2)
        assert all(x is y or (not isinstance(x, torch.Tensor) and x == y) for x, y in zip(a1, a2)), n1
