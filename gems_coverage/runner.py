"""Run a built model in one of the modes: inference, generate (KV cache; greedy or sampling) or training.

Training = forward with labels, backward, and one optimizer step: by default AdamW as users run it on
CUDA, ``foreach=True`` (PyTorch's default there; explicit, since on CPU and meta the default is the
per-parameter loop), so the ``_foreach_*`` ops it calls are the ones traced; ``adamw-loop`` (the
loop's per-parameter ops), ``adamw-fused`` (``_fused_adamw_``; not on meta) and ``sgd`` choose others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MODES = ("inference", "generate", "training")


def check_mode(bundle, mode: str) -> None:
    from gems_models import ModelError
    if mode not in MODES:
        raise ModelError(f"unknown mode '{mode}' ({', '.join(MODES)})")
    if mode == "generate" and bundle.kind not in ("causal_lm", "llava"):
        raise ModelError(f"{bundle.recipe.name}: mode 'generate' needs a causal LM (this is {bundle.kind})")


def patched(patch) -> bool:
    """Whether a `patch=` argument asks for gems.patch: True, or a dict of its options (even empty)."""
    return patch is True or isinstance(patch, dict)


def patch_report(model, options, name: str = "this model") -> dict:
    """What gems.patch replaces in this model, patched and unpatched at once: run right after the model
    is built, a model gems.patch does not take, or in which it replaces nothing with these options (the
    Gems run would not differ from one without --patch), is bad input (gems_models.ModelError) before
    any run."""
    import gems
    from gems_models import ModelError
    try:
        report = gems.patch(model, **options)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ModelError(f"--patch: {e}") from None
    gems.unpatch(model)
    d = report.to_dict()
    if not d["replaced"]:
        left = [e for e in d.get("left", []) if e["strict"]]
        why = f" ({len(left)} part(s) not proven equivalent, first {left[0]['module']}: {left[0]['why']})" \
            if left else ""
        raise ModelError(f"--patch: gems.patch replaces nothing in {name} with these options{why}; "
                         f"run without --patch")
    return d


def patch_options(patch) -> dict:
    """gems.patch's keyword options of a `patch=` argument: {} for True/False, the dict itself else (its
    names checked against gems.patch.OPTIONS; an unknown one is bad input: gems_models.ModelError)."""
    if isinstance(patch, bool) or patch is None:
        return {}
    from gems.patching import OPTIONS
    from gems_models import ModelError
    bad = sorted(set(patch) - set(OPTIONS))
    if bad:
        raise ModelError(f"--patch-options: unknown gems.patch option(s) {', '.join(bad)}; the options are "
                         f"{', '.join(OPTIONS)}")
    return {k: bool(v) for k, v in patch.items()}


# ------------------------------------------------------------------------------------ input checks
def check_model(recipe, size: str, *, mode: str, seq_len: int, batch: int = 1, new_tokens: int = 0):
    """Bad input found before anything is built: an architecture the runner has no inputs for, or a
    sequence longer than the model's maximum. Raises gems_models.ModelError (exit 2, one line)."""
    from gems_models import ModelError, load_config
    if recipe.factory is not None:
        return None   # module:function models bring their own inputs
    config = load_config(recipe, size)
    name = f"{recipe.name} ({size})"
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"{name}: encoder-decoder models ({getattr(config, 'model_type', '?')}) are not "
                         f"supported: gems-coverage builds inputs for decoder-only causal LMs, BERT-like masked "
                         f"LMs and Llava; wrap others as module:function returning (model, inputs)")
    limit = max_positions(config)
    if limit is not None:
        image = int(getattr(config, "image_seq_length", 0) or 0) if recipe.kind == "llava" else 0
        total = seq_len + image + (max(0, new_tokens - 1) if mode == "generate" else 0)
        if total > limit:
            parts = f"--seq-len {seq_len}"
            if image:
                parts += f" + {image} image tokens"
            if mode == "generate" and new_tokens > 1:
                parts += f" + {new_tokens - 1} generated"
            ask = f"{parts} = {total}" if parts != f"--seq-len {seq_len}" else f"--seq-len {seq_len} asks for more"
            raise ModelError(f"{name} takes at most {limit} positions; {ask}"
                             + (" (the tiny variant's limit; --size full has the model's own)"
                                if size == "tiny" else ""))
    return config


