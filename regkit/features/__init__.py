"""Learned features for similarity: wavelet convolution layers (reference semantics, optional fused kernels)."""

# WTConv layers (Finder et al., ECCV 2024)
from regkit.features.wtconv import (
    WTConv,
    WTConv2d,
    WTConv3d,
    haar_analysis,
    haar_synthesis,
    wtconv,
    wtconv_reference,
)

__all__ = [
    "WTConv",
    "WTConv2d",
    "WTConv3d",
    "haar_analysis",
    "haar_synthesis",
    "wtconv",
    "wtconv_reference",
]
