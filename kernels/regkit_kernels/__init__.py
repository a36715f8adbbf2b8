"""Fused Triton kernels for regkit. Depends only on torch and triton; reached from regkit via regkit._backend."""
