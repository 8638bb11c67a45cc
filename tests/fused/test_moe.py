"""gems.fused.moe_experts (routed SwiGLU experts as grouped GEMMs) against its per-expert PyTorch reference run
in float64, forward and backward (hidden, topk_weights, both weight tensors); fp16/bf16 by the flash-attention
rule (harness.assert_close with the reference computed at the low precision). Then gems.patching.moe: the
patched Mixtral / Qwen3-MoE / OLMoE block against the original block and model (outputs, router logits,
gradients of the input and of every Parameter), and the structures it must refuse."""
import pytest
import torch

import gems.fused as F
from gems.fused import moe, moe_grouped
from gems.patching.moe import GemsSparseMoeBlock, patch_moe_block
from harness import DEVICE, ON_GPU, assert_close, count_launches, dtype_params, to_ref

FP32_TOL = dict(rtol=1e-5, atol=1e-5)
E = 8


def _ids(T, k, E=E, empty=(3,), gen=None):
    """[T, k] distinct experts per token (as top-k gives), never an expert in `empty` (zero-token experts)."""
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    rows = [allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(T)]
    return torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)


def _inputs(T, h, I, k, dtype, E=E, gen=None):
    g = gen or torch.Generator().manual_seed(T * 131 + h * 7 + I + k)
    x = torch.empty(T, h, dtype=torch.float64).uniform_(-1, 1, generator=g)
    w = torch.empty(T, k, dtype=torch.float64).uniform_(0.1, 1, generator=g)
    wgu = torch.empty(E, 2 * I, h, dtype=torch.float64).uniform_(-1, 1, generator=g) / h ** 0.5
    wd = torch.empty(E, h, I, dtype=torch.float64).uniform_(-1, 1, generator=g) / I ** 0.5
    ids = _ids(T, k, E, gen=g)
    return [t.to(dtype).to(DEVICE) for t in (x, w, wgu, wd)], ids.to(DEVICE)


def _run(fn, leaves_in, ids, need=None, view=None, seed=1):
    need = need or [True] * len(leaves_in)
    leaves = [t.detach().clone().requires_grad_(r) for t, r in zip(leaves_in, need)]
    x, w, wgu, wd = view(*leaves) if view else leaves
    y = fn(x, ids, w, wgu, wd)
    gen = torch.Generator().manual_seed(seed)
    dy = torch.empty(y.shape, dtype=torch.float64).uniform_(-1, 1, generator=gen).to(y)
    req = [t for t in leaves if t.requires_grad]
    return y, (torch.autograd.grad(y, req, dy) if req else ())


def check(leaves, ids, dtype, need=None, view=None, fn=F.moe_experts):
    """Ours vs the reference in float64 (and, for 16-bit dtypes, the reference at `dtype` for the 2x rule)."""
    y, g = _run(fn, leaves, ids, need, view)
    ry, rg = _run(moe.reference_moe_experts, [to_ref(t) for t in leaves], to_ref(ids), need, view)
    assert y.dtype == leaves[0].dtype and y.shape == ry.shape
    if dtype == torch.float32:
        assert_close((y, g), (ry, rg), dtype, msg="moe", **FP32_TOL)
    else:
        ly, lg = _run(moe.reference_moe_experts, leaves, ids, need, view)
        assert_close((y, g), (ry, rg), dtype, (ly, lg), msg="moe", atol=1e-3)
    return y, g


CPU_CASES = [(1, 32, 48, 1), (1, 32, 48, 2), (37, 32, 48, 2), (37, 40, 24, 1), (64, 48, 32, 2), (19, 16, 16, 2)]
# (T, h, I, k[, E]): the last is Qwen3-MoE-like routing (many experts, k = 8)
GPU_CASES = [(512, 1024, 704, 2), (1000, 512, 1408, 2), (4096, 256, 512, 4), (2048, 256, 384, 8, 64)]


@dtype_params()
@pytest.mark.parametrize("case", CPU_CASES + (GPU_CASES if ON_GPU else []), ids=str)
def test_moe_experts(dtype, case):
    T, h, I, k, *e = case
    leaves, ids = _inputs(T, h, I, k, dtype, *e)
    check(leaves, ids, dtype)


@pytest.mark.parametrize("need", [(True, False, False, False), (False, True, False, False),
                                  (False, False, True, False), (False, False, False, True),
                                  (True, True, False, False)], ids=str)
def test_some_grads(need):
    leaves, ids = _inputs(21, 32, 40, 2, torch.float32)
    check(leaves, ids, torch.float32, need=list(need))


