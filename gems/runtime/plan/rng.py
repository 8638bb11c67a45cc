"""Per-call random state: the Philox seed and offset a random kernel takes, drawn as ATen's kernels draw
theirs, and declared to a recording so that its plan draws them again on every replay."""
from __future__ import annotations

import torch

from ..abi import PHILOX_OFFSET_BASE, PHILOX_SEED_BIT
from . import recording

# per-call generator state (plan.philox): the two kernel arguments, in order
PHILOX = ("philox_seed", "philox_offset")


def philox_state(device_index: int, increment: int):
    """(seed, offset) for one launch that draws `increment` Philox counters from the default CUDA
    generator of `device_index`, advancing its offset as ATen's kernels do, so `torch.manual_seed`
    makes runs reproducible and successive calls differ. Both int64-typed (see PHILOX_SEED_BIT)."""
    gen = torch.cuda.default_generators[device_index]
    off = gen.get_offset()
    gen.set_offset(off + increment)
    return (gen.initial_seed() & (PHILOX_SEED_BIT - 1)) | PHILOX_SEED_BIT, off + PHILOX_OFFSET_BASE


def philox(position: int, device_index: int, increment: int):
    """`philox_state(device_index, increment)` for the next launch, whose arguments `position` (seed)
    and `position + 1` (offset) they are; a plan recorded from this call draws them the same way on
    every replay (the C++ fast path reads the generator itself), and declines while the stream is
    being captured into a CUDA graph (the state is read on the host)."""
    if recording.active() is not None:
        recording.add_dynamic({position: (int(increment), PHILOX[0]), position + 1: (int(increment), PHILOX[1])})
    return philox_state(device_index, increment)


def philox_for(device, position: int, increment: int):
    """(seed, offset) for a launch whose arguments `position` and `position + 1` take them: on CUDA
    `philox` (the default generator, declared to plans); on the interpreter's CPU tensors a seed drawn
    from the CPU generator and offset 0 (an ATen op: such calls keep the full path)."""
    if device.type == "cuda":
        return philox(position, device.index if device.index is not None else torch.cuda.current_device(),
                      increment)
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64).item()), 0


def capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()

