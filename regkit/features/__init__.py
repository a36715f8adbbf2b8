"""Learned features for similarity: wavelet convolution layers (reference semantics, optional fused kernels) and the
feature network built from them. Training (:mod:`regkit.features.training`: ``train``, ``synth``, ``recipe``) is
imported on demand."""

# The feature network and its weights files
from regkit.features.network import (
    FeatureMaps,
    FeatureNetwork,
    NetworkSpec,
    load_feature_network,
    save_feature_network,
)

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
    "FeatureMaps",
    "FeatureNetwork",
    "NetworkSpec",
    "WTConv",
    "WTConv2d",
    "WTConv3d",
    "haar_analysis",
    "haar_synthesis",
    "load_feature_network",
    "save_feature_network",
    "wtconv",
    "wtconv_reference",
]
