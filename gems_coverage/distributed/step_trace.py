"""What step 0 of the Gems run dispatches, per op where it was called from (model forward, backward, the
DDP/FSDP2 wrapper, the optimizer, gradient clipping), and parity's shadow check made safe for DTensors."""
from __future__ import annotations

import sys

# the files a call passes through on its way to an op without being where the op comes from
_PLUMBING = ("/torch/_ops.py", "/torch/utils/_python_dispatch.py", "/torch/overrides.py", "/torch/_tensor.py",
             "/torch/nn/functional.py", "/torch/nn/modules/", "/torch/functional.py", "/torch/utils/checkpoint.py",
             "/torch/utils/_contextlib.py", "/torch/_library/", "/torch/_higher_order_ops/", "/torch/_jit_internal.py",
             "/torch/amp/", "/torch/_compile.py", "/torch/_dynamo/", "/torch/utils/_device.py", "/gems_coverage/",
             "/torch/_prims_common/", "/torch/_decomp/", "/torch/_refs/", "/torch/nn/parameter.py")
# the training loop's file: an op called from its own lines (not through a module) belongs to the step
TRAINING_LOOP_FILE = "/gems_coverage/distributed/training.py"


def _origin(strategy: str) -> str:
    """Where the op being dispatched was called from: the innermost Python frame that is not plumbing."""
    try:
        f = sys._getframe(3)      # past _origin, the recorder's callback and its __torch_dispatch__
    except ValueError:            # an autograd device thread: no Python frame below the mode
        return "backward"
    while f is not None:
        fn = f.f_code.co_filename.replace("\\", "/")
        if fn.endswith(TRAINING_LOOP_FILE) and f.f_code.co_name != "__torch_dispatch__":
            return "step"
        if not any(s in fn for s in _PLUMBING) and f.f_code.co_name != "__torch_dispatch__":
            if "/torch/distributed/" in fn or "/torch/nn/parallel/" in fn:
                return strategy
            if "/torch/optim/" in fn:
                return "optimizer"
            if "/torch/nn/utils/clip_grad" in fn:
                return "grad-clip"
            if "/torch/autograd/" in fn:
                return "backward"
            return "forward"
        f = f.f_back
    return "backward"     # no Python frame: an autograd thread running backward kernels (CUDA)


class StepTracer:
    """The tracer's OpRecorder plus, per op, where it was called from (see `_origin`)."""

    def __init__(self, strategy: str):
        from ..tracer import OpRecorder
        self.origins: dict = {}
        self.strategy = strategy

        def on_call(name, func, args, kwargs, out):
            o = _origin(self.strategy)
            d = self.origins.setdefault(name, {})
            d[o] = d.get(o, 0) + 1
        self.rec = OpRecorder(meta_scalars=False, on_call=on_call)

    def summary(self) -> dict:
        return {n: {"calls": s.calls, "category": s.category, "dtypes": sorted(s.dtypes), "example": s.example,
                    "origins": self.origins.get(n, {})} for n, s in self.rec.ops.items()}


def shadow_mode(names, result, phase):
    """Parity's ShadowMode, skipping calls on tensor subclasses (FSDP2's DTensor parameters in the
    optimizer step: their local ops run below the mode and a DTensor has no numpy view to compare)."""
    import torch
    from torch.utils._pytree import tree_leaves
    from ..parity import ShadowMode

    class RankShadow(ShadowMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter):
                    self.calls += 1
                    return func(*args, **kwargs)
            return super().__torch_dispatch__(func, types, args, kwargs)
    return RankShadow(names, result, phase)
