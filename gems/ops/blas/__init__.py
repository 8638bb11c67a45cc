"""GEMM: mm/addmm/bmm (matmul.py: the pointer kernel, the tuner's candidates and the launch), the TMA and
Gluon kernels it may pick (tma.py, gluon.py, sharing epilogue.py), and convolution as implicit GEMMs."""
from . import convolution, matmul  # noqa: F401