def test_separate_weights_and_strides():
    """(gate, up) pair, hidden a column slice of a wider tensor, weights as transposed views: no copies needed."""
    leaves, ids = _inputs(29, 32, 24, 2, torch.float32)
    x, w, wgu, wd = leaves
    wide = torch.cat([x, x[:, :5]], 1)                       # x = wide[:, :32], row stride 37
    wgu_t = wgu.transpose(1, 2).contiguous()                 # [E, h, 2I] storage, read as [E, 2I, h]
    wd_t = wd.transpose(1, 2).contiguous()

    def view(wide, w, wgu_t, wd_t):
        gu = wgu_t.transpose(1, 2)
        i = gu.shape[1] // 2
        return wide[:, :32], w, (gu[:, :i], gu[:, i:]), wd_t.transpose(1, 2)
    check([wide, w, wgu_t, wd_t], ids, torch.float32, view=view)


def test_zero_token_experts_and_sentinels():
    """Experts with no token get a zero weight gradient; ids outside [0, E) select nothing."""
    leaves, ids = _inputs(33, 32, 32, 2, torch.float32)
    ids = ids.clone()
    ids[::5, 0] = -1
    ids[1::7, 1] = E
    y, g = check(leaves, ids, torch.float32)
    assert not (ids == 3).any()
    assert torch.count_nonzero(g[2][3]) == 0 and torch.count_nonzero(g[3][3]) == 0
    assert torch.count_nonzero(g[2][0]) > 0


def test_int32_ids_and_noncontiguous_routing():
    """int32 ids and routing tensors that are column slices (as topk over a wider tensor can give)."""
    leaves, ids = _inputs(23, 32, 24, 2, torch.float32)
    wide_ids = torch.cat([ids, ids], 1).to(torch.int32)

    def view(x, w2, wgu, wd):
        return x, w2[:, ::2], wgu, wd
    w2 = torch.stack([leaves[1], leaves[1] + 1], 2).flatten(1)     # [T, 2k]: w2[:, ::2] is the weights
    leaves = [leaves[0], w2, leaves[2], leaves[3]]
    check(leaves, wide_ids[:, :2], torch.float32, view=view)


def test_all_tokens_one_expert_and_dy_broadcast():
    leaves, _ = _inputs(45, 32, 32, 1, torch.float32)
    ids = torch.full((45, 1), 6, dtype=torch.int64, device=DEVICE)
    y, g = check(leaves, ids, torch.float32)
    # a loss of y.sum() gives an expanded (stride-0) gradient
    x, w, wgu, wd = [t.detach().clone().requires_grad_() for t in leaves]
    F.moe_experts(x, ids, w, wgu, wd).sum().backward()
    rx, rw, rgu, rd = [to_ref(t).detach().requires_grad_() for t in leaves]
    moe.reference_moe_experts(rx, to_ref(ids), rw, rgu, rd).sum().backward()
    assert_close((x.grad, w.grad, wgu.grad, wd.grad), (rx.grad, rw.grad, rgu.grad, rd.grad), torch.float32,
                 **FP32_TOL)


def test_mixed_weight_dtype_and_no_grad():
    """topk_weights in fp32 with fp16 hidden (Mixtral's router returns fp32 weights); inference without a graph."""
    leaves, ids = _inputs(17, 32, 32, 2, torch.float16)
    leaves[1] = leaves[1].float()
    check(leaves, ids, torch.float16)
    with torch.no_grad():
        y = F.moe_experts(leaves[0], ids, *leaves[1:])
    ref = moe.reference_moe_experts(to_ref(leaves[0]), to_ref(ids), *[to_ref(t) for t in leaves[1:]])
    low = moe.reference_moe_experts(leaves[0], ids, *leaves[1:])
    assert_close(y, ref, torch.float16, low, atol=1e-3)


def test_one_launch_per_projection(monkeypatch):
    leaves, ids = _inputs(37, 32, 48, 2, torch.float32)
    names = count_launches(monkeypatch)
    x, w, wgu, wd = [t.detach().clone().requires_grad_() for t in leaves]
    y = F.moe_experts(x, ids, w, wgu, wd)
    assert sorted(names) == ["gate_up_kernel", "rows_mm_kernel", "tile_table_kernel"], names
    names.clear()
    y.backward(torch.ones_like(y))
    assert sorted(names) == ["down_bwd_kernel", "rows_mm_kernel", "wgrad_kernel", "wgrad_kernel"], names


def test_float64_and_empty_go_to_reference():
    leaves, ids = _inputs(9, 16, 16, 2, torch.float64)
    y = F.moe_experts(leaves[0], ids, *leaves[1:])
    assert torch.equal(y, moe.reference_moe_experts(leaves[0], ids, *leaves[1:]))
    x = torch.empty(0, 16, device=DEVICE, requires_grad=True)
    leaves, _ = _inputs(1, 16, 16, 2, torch.float32)
    y = F.moe_experts(x, torch.empty(0, 2, dtype=torch.int64, device=DEVICE), torch.empty(0, 2, device=DEVICE),
                      leaves[2], leaves[3])
    assert y.shape == (0, 16)


