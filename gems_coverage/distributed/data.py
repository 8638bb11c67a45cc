"""The training data: the same global batch of step i on every rank, each rank taking its rows;
synthetic (learnable, so the loss falls) or a user's saved token ids."""
from __future__ import annotations

from typing import Optional

from ..arguments import UsageError
from .options import Plan


def describe_data(p: "Plan", path: Optional[str]) -> str:
    if p.tokens is not None:
        windows = p.tokens.numel() // p.seq_len
        return (f"{path}: {p.tokens.numel()} token ids in {windows} windows of {p.seq_len}, {p.batch} per step "
                f"(cycled after {max(1, windows // p.batch)} steps)")
    return ("synthetic: per row a Zipf(1.1) segment of random period 8-64 repeated to --seq-len, from a "
            "generator seeded per step (learnable, so the loss falls)")


class Data:
    """The global batch of step i is the same on every rank; each rank takes its `micro` rows."""

    def __init__(self, vocab: int, batch: int, micro: int, seq_len: int, rank: int, seed: int, tokens=None):
        import torch
        self.vocab, self.batch, self.micro, self.seq_len, self.rank, self.seed = vocab, batch, micro, seq_len, rank, seed
        self.tokens = tokens
        if tokens is None:
            g = torch.Generator().manual_seed(seed * 7919 + 17)
            n = vocab - 3
            probs = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.1
            self.probs = (probs / probs.sum()).float()
            self.perm = torch.randperm(n, generator=g) + 3          # frequent ids spread over the vocabulary
        else:
            if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
                raise UsageError(f"--data: token ids must lie in [0, {vocab}) for this model "
                                 f"(found {int(tokens.min())}..{int(tokens.max())})")
            self.windows = tokens.numel() // seq_len


    def rows(self, step: int):
        import torch
        lo, hi = self.rank * self.micro, (self.rank + 1) * self.micro
        if self.tokens is not None:
            idx = [(step * self.batch + r) % self.windows for r in range(lo, hi)]
            return torch.stack([self.tokens[i * self.seq_len:(i + 1) * self.seq_len] for i in idx])
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        out = []
        for r in range(self.batch):      # the whole global batch, so every rank's draws are the same
            period = int(torch.randint(8, 65, (1,), generator=g))
            seg = self.perm[torch.multinomial(self.probs, min(period, self.seq_len), replacement=True, generator=g)]
            if lo <= r < hi:
                out.append(seg.repeat(-(-self.seq_len // seg.numel()))[: self.seq_len])
        return torch.stack(out)
