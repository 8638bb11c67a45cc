"""Dispatch: put registry implementations behind ATen's dispatcher, switch them on and off cheaply.

How a call flows: when Gems is selected, the C++ fast path (runtime/fast.py) sits at the backend key
(CUDA, or CPU under the interpreter) and answers a call whose signature it has a plan for; on a miss
it calls the Python kernel Gems registered there for the overload (kernel.py), which checks the
call, runs the implementation (recording the signature's plan, and handing it to the C++ side), or
sends the call to ATen's own kernel with a counted reason (fallback.py).

The package, by job:
    selection.py     enable / disable / use_gems / is_enabled: which overloads, process-wide or per thread
    registration.py  the kernels at the backend key (torch.library) and the C++ fast path on top
    kernel.py        the per-call kernel, top to bottom
    fallback.py      the fallback policy: ATen's kernel, Gems errors, signatures that failed
    stats.py         served / fell back counts and reasons; call-plan counts
    state.py         the dispatcher's state (one object, STATE) and each overload's run-time state
"""
from .fallback import describe_call
from .registration import registered_ops
from .selection import active_config, disable, enable, is_enabled, use_gems
from .state import is_registered, op_runtime
from .stats import plan_stats, reset_stats, stats

__all__ = ["enable", "disable", "is_enabled", "use_gems", "active_config", "stats", "plan_stats", "reset_stats",
           "registered_ops", "describe_call", "op_runtime", "is_registered"]