def test_rejects():
    leaves, ids = _inputs(5, 16, 16, 2, torch.float32)
    x, w, wgu, wd = leaves
    with pytest.raises(ValueError, match="dtype"):
        F.moe_experts(x.half(), ids, w, wgu, wd)
    with pytest.raises(ValueError, match="integer"):
        F.moe_experts(x, ids.float(), w, wgu, wd)
    with pytest.raises(ValueError, match="w_down"):
        F.moe_experts(x, ids, w, wgu, wd[:, :, :8])
    with pytest.raises(ValueError, match="2I"):
        F.moe_experts(x, ids, w, wgu[:, :31], wd)


# the torch grouped-GEMM path (moe_grouped.py): what `moe_experts` runs for bf16 on Hopper. Called directly
# here so the CPU suite checks its routing, combine and backward too (CPU torch has `_grouped_mm`); on the
# GPU only bf16, which its CUDA kernels take
GROUPED_DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", GROUPED_DTYPES, ids=str)
@pytest.mark.parametrize("case", [(1, 32, 48, 1), (37, 32, 48, 2), (19, 40, 24, 2), (64, 48, 32, 2)]
                         + ([(1000, 512, 1408, 2), (2048, 256, 384, 8, 64)] if ON_GPU else []), ids=str)
def test_grouped_path(dtype, case):
    T, h, I, k, *e = case
    leaves, ids = _inputs(T, h, I, k, dtype, *e)
    ids = ids.clone()
    ids[5::5, 0] = -1                # ids outside [0, E): no expert; expert 3 has no token
    ids[1::7, -1] = e[0] if e else E
    y, g = check(leaves, ids, dtype, fn=moe_grouped.moe_experts)
    assert torch.count_nonzero(g[2][3]) == 0 and torch.count_nonzero(g[3][3]) == 0


@pytest.mark.parametrize("need", [(True, False, False, False), (False, True, False, False),
                                  (False, False, True, False), (False, False, False, True)], ids=str)
def test_grouped_path_some_grads_and_strides(need):
    dtype = GROUPED_DTYPES[0]
    leaves, ids = _inputs(29, 32, 40, 2, dtype)

    def view(x, w, wgu, wd):      # a transposed hidden and column-sliced routing weights
        return x.t().contiguous().t(), w, wgu, wd
    check(leaves, ids, dtype, need=list(need), view=view, fn=moe_grouped.moe_experts)


def test_grouped_path_is_picked_for_bf16_on_hopper(monkeypatch):
    leaves, ids = _inputs(8, 32, 48, 2, torch.bfloat16)
    x, w, wgu, wd = leaves
    hopper = ON_GPU and torch.cuda.get_device_capability()[0] == 9
    assert moe_grouped.usable(x, wgu, wd) == (hopper and hasattr(torch, "_grouped_mm"))
    calls = []
    monkeypatch.setattr(moe_grouped, "usable", lambda *a: True)
    monkeypatch.setattr(moe_grouped, "moe_experts", lambda *a: calls.append(a) or a[0])
    F.moe_experts(x, ids, w, wgu, wd)
    assert not calls                                          # the default: Gems' Triton kernels
    F.moe_experts(x, ids, w, wgu, wd, gemm="torch")
    assert len(calls) == 1
    with pytest.raises(ValueError, match="gemm"):
        F.moe_experts(x, ids, w, wgu, wd, gemm="cublas")
    monkeypatch.undo()
    assert not moe_grouped.usable(x.float(), wgu.float(), wd.float())
    assert not moe_grouped.usable(x, None, wd)                    # a (gate, up) pair: the Triton kernels
    assert not moe_grouped.usable(x[:, :30], wgu[:, :, :30], wd[:, :30])    # rows not 16-byte aligned


@pytest.mark.skipif(not ON_GPU, reason="host synchronization is a CUDA notion")
def test_no_host_sync():
    leaves, ids = _inputs(256, 64, 64, 2, torch.bfloat16)
    x, w, wgu, wd = [t.detach().clone().requires_grad_() for t in leaves]
    F.moe_experts(x, ids, w, wgu, wd)          # first call: compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = F.moe_experts(x, ids, w, wgu, wd)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---------------------------------------------------------------------------------------- patched blocks
def _config(family, **kw):
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    common = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  vocab_size=64, max_position_embeddings=64, num_experts_per_tok=2)
    if family == "mixtral":
        cfg = MixtralConfig(intermediate_size=48, num_local_experts=E, **common)
    elif family == "qwen3_moe":
        cfg = Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_experts=E, norm_topk_prob=True,
                             head_dim=16, **common)
    else:
        cfg = OlmoeConfig(intermediate_size=40, num_experts=E, norm_topk_prob=False, **common)
    for key, v in kw.items():
        setattr(cfg, key, v)
    return cfg


