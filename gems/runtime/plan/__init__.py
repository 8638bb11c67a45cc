"""Call plans: everything a call's signature decides, computed once; a repeat call is a lookup,
the allocations and the launches.

Why: an eager model calls each op with a handful of signatures, millions of times. What depends only
on the signature (dtypes, shapes, strides, devices, 16-byte alignment, the values of non-tensor
arguments) -- support checks, type promotion, broadcasting, output strides, layout planning, tiles,
grids, the compiled binary -- need not be redone per call.

How: a signature's recording call (the second by default, see runtime/settings.py, GEMS_PLAN_AFTER)
runs the implementation normally while a `Recording` watches it: every output allocation
(`runtime.alloc.empty` / `zeros`), every kernel launch (`LaunchCache.run`) and, through a
TorchDispatchMode, every other ATen op the implementation calls. If it did nothing but allocate,
launch and take views, the recording becomes a *plan*: a small generated Python function that
allocates the same outputs, launches the same binaries directly through Triton's C launcher with the
same grid and constant arguments, and substitutes only what changes per call: the tensors' data
pointers and the values the op marked *dynamic* (a Python scalar operand such as the `2.0` of
`x * 2.0`, `.item()` of a CPU 0-dim tensor). Anything else -- another ATen op (a copy, `resize_`,
`.item()`, `zero_`), an autotuning run, a kernel argument that is neither an input, an allocation nor
a view of one, an ambiguous alias -- marks the signature "no plan" and it keeps the full path (still
correct, just slower). Plans are bounded per overload.

Per call on a hit: the signature tuple, a dict lookup, then the plan: in-place/`out=` overlap guards
(a plan declines with MISS when a written tensor's memory meets another argument's; the full path
then decides exactly as before), `torch.empty_strided` per output, one C launch per kernel.

The generated source of each plan is registered with `linecache` under a readable name
(`<gems plan add.Tensor #3>`), so tracebacks and debuggers show the code that ran. Where the C++
fast path replays the plan (a recipe), the source is compiled only when Python first runs it
(`LazyPlan`): decode meets new signatures every token (the KV cache grows), and a new signature of
`cat` cost 490 us of host with the compile and 264 without (CPU host, launches stubbed).

The package, by job:
    recording.py   the thread's active recording and the hooks ops call while they run
    signature.py   the per-overload signature function; arguments by schema name
    build.py       a recording -> a plan (the generated function and its C++ recipe)
    recipe.py      the plan as data for the C++ fast path (codes: runtime/abi.py)
    cache.py       plan caches and the values they hold (MISS, NO_PLAN, SEEN, AtenPlan, LazyPlan)
    rng.py         per-call Philox state
    launchers.py   the interpreter launch the C++ side calls back, the launch-hook check

This module exports what op implementations call while they run (and what tests inspect); the
dispatcher and runtime/planned.py import `build` for the recording call itself.
"""
from ..abi import INF_RANGE, NUMBER_RANGES
from ..source import compile_source
from .cache import MISS, NO_PLAN, SEEN, AtenPlan, LazyPlan, PlanCache
from .launchers import hooks_active
from .recipe import param_type
from .recording import Recording, active, dynamic, quiet, suspended, taint
from .rng import PHILOX, philox, philox_for, philox_state
from .signature import make_signature, named_args, number_range

__all__ = ["INF_RANGE", "NUMBER_RANGES", "compile_source", "MISS", "NO_PLAN", "SEEN", "AtenPlan", "LazyPlan",
           "PlanCache", "hooks_active", "param_type", "Recording", "active", "dynamic", "quiet", "suspended",
           "taint", "PHILOX", "philox", "philox_for", "philox_state", "make_signature", "named_args",
           "number_range"]
