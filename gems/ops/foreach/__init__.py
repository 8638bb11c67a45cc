"""Optimizer ops over tensor lists in one launch: the _foreach_* overloads (overloads.py) and _fused_adamw_
(fused_adam.py), both on launch.py's pointer table."""
from . import fused_adam, overloads  # noqa: F401
