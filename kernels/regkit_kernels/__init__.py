"""Compiled kernels for regkit, reached from regkit only through ``regkit._backend`` (which imports them lazily):

- ``cpab``, ``wtconv``: fused Triton kernels for CUDA (torch and triton)
- ``numba``: numba kernels for the CPU (torch and numba), one module per op
- ``launch``: what the Triton launchers share (the interpreter check, block sizes; no imports of its own)
"""
