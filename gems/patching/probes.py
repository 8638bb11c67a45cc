"""The proofs behind `gems.patch`'s structural walk: each function takes a module that looks like
something `gems.fused` serves and answers whether the fused op computes what the module's own forward
computes, by running that forward on small random inputs against a plain-PyTorch computation of the
fused op's semantics (the `reference_*` functions beside each fused op). The answer is the parameters
the replacement needs, or a string saying why not (the report lists it).

Why numerical checks rather than class names: a family's code is copied and edited (Gemma's ``1 + w``,
OLMo2's one rounding, GLM4's interleaved rotary, Granite's scaled logits); the same class name or
attribute layout does not mean the same computation, and a checked forward is one.

Inputs are chosen so that the alternatives differ by far more than the tolerance: RMSNorm rows of
magnitudes 1, 1e-3 (where eps matters) and 10, in fp32 and bf16 (the casting rules differ only in how
often bf16 rounds) and with an fp32 weight on a bf16 input (the result's dtype differs); activations
on [-6, 6]; an MLP on a random input where swapping gate and up changes the result at O(1).
"""
from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as TF
from torch import nn
from torch.overrides import TorchFunctionMode

_NO_EPS = "no float eps attribute (variance_epsilon / eps)"


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _close(a, b, rtol, atol) -> bool:
    return (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype
            and torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol))


def _one_tensor_forward(m) -> bool:
    try:
        params = [p for p in inspect.signature(type(m).forward).parameters.values()][1:]
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


# ------------------------------------------------------------------------------------------- RMSNorm
RMS_CANDIDATES = (("llama", 0.0), ("gemma", 1.0), ("gemma", 0.0), ("llama", 1.0))


def rms_eps(m):
    for name in ("variance_epsilon", "eps"):
        v = getattr(m, name, None)
        if isinstance(v, float):
            return v
    return None


def looks_like_rms_norm(m) -> bool:
    """RMSNorm-like: a 1-D weight Parameter, no other parameter or buffer (no bias, no running stats),
    not nn.LayerNorm, and an RMSNorm class name or an eps attribute."""
    if isinstance(m, (nn.LayerNorm, nn.GroupNorm)) or type(m).__name__.startswith("Gems"):
        return False
    w = getattr(m, "weight", None)
    if not (isinstance(w, nn.Parameter) and w.dim() == 1):
        return False
    if len(list(m.parameters())) != 1 or list(m.buffers()):
        return False
    return "rmsnorm" in type(m).__name__.lower() or rms_eps(m) is not None


def prove_rms_norm(m):
    """(casting, offset, eps) such that gems.fused.rms_norm(x, m.weight, eps, offset=, casting=) is m(x),
    or a string saying why none is. Runs a CPU copy of `m` with a random weight (the module's own
    weight may be all ones or zeros, which would hide an offset)."""
    from ..fused.norms import reference_rms_norm   # lazily, as gems.fused loads its kernel modules
    eps = rms_eps(m)
    if eps is None:
        return _NO_EPS
    if not _one_tensor_forward(m):
        return "forward takes more than the hidden states"
    n = m.weight.shape[0]
    g = _gen(1)
    try:
        probe = copy.deepcopy(m)
    except Exception as e:   # noqa: BLE001 - any copy failure means no proof
        return f"cannot be copied for the check ({type(e).__name__})"
    probe._forward_hooks.clear()
    probe._forward_pre_hooks.clear()
    w32 = torch.randn(n, generator=g) * 0.5 + 0.3
    x32 = torch.randn(3, n, generator=g) * torch.tensor([[1.0], [1e-3], [10.0]])
    cases = []   # (weight, x): fp32, bf16, fp32 weight on a bf16 input
    for wd, xd in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)):
        cases.append((w32.to(wd), x32.to(xd)))
    outs = []
    try:
        with torch.no_grad():
            for w, x in cases:
                probe.weight = nn.Parameter(w, requires_grad=False)
                outs.append(probe(x))
    except Exception as e:   # noqa: BLE001
        return f"its forward failed on a CPU probe ({type(e).__name__}: {e})"
    best = None
    for casting, offset in RMS_CANDIDATES:
        err, ok = 0.0, True
        for (w, x), y in zip(cases, outs):
            ref = reference_rms_norm(x, w, eps, offset=offset, casting=casting)
            tol = 1e-5 if x.dtype == torch.float32 else 2 ** -7
            if not _close(y, ref, tol, tol * 1e-3):
                ok = False
                break
            err += float((y.float() - ref.float()).abs().sum())
        if ok and (best is None or err < best[0]):
            best = (err, casting, offset)
    if best is None:
        return "its forward matches no RMSNorm casting rule (llama / gemma, offset 0 / 1)"
    return best[1], best[2], eps


