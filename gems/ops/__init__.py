"""The ATen operators Gems implements, one sub-package per op family; importing them fills the registry.

Each family's `__init__` imports the modules that register overloads (`register(...)` or a
`pointwise(...)` declaration); modules that only hold kernels or shared helpers (attention/kernels.py,
blas/tma.py, foreach/launch.py, memory.py, ...) are imported by the modules that use them. A new op is
a new module in its family plus one line in that family's `__init__`.
"""
from . import attention, blas, foreach, loss, norm, pointwise, random, reduce, shape, sort  # noqa: F401
