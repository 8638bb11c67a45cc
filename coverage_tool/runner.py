"""Run a built model in one of the modes: inference, generate (greedy, KV cache) or training.

Training = forward with labels, backward, and one optimizer step (AdamW with ``foreach=False`` so the
per-parameter ATen ops are the ones a plain training loop calls; that also runs on the meta device).
"""
from __future__ import annotations

from typing import Optional

MODES = ("inference", "generate", "training")


def check_mode(bundle, mode: str) -> None:
    from models import ModelError
    if mode not in MODES:
        raise ModelError(f"unknown mode '{mode}' ({', '.join(MODES)})")
    if mode == "generate" and bundle.kind not in ("causal_lm", "llava"):
        raise ModelError(f"{bundle.recipe.name}: mode 'generate' needs a causal LM (this is {bundle.kind})")


def forward(bundle, train: bool = False):
    m = bundle.model
    if bundle.custom_args:
        return m(*bundle.custom_args)
    return m(**(bundle.train_inputs if train else bundle.inputs))


def run_inference(bundle):
    import torch
    bundle.model.eval()
    with torch.no_grad():
        out = forward(bundle)
    return out


def run_generate(bundle, new_tokens: int = 4, times: Optional[list] = None, sync=None):
    """Greedy decoding: a prefill, then ``new_tokens - 1`` one-token steps with the KV cache.

    Returns the generated token ids (batch, new_tokens). A hand-written loop (rather than ``generate()``)
    keeps it free of data-dependent stopping checks so it also runs on the meta device. With ``times``,
    the decode steps (not the prefill) are timed, bracketed by ``sync()``, and ms per step appended.
    """
    import time
    import torch
    m = bundle.model
    m.eval()
    inputs = dict(bundle.inputs)
    mask = inputs.get("attention_mask")
    toks = []
    with torch.no_grad():
        out = m(**inputs, use_cache=True)
        nxt = out.logits[:, -1, :].argmax(dim=-1)
        toks.append(nxt)
        past = out.past_key_values
        if times is not None:
            sync()
            t0 = time.perf_counter()
        for _ in range(max(0, new_tokens - 1)):
            step = dict(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                step["attention_mask"] = mask
            out = m(**step)
            nxt = out.logits[:, -1, :].argmax(dim=-1)
            toks.append(nxt)
            past = out.past_key_values
        if times is not None:
            sync()
            times.append((time.perf_counter() - t0) * 1e3 / max(1, new_tokens - 1))
    return torch.stack(toks, dim=1)


def make_optimizer(params, name: str = "adamw", lr: float = 1e-3):
    import torch
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.0, foreach=False)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, foreach=False)


def run_training(bundle, optimizer: str = "adamw", lr: float = 1e-3, after_backward=None):
    """One training step; returns the loss tensor (detached). ``after_backward(model)`` sees the grads."""
    from models import training_loss
    m = bundle.model
    m.train()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = make_optimizer(params, optimizer, lr)
    opt.zero_grad(set_to_none=True)
    out = forward(bundle, train=True)
    loss = training_loss(out)
    loss.backward()
    if after_backward is not None:
        after_backward(m)
    opt.step()
    return loss.detach()


def run(bundle, mode: str, new_tokens: int = 4, optimizer: str = "adamw"):
    if mode == "inference":
        return run_inference(bundle)
    if mode == "generate":
        return run_generate(bundle, new_tokens)
    if mode == "training":
        return run_training(bundle, optimizer)
    check_mode(bundle, mode)
    return None
