"""Compiled kernels for regkit, reached from regkit only through regkit._backend: fused Triton kernels for CUDA
(``cpab``, ``wtconv``; they depend on torch and triton) and numba kernels for the CPU (``*_numba``; torch and numba)."""
