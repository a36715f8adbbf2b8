"""Fused Triton kernels for the WTConv layer (2D and 3D), forward and backward.

Ladder: ``wtconv{2,3}d_*_kernel`` (``kernels2d.py``, ``kernels3d.py``, blocks in ``tile.py``) -> launchers
``wtconv_fwd`` / ``wtconv_bwd`` -> ``WTConvFunction`` -> ``wtconv_fused`` (same arguments as
``regkit.features.wtconv_reference``), which ``regkit.features.WTConv2d/3d(backend="triton")`` call.
"""

from regkit_kernels.wtconv.ops import WTConvFunction, wtconv_bwd, wtconv_fused, wtconv_fwd

__all__ = ["WTConvFunction", "wtconv_bwd", "wtconv_fused", "wtconv_fwd"]
