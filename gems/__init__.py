"""Gems: PyTorch ATen operators written in Triton.

    import gems
    gems.enable()                 # every registered ATen overload now runs a Triton kernel
    with gems.use_gems(exclude=["mm"]):
        ...                       # scoped, nestable, thread-local
    gems.stats()                  # served / fell back (and why), per overload

Importing gems changes nothing in ATen; `enable()` / `use_gems()` do.
"""
from . import registry
from .dispatch import disable, enable, is_enabled, plan_stats, registered_ops, reset_stats, stats, use_gems
from .patching import patch, patched, unpatch
from .registry import Unsupported
from .runtime.backends import backend
from .warmup import warmup   # (the name then means the function; the module is sys.modules['gems.warmup'])

__version__ = "0.1.0"


def __getattr__(name):
    # gems.decode (generate's decode steps through CUDA graphs) on first use: it defines the fused ops'
    # custom operators, whose compile support imports torch._dynamo (about a second with warm caches,
    # many more where Python must compile dynamo's sources), which `import gems; gems.enable()` need not pay
    if name == "decode":
        import importlib
        return importlib.import_module(".decode", __name__)
    raise AttributeError(f"module 'gems' has no attribute {name!r}")


__all__ = ["enable", "disable", "use_gems", "is_enabled", "registered_ops", "stats", "plan_stats", "reset_stats",
           "backend", "warmup", "registry", "Unsupported", "patch", "unpatch", "patched"]
