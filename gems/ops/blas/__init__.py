"""GEMM: the mm/addmm/bmm overloads (overloads.py) on one launch (matmul.py: the tuner's search space and
policy, the pointer kernels of kernels.py, and the TMA and Gluon kernels it may pick, tma.py and gluon.py,
which share epilogue.py), and convolution as implicit GEMMs."""
from . import convolution, overloads  # noqa: F401