def _block(family, dtype=torch.float32, **kw):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cls = {"mixtral": MixtralSparseMoeBlock, "qwen3_moe": Qwen3MoeSparseMoeBlock, "olmoe": OlmoeSparseMoeBlock}
    cfg = _config(family, **kw)
    b = cls[family](cfg)
    b.experts.config._experts_implementation = "eager"
    with torch.no_grad():
        for p in b.parameters():
            p.uniform_(-1, 1).div_(p.shape[-1] ** 0.5)
    return b.to(dtype).to(DEVICE)


FAMILIES = ["mixtral", "qwen3_moe", "olmoe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_block(family):
    block = _block(family)
    new = patch_moe_block(block)
    assert isinstance(new, GemsSparseMoeBlock)
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in block.named_parameters()]
    assert all(a is b for a, b in zip(new.parameters(), block.parameters()))
    x = torch.empty(2, 7, 32, dtype=torch.float64).uniform_(-1, 1).float().to(DEVICE)
    outs = []
    for m in (block, new):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y))
        outs.append((y.detach(), xi.grad, [p.grad.clone() for p in block.parameters()]))
        block.zero_grad(set_to_none=True)
    # the router's weight gets its gradient through topk_weights: compared too
    assert_close(outs[1], outs[0], torch.float32, rtol=1e-5, atol=1e-5, msg=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_router_logits(family):
    """A whole tiny model with the block swapped in: same logits, router logits and aux loss."""
    from transformers import MixtralForCausalLM, OlmoeForCausalLM, Qwen3MoeForCausalLM
    cls = {"mixtral": MixtralForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "olmoe": OlmoeForCausalLM}[family]
    torch.manual_seed(0)
    model = cls(_config(family, output_router_logits=True)).to(DEVICE).eval()
    ids = torch.randint(0, 64, (2, 9), device=DEVICE)
    ref = model(input_ids=ids, labels=ids)
    layer = model.model.layers[0]
    new = patch_moe_block(layer.mlp)
    assert new is not None
    layer.mlp = new
    out = model(input_ids=ids, labels=ids)
    assert len(out.router_logits) == len(ref.router_logits) == 1
    assert_close((out.logits, out.router_logits[0], out.aux_loss, out.loss),
                 (ref.logits, ref.router_logits[0], ref.aux_loss, ref.loss), torch.float32, rtol=1e-5, atol=1e-5)


def test_patch_option_picks_the_torch_gemm(monkeypatch):
    """gems.patch(model, moe_torch_gemm=True): the patched blocks call moe_experts with gemm="torch"."""
    import gems
    from transformers import MixtralForCausalLM
    model = MixtralForCausalLM(_config("mixtral", num_hidden_layers=2)).to(DEVICE)
    seen = []
    real = F.moe_experts
    monkeypatch.setattr(F, "moe_experts", lambda *a, **kw: seen.append(kw.get("gemm")) or real(*a, **kw))
    ids = torch.randint(0, 64, (1, 5), device=DEVICE)
    for on in (False, True):
        with gems.patched(model, moe_torch_gemm=on) as report:
            assert report.options["moe_torch_gemm"] is on and report.counts()["moe"] == 2
            model(input_ids=ids)
    assert seen == ["triton", "triton", "torch", "torch"]


def test_mixtral_jitter_in_training():
    block = _block("mixtral", router_jitter_noise=0.1).train()
    block.jitter_noise = 0.1
    new = patch_moe_block(block)
    x = torch.empty(1, 5, 32).uniform_(-1, 1).to(DEVICE)
    torch.manual_seed(3)
    ref = block(x.clone())
    torch.manual_seed(3)
    got = new(x.clone())
    assert_close(got, ref.double(), torch.float32, rtol=1e-5, atol=1e-5)


def test_refused_structures():
    block = _block("olmoe")

    class Sub(type(block)):
        pass
    sub = Sub.__new__(Sub)
    sub.__dict__.update(block.__dict__)
    assert patch_moe_block(sub) is None
    assert patch_moe_block(torch.nn.Linear(2, 2)) is None

    b = _block("qwen3_moe")
    b.experts.act_fn = torch.nn.GELU()
    assert patch_moe_block(b) is None

    b = _block("mixtral")
    b.experts.register_forward_hook(lambda *a: None)
    assert patch_moe_block(b) is None

    b = _block("mixtral")
    b.experts.config._experts_implementation = "someone_elses_kernel"
    assert patch_moe_block(b) is None

    b = _block("mixtral")
    b.experts.is_transposed = True
    assert patch_moe_block(b) is None
    assert patch_moe_block(_block("mixtral")) is not None
