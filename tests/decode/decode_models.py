"""The tiny Llama and prompts tests/decode generates with."""
from __future__ import annotations

import torch
from harness import DEVICE
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 128


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).to(DEVICE, torch.float32).eval()


def prompt(batch, length, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g).to(DEVICE)