def max_positions(config):
    """The longest sequence a config's position embeddings (or rope table) are made for, or None."""
    for c in (getattr(config, "text_config", None), config):
        if c is None:
            continue
        for k in ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx"):
            v = getattr(c, k, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def param_count(recipe, size: str) -> int:
    """Parameters of a recipe, from a build on the meta device (no memory, well under a second)."""
    import gems_models
    b = gems_models.build(recipe, size=size, device="meta", dtype="float32", batch=1, seq_len=1)
    return sum(p.numel() for p in b.model.parameters())


def available_memory(device: str) -> "tuple[float, str] | None":
    """(bytes a new allocation can get on `device`, where the number comes from), or None if unknown.

    CPU: MemAvailable of /proc/meminfo, capped by the cgroup's limit (containers); CUDA: free device
    memory."""
    import torch
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return float(free), "free GPU memory"
    if dev.type != "cpu":
        return None
    avail, src = None, ""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail, src = float(line.split()[1]) * 1024, "MemAvailable"
                break
    except OSError:
        pass
    for lim, cur in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                     ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = open(lim).read().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                continue
            left = float(int(raw) - int(open(cur).read().strip()))
        except (OSError, ValueError):
            continue
        if avail is None or left < avail:
            avail, src = left, "the cgroup's memory limit"
        break
    return None if avail is None else (avail, src)


def check_memory(recipe, size: str, device: str, dtype, copies: float, what: str):
    """Refuse (gems_models.ModelError) a run that needs about `copies` times the weights' bytes when the
    device has less memory available; on CPU the OOM killer would end it without a word."""
    import torch
    from gems_models import ModelError
    if recipe.factory is not None or torch.device(device).type == "meta":
        return
    got = available_memory(device)
    if got is None:
        return
    avail, src = got
    n = param_count(recipe, size)
    need = n * torch.tensor([], dtype=dtype).element_size() * copies * 1.1   # +10%: activations, allocator
    if need > avail:
        gib = 1024 ** 3
        hint = " (use --size tiny, the default on cpu)" if size == "full" else ""
        raise ModelError(f"{recipe.name} ({size}, {n / 1e9:.2f}B parameters) needs about {need / gib:.1f} GiB "
                         f"for {what} on {device} ({copies:g}x the weights in {str(dtype).replace('torch.', '')}), "
                         f"but {avail / gib:.1f} GiB is available ({src}){hint}")


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


@dataclass(frozen=True)
class Sampling:
    """Sampling decoding as ``generate(do_sample=True, ...)`` runs it: transformers' own logits warpers
    (temperature, top-k, top-p, in generate()'s order; a warper that would change nothing is left out
    as generate() leaves it out: temperature 1, top_k 0, top_p 1), then softmax and one
    ``torch.multinomial`` draw per sequence."""
    temperature: float = 0.7
    top_k: int = 50
    top_p: float = 0.9

    def __post_init__(self):
        # the warpers' own checks raise ValueError too; these say which option is wrong
        if not self.temperature > 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a positive number, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p}")

    def describe(self) -> str:
        return f"temperature {self.temperature:g}, top_k {self.top_k}, top_p {self.top_p:g}"

    def warpers(self):
        from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                            TopPLogitsWarper)
        out = []
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            out.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(self.top_p))
        return out


