"""Sibling Linears that read one input, run as one GEMM when no gradient is recorded: query, key and value
projections, and gate and up (`gems.patch(model, pack_projections=True)`).

Why: a batch-1 decode step reads every weight once, and each GEMM kernel pays a start and ramp-up beyond
its bytes (about 5 us on an H200 with cold L2: docs/perf.md, "The decode GEMM's ceiling"). Llama-2-7B's
three [4096, 4096] reads of q, k and v cost more than one [12288, 4096] read.

`pack(linears)` lays the Linears' weights (and biases) out as rows of one tensor and makes each Parameter
a view of its rows: the Parameter objects stay (optimizers, state_dict keys, hooks), no second copy of
the weights exists. Each Linear gets an instance forward:
  - the first one's call (q_proj, gate_proj: the one the model calls first) computes x @ W_all.T once,
    returns its own columns and keeps the others' for their calls;
  - a later sibling's call returns its kept columns when its input is the same tensor, unchanged since
    (identity and version counter), else computes its own F.linear.
So the result is the separate Linears' whatever the calling code does; only the kernel count changes.
Under torch.compile each Linear is traced as it is (inductor plans its own GEMMs).
Calls that record autograd (training) run each Linear's own F.linear, because the Parameters are the
leaves gradients must reach; so do calls after a Parameter was replaced or moved (`model.to`), whose
rows are then no longer views of the packed tensor. Undoing (`gems.unpatch`) gives each Parameter its
own storage again. While packed, the Parameters share one storage: safetensors refuses to save shared
tensors, so unpatch before `save_pretrained`.
"""
from __future__ import annotations

import torch
from torch import nn

# sibling groups, the member the model's forward calls first named first
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Pack:
    """The packed weight (and bias) of a group of Linears, and the columns kept for the later siblings."""

    def __init__(self, linears):
        self.linears = list(linears)
        self.sizes = [lin.out_features for lin in self.linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight.detach() for lin in self.linears], 0)
            self.bias = (torch.cat([lin.bias.detach() for lin in self.linears], 0)
                         if self.linears[0].bias is not None else None)
            start = 0
            for lin, n in zip(self.linears, self.sizes):
                lin.weight.data = self.weight[start:start + n]
                if self.bias is not None:
                    lin.bias.data = self.bias[start:start + n]
                start += n
        self.ptrs = self._ptrs()
        self.kept = None      # (input, its version, the output's columns per member)

    def _ptrs(self):
        return tuple((lin.weight.data_ptr(), None if lin.bias is None else lin.bias.data_ptr())
                     for lin in self.linears)

    def usable(self, x) -> bool:
        """Whether one GEMM computes every member's output for x: no autograd recorded, the Parameters
        still the packed rows."""
        if torch.is_grad_enabled() and any(lin.weight.requires_grad or (lin.bias is not None and lin.bias.requires_grad)
                                           for lin in self.linears):
            return False
        return self._ptrs() == self.ptrs and x.dtype == self.weight.dtype and x.device == self.weight.device

    def unpack(self):
        """Each Parameter its own storage again (the values unchanged)."""
        with torch.no_grad():
            for lin in self.linears:
                lin.weight.data = lin.weight.data.clone()
                if lin.bias is not None:
                    lin.bias.data = lin.bias.data.clone()
        self.kept = None


def _version(x):
    return None if x.is_inference() else x._version   # inference tensors keep no version counter


def first_forward(self, x):
    """The group's first Linear: one GEMM for every member where it can (see the module docstring)."""
    pack = self._gems_pack
    if not torch.compiler.is_compiling() and pack.usable(x):   # Dynamo traces the plain Linear
        parts = torch.nn.functional.linear(x, pack.weight, pack.bias).split(pack.sizes, -1)
        pack.kept = (x, _version(x), parts)
        return parts[0]
    pack.kept = None
    return torch.nn.functional.linear(x, self.weight, self.bias)


def sibling_forward(self, x):
    """A later Linear of the group: its columns of the first one's GEMM when it read this same input."""
    pack, i = self._gems_pack, self._gems_pack_index
    kept = None if torch.compiler.is_compiling() else pack.kept
    if kept is not None and kept[0] is x and kept[1] == _version(x):
        if i == len(pack.linears) - 1:
            pack.kept = None       # the last member: nothing is held past the group's calls
        return kept[2][i]
    return torch.nn.functional.linear(x, self.weight, self.bias)


def packable(linears) -> str | None:
    """None if the Linears can be packed, else why not."""
    if not all(type(lin) is nn.Linear for lin in linears):
        return "not all plain nn.Linear"
    w0 = linears[0].weight
    if any(lin.in_features != linears[0].in_features for lin in linears):
        return "different input sizes"
    if any(lin.weight.dtype != w0.dtype or lin.weight.device != w0.device for lin in linears):
        return "different dtypes or devices"
    if w0.device.type == "meta":
        return "weights on the meta device"
    if len({lin.bias is None for lin in linears}) != 1:
        return "some have a bias, some not"
    if any(lin.bias is not None and (lin.bias.dtype != w0.dtype or lin.bias.device != w0.device) for lin in linears):
        return "a bias of another dtype or device"
    return None
