"""Inputs: realistic example inputs per model kind, and the loss a training step backpropagates."""
from __future__ import annotations

from .recipes import ModelError


# ---------------------------------------------------------------------------------------------- inputs
def make_inputs(kind: str, config, *, batch: int, seq_len: int, device, dtype, seed: int = 0):
    """Realistic example inputs: (inference kwargs, training kwargs with labels).

    Token ids are random in the normal-token range (special tokens and the image token excluded); attention
    masks are all ones (a batch of equal-length prompts, the common serving case); BERT gets a [CLS]/[SEP]
    frame, token types and MLM labels on ~15% of the positions; Llava gets ``image_seq_length`` image
    tokens after BOS, pixel values in the CLIP-normalized range and labels that ignore the image positions.
    """
    import torch
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "llava":
        tc = config.text_config
        vocab = tc.vocab_size
        n_img = int(getattr(config, "image_seq_length", 0) or _image_tokens(config))
        img_id = int(config.image_token_index)
        hi = min(vocab, img_id) if img_id > 3 else vocab
        text = torch.randint(3, hi, (batch, seq_len), generator=g)
        ids = torch.cat([torch.full((batch, 1), 1), torch.full((batch, n_img), img_id), text], dim=1)
        vc = config.vision_config
        pix = torch.randn(batch, getattr(vc, "num_channels", 3), vc.image_size, vc.image_size, generator=g)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        labels[:, : 1 + n_img] = -100
        inf = dict(input_ids=ids, attention_mask=mask, pixel_values=pix)
        tr = dict(inf, labels=labels)
    elif kind == "masked_lm":
        vocab = config.vocab_size
        ids = torch.randint(5, vocab, (batch, seq_len), generator=g)
        if seq_len >= 3:
            ids[:, 0] = min(101, vocab - 1)   # [CLS]
            ids[:, -1] = min(102, vocab - 1)  # [SEP]
        mask = torch.ones_like(ids)
        tt = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        pick = torch.rand(batch, seq_len, generator=g) < 0.15
        pick[:, 1 if seq_len > 2 else 0] = True   # at least one masked position per row
        labels[pick] = ids[pick]
        masked = ids.clone()
        masked[pick] = min(103, vocab - 1)        # [MASK]
        inf = dict(input_ids=ids, attention_mask=mask, token_type_ids=tt)
        tr = dict(input_ids=masked, attention_mask=mask, token_type_ids=tt, labels=labels)
    else:
        vocab = getattr(config, "vocab_size", None) or 256
        ids = torch.randint(3, vocab, (batch, seq_len), generator=g)
        bos = getattr(config, "bos_token_id", None)
        if isinstance(bos, int) and 0 <= bos < vocab:
            ids[:, 0] = bos
        mask = torch.ones_like(ids)
        inf = dict(input_ids=ids, attention_mask=mask)
        tr = dict(inf, labels=ids.clone())

    def move(d):
        out = {}
        for k, v in d.items():
            v = v.to(device)
            if v.is_floating_point():
                v = v.to(dtype)
            out[k] = v
        return out
    return move(inf), move(tr)


def _image_tokens(config) -> int:
    vc = config.vision_config
    n = (vc.image_size // vc.patch_size) ** 2
    if getattr(config, "vision_feature_select_strategy", "default") == "full":
        n += 1
    return n


def training_loss(outputs):
    """The loss of a forward output: ``.loss`` when the model computed one, else the mean of the output."""
    import torch
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    if loss is not None:
        return loss
    t = outputs
    if not isinstance(t, torch.Tensor):
        leaves = [x for x in (outputs.values() if isinstance(outputs, dict) else outputs)
                  if isinstance(x, torch.Tensor) and x.is_floating_point()]
        if not leaves:
            raise ModelError("the model output has no floating-point tensor to build a loss from")
        t = leaves[0]
    return t.float().mean()