def run_generate(bundle, new_tokens: int = 4, times: Optional[list] = None, sync=None,
                 sampling: Optional[Sampling] = None, prompt_len: Optional[int] = None):
    """Decoding: a prefill, then ``new_tokens - 1`` one-token steps with the KV cache.

    Greedy (argmax of the last logits) by default; with ``sampling`` each token is drawn as
    ``generate(do_sample=True)`` draws it: the last logits copied to float32, transformers'
    temperature / top-k / top-p warpers, softmax, ``torch.multinomial(probs, 1)``. The warpers
    used here do not read the token history, so they get the prompt's ids (no per-step cat).
    Returns the generated token ids (batch, new_tokens). A hand-written loop (rather than
    ``generate()``) keeps it free of data-dependent stopping checks (no ``.item()``) so it also runs
    on the meta device. With ``times``, the decode steps (not the prefill) are timed, bracketed by
    ``sync()``, and ms per step appended. ``prompt_len``: the prompt's first ``prompt_len`` positions
    only (input ids and attention mask; a shorter prompt gives the run other KV-cache lengths).
    """
    import time
    import torch
    m = bundle.model
    m.eval()
    inputs = dict(bundle.inputs)
    if prompt_len is not None:
        full = inputs["input_ids"].shape[1]
        if not 1 <= prompt_len <= full:
            raise ValueError(f"prompt_len {prompt_len}: the prompt has {full} positions")
        for k in ("input_ids", "attention_mask"):
            if k in inputs:
                inputs[k] = inputs[k][:, :prompt_len]
    mask = inputs.get("attention_mask")
    warpers = sampling.warpers() if sampling is not None else None
    prompt = inputs.get("input_ids")

    def pick(logits):
        last = logits[:, -1, :]
        if warpers is None:
            return last.argmax(dim=-1)
        scores = last.to(dtype=torch.float32, copy=True)
        for w in warpers:
            scores = w(prompt, scores)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1)

    toks = []
    with torch.no_grad():
        out = m(**inputs, use_cache=True)
        nxt = pick(out.logits)
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
            nxt = pick(out.logits)
            toks.append(nxt)
            past = out.past_key_values
        if times is not None:
            sync()
            times.append((time.perf_counter() - t0) * 1e3 / max(1, new_tokens - 1))
    return torch.stack(toks, dim=1)


# the optimizers a training step can take (gems-coverage trace/bench --optimizer, parity's optimizer)
OPTIMIZERS = ("adamw", "adamw-loop", "adamw-fused", "sgd")


def make_optimizer(params, name: str = "adamw", lr: float = 1e-3):
    """adamw: AdamW with foreach=True (what CUDA users run: PyTorch's default there, explicit so that CPU
    and meta runs take it too); adamw-loop: the per-parameter loop (foreach=False); adamw-fused: one
    _fused_adamw_ op (fused=True; CUDA and CPU); sgd: SGD without momentum, the loop (parity's
    default: an update linear in the gradient)."""
    import torch
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.0, foreach=False)
    from gems_models import ModelError
    if name not in OPTIMIZERS:
        raise ModelError(f"unknown optimizer '{name}' ({', '.join(OPTIMIZERS)})")
    if name == "adamw-fused" and any(p.device.type == "meta" for p in params):
        raise ModelError("adamw-fused: PyTorch's fused AdamW has no meta kernel (trace it on cpu or cuda)")
    how = {"adamw": {"foreach": True}, "adamw-loop": {"foreach": False}, "adamw-fused": {"fused": True}}[name]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **how)


def run_training(bundle, optimizer: str = "adamw", lr: float = 1e-3, after_backward=None):
    """One training step; returns the loss tensor (detached). ``after_backward(model)`` sees the grads."""
    from gems_models import training_loss
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


def run(bundle, mode: str, new_tokens: int = 4, optimizer: str = "adamw", sampling: Optional[Sampling] = None):
    if mode == "inference":
        return run_inference(bundle)
    if mode == "generate":
        return run_generate(bundle, new_tokens, sampling=sampling)
    if mode == "training":
        return run_training(bundle, optimizer)
    check_mode(bundle, mode)
    return None