# ------------------------------------------------------------------------------------------- activations
_ACTS = {"silu": lambda t: TF.silu(t), "gelu": lambda t: TF.gelu(t),
         "gelu_tanh": lambda t: TF.gelu(t, approximate="tanh")}


def activation_kind(act):
    """'silu', 'gelu' or 'gelu_tanh' when the callable `act` computes it (fp32, on [-6, 6]), else None."""
    if act is None or not callable(act):
        return None
    t = torch.cat([torch.linspace(-6, 6, 241), torch.randn(64, generator=_gen(2)) * 3])
    try:
        with torch.no_grad():
            y = act(t.clone())
    except Exception:   # noqa: BLE001
        return None
    for name, f in _ACTS.items():
        if _close(y, f(t), 1e-5, 1e-6):
            return name
    return None


class _CountOps(TorchFunctionMode):
    """Counts the torch functions and tensor operations a call runs (each one a kernel, forward)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def composite_activation(m):
    """'silu', 'gelu' or 'gelu_tanh' for a module without parameters, buffers or submodules whose
    forward computes that activation from several torch operations (GPT-2's gelu_new: eight elementwise
    kernels forward, more backward, each rounding to the model's dtype); None otherwise, including a
    module that already is one operator (nn.GELU, nn.SiLU)."""
    if m._parameters or m._buffers or m._modules or not _one_tensor_forward(m):
        return None
    kind = activation_kind(m)
    if kind is None:
        return None
    count, x = _CountOps(), torch.randn(8, generator=_gen(3))
    try:
        with torch.no_grad(), count:
            m(x)
    except Exception:   # noqa: BLE001
        return None
    return kind if count.n > 1 else None


# ------------------------------------------------------------------------------------------- gated MLPs
ACT_ATTRS = ("act_fn", "activation_fn", "act")


def _linear(m, name):
    v = getattr(m, name, None)
    return v if isinstance(v, nn.Linear) else None


def gated_mlp_form(m):
    """'split' (gate_proj, up_proj, down_proj), 'fused' (gate_up_proj [gate; up], down_proj) or None."""
    if _linear(m, "down_proj") is None:
        return None
    if _linear(m, "gate_proj") is not None and _linear(m, "up_proj") is not None:
        return "split"
    if _linear(m, "gate_up_proj") is not None:
        return "fused"
    return None


def mlp_activation(m):
    for name in ACT_ATTRS:
        a = getattr(m, name, None)
        if a is not None:
            return a
    return None


def prove_gated_mlp(m, form):
    """The activation kind such that down(act(gate(x)) * up(x)) with gems' fused gated op is m(x), or
    a string saying why not. The activation is proven alone in fp32; the MLP's structure on its own
    device and dtype (its weights are not copied) with its own submodules."""
    act = mlp_activation(m)
    kind = activation_kind(act)
    if kind is None:
        return f"activation {type(act).__name__} is not silu / gelu / gelu-tanh"
    if not _one_tensor_forward(m):
        return "forward takes more than the hidden states"
    down = m.down_proj
    w = down.weight
    if w.device.type == "meta":
        return "weights on the meta device: its forward cannot be checked"
    hidden = down.out_features
    x = (torch.randn(2, 3, hidden, generator=_gen(3)) * 0.5).to(device=w.device, dtype=w.dtype)
    was = m.training
    try:
        m.eval()
        with torch.no_grad():
            y = m(x)
            if form == "split":
                g, u = m.gate_proj(x), m.up_proj(x)
            else:
                g, u = m.gate_up_proj(x).chunk(2, dim=-1)
            ref = down(_ACTS[kind](g) * u)
    except Exception as e:   # noqa: BLE001
        return f"its forward failed on a probe ({type(e).__name__}: {e})"
    finally:
        m.train(was)
    tol = 1e-4 if w.dtype in (torch.float32, torch.float64) else 3e-2
    if not _close(y, ref, tol, tol):
        return f"its forward is not down_proj({kind}(gate) * up)"
    return kind


def looks_like_plain_mlp(m) -> bool:
    n = type(m).__name__
    return n.endswith(("MLP", "Mlp", "FeedForward")) and gated_mlp_form(m) is None


# ------------------------------------------------------------------------------------------- RoPE
def prove_rope(fn, interleaved=False):
    """None when fn(q, k, cos, sin, unsqueeze_dim) is HF's rotate-half RoPE (the fused op's semantics;
    `interleaved`: GLM's pairwise form) for cos/sin as wide as the head, in both layouts; else why not."""
    from ..fused.rotary import reference_rope   # lazily, as gems.fused loads its kernel modules
    g = _gen(4)
    try:
        for ud in (1, 2):
            q = torch.randn(2, 3, 5, 8, generator=g)
            k = torch.randn(2, 3, 5, 8, generator=g)
            cs_shape = (2, 5, 8) if ud == 1 else (2, 3, 8)   # [B, S, D]
            cos, sin = torch.randn(cs_shape, generator=g), torch.randn(cs_shape, generator=g)
            got = fn(q, k, cos, sin, unsqueeze_dim=ud)
            ref = reference_rope(q, k, cos, sin, unsqueeze_dim=ud, interleaved=interleaved)
            if not (_close(got[0], ref[0], 1e-5, 1e-6) and _close(got[1], ref[1], 1e-5, 1e-6)):
                return ("apply_rotary_pos_emb is not the interleaved form" if interleaved else
                        "apply_rotary_pos_emb is not the rotate-half form (interleaved or other)")
    except Exception as e:   # noqa: BLE001
        return f"apply_rotary_pos_emb failed on a probe ({type(e).__name__}: {e})"
    return None


def proves_partial_rope(fn, interleaved=False) -> bool:
    """Whether fn, given cos/sin narrower than the head (width r), rotates the first r channels as the
    fused op would (`interleaved`: GLM's form) and passes the rest through (GPT-NeoX's, Phi-3's and GLM's
    partial rotary)."""
    from ..fused.rotary import reference_rope   # lazily, as gems.fused loads its kernel modules
    g = _gen(6)
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    cos, sin = torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)
    try:
        got = fn(q, k, cos, sin, unsqueeze_dim=1)
    except Exception:   # noqa: BLE001 - a function that cannot take partial cos/sin
        return False
    rq, rk = reference_rope(q[..., :4], k[..., :4], cos, sin, unsqueeze_dim=1, interleaved=interleaved)
    return (_close(got[0], torch.cat([rq, q[..., 4:]], -1), 1e-5, 1e-6)
            and _close(got[1], torch.cat([rk, k[..., 4:]], -1), 1e-5, 1e-6))


# ------------------------------------------------------------------------------------------- residual + LayerNorm
def plain_layer_norm(m) -> bool:
    return (type(m) is nn.LayerNorm and len(m.normalized_shape) == 1 and m.weight is not None
            and m.bias is not None)


def prove_dense_add_norm(m):
    """None when m(h, input_tensor) is LayerNorm(dropout(dense(h)) + input_tensor) (BertSelfOutput's
    form), checked in eval mode on its own device and dtype; else why not."""
    dense, drop, ln = getattr(m, "dense", None), getattr(m, "dropout", None), getattr(m, "LayerNorm", None)
    if not (isinstance(dense, nn.Linear) and isinstance(drop, nn.Dropout) and plain_layer_norm(ln)):
        return "not dense + dropout + LayerNorm"
    w = dense.weight
    if w.device.type == "meta":
        return "weights on the meta device"
    g = _gen(5)
    h = torch.randn(2, 3, dense.in_features, generator=g).to(w.device, w.dtype)
    r = torch.randn(2, 3, dense.out_features, generator=g).to(w.device, w.dtype)
    was = m.training
    try:
        m.eval()
        with torch.no_grad():
            y = m(h, r)
            ref = TF.layer_norm(dense(h) + r, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
    except Exception as e:   # noqa: BLE001
        return f"its forward failed on a probe ({type(e).__name__}: {e})"
    finally:
        m.train(was)
    tol = 1e-4 if w.dtype in (torch.float32, torch.float64) else 3e-2
    return None if _close(y, ref, tol, tol) else "its forward is not LayerNorm(dense(h) + input)"


# ------------------------------------------------------------------------------------------- LM losses
def _probe_ids(model, vocab):
    """Four token ids below `vocab` that are none of the config's special multimodal tokens."""
    cfg = model.config
    special = {getattr(cfg, a, None) for a in ("image_token_id", "image_token_index", "video_token_id")}
    ids = [i for i in range(1, min(vocab, 64)) if i not in special][:4]
    return ids


def _run_probe(model, kwargs):
    """model(**kwargs) in eval mode without autograd; every module's training flag restored after."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            return model(**kwargs)
    finally:
        for m, t in modes:
            m.training = t


def base_model(model):
    b = getattr(model, getattr(model, "base_model_prefix", "") or "model", None)
    return b if isinstance(b, nn.Module) else getattr(model, "model", None)


def prove_causal_lm(model):
    """{'cross_entropy': why-not or None, 'fused_linear_cross_entropy': why-not or None, 'out_cls': type}
    for a model with an `lm_head` Linear, from one small eval forward with labels: the loss is the
    instance's `loss_function` (transformers' ForCausalLMLoss) of the logits, and (for the fused linear
    loss) the logits are exactly lm_head(the base model's last hidden state), the returned loss is the
    loss function's result, and the base model takes every argument of the model's forward."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    res = {"cross_entropy": None, "fused_linear_cross_entropy": None, "out_cls": None}
    head, base = getattr(model, "lm_head", None), base_model(model)

    def no(why):
        res.update(cross_entropy=why, fused_linear_cross_entropy=why)
        return res
    if not isinstance(head, nn.Linear) or base is None:
        return no("no lm_head Linear and base model")
    if head.weight.device.type == "meta":
        return no("weights on the meta device")
    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return no(f"{type(model).__name__}.loss_function is not transformers' ForCausalLMLoss")
    ids = _probe_ids(model, head.out_features)
    if len(ids) < 4:
        return no("vocabulary too small for the check")
    dev = head.weight.device
    input_ids = torch.tensor([ids], device=dev)
    labels = input_ids.clone()
    labels[0, 1] = -100
    seen = {}

    def loss_fn(*a, **kw):
        seen["loss"] = ForCausalLMLoss(*a, **kw)
        return seen["loss"]
    h1 = base.register_forward_hook(lambda m, i, o: seen.__setitem__("hidden", o[0]))
    h2 = head.register_forward_hook(lambda m, i, o: seen.update(head_in=i[0], head_out=o))
    had = "_loss_function" in model.__dict__
    prev = model.__dict__.get("_loss_function")
    object.__setattr__(model, "_loss_function", loss_fn)
    kw = {"input_ids": input_ids, "labels": labels}
    if "use_cache" in inspect.signature(type(model).forward).parameters:
        kw["use_cache"] = False
    try:
        out = _run_probe(model, kw)
    except Exception as e:   # noqa: BLE001
        return no(f"its forward failed on a probe ({type(e).__name__}: {e})")
    finally:
        h1.remove()
        h2.remove()
        if had:
            object.__setattr__(model, "_loss_function", prev)
        else:
            model.__dict__.pop("_loss_function", None)
    res["out_cls"] = type(out)
    if "loss" not in seen:
        return no("its forward does not call self.loss_function")
    fields = getattr(type(out), "__dataclass_fields__", {})
    why = None
    if not ("loss" in fields and "logits" in fields):
        why = f"its output {type(out).__name__} has no loss / logits fields"
    elif out.loss is not seen["loss"] and not torch.equal(out.loss, seen["loss"]):
        why = "the returned loss is not the loss function's alone (an auxiliary loss added)"
    elif not ("hidden" in seen and "head_out" in seen and torch.is_tensor(seen["hidden"])
              and torch.equal(seen["head_in"], seen["hidden"]) and torch.equal(out.logits, seen["head_out"])):
        why = "the logits are not lm_head(last hidden state) as is (scaled, soft-capped or post-processed)"
    else:
        outer = inspect.signature(type(model).forward).parameters
        inner = inspect.signature(type(base).forward).parameters
        missing = [n for n, p in outer.items() if n not in ("self", "labels", "logits_to_keep")
                   and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n not in inner]
        if missing:
            why = f"the base model does not take {', '.join(missing)}"
    res["fused_linear_cross_entropy"] = why
    return res


def prove_masked_lm(model):
    """None when the model's loss (labels given) is cross_entropy(logits.view(-1, vocab), labels.view(-1))
    with mean reduction and ignore_index -100, from one small eval forward; else why not."""
    vocab = getattr(model.config, "vocab_size", None)
    if not isinstance(vocab, int):
        return "no config.vocab_size"
    ids = _probe_ids(model, vocab)
    p = next(model.parameters(), None)
    if len(ids) < 4 or p is None or p.device.type == "meta":
        return "cannot run a probe (tiny vocabulary or meta weights)"
    input_ids = torch.tensor([ids], device=p.device)
    labels = input_ids.flip(-1).clone()
    labels[0, 0] = -100
    try:
        out = _run_probe(model, {"input_ids": input_ids, "labels": labels, "return_dict": True})
    except Exception as e:   # noqa: BLE001
        return f"its forward failed on a probe ({type(e).__name__}: {e})"
    logits = getattr(out, "logits", None)
    if not (torch.is_tensor(logits) and logits.shape[-1] == vocab and torch.is_tensor(getattr(out, "loss", None))):
        return "its output has no loss and vocabulary-wide logits"
    ref = TF.cross_entropy(logits.reshape(-1, vocab).float(), labels.reshape(-1))
    if not torch.allclose(out.loss.float(), ref, rtol=1e-4, atol=1e-5):
        return "its loss is not the mean cross entropy of the logits"
    return None
