"""The feature network: a small ConvNeXt-like encoder of WTConv blocks giving L2-normalised dense features.

Tensors are ``(B, C, *spatial)`` with spatial layout ``[y, x]`` or ``[z, y, x]``; the input has one channel (an image
whose intensities are mapped to about [0, 1], as :func:`regkit.intensity.rescale_intensities` does).

Architecture (one table picks the 2D or 3D layers, as in :mod:`regkit.features.wtconv`)::

    input   the image, or (``self_similarity`` d > 0) its 3**n - 1 self-similarity descriptors at offset d
            (:func:`self_similarity`: MIND-like, independent of the contrast; no parameters)
    stem    3 x 3 (x 3) convolution, input -> c0 channels, full resolution
    stage 0 depths[0] blocks of c0 channels, WTConv with levels[0] wavelet levels
    down    channel LayerNorm, 2 x 2 (x 2) convolution with stride 2, c0 -> c1 (the input is first padded to even
            sizes by repeating its last row, column and slice)
    stage 1 depths[1] blocks of c1 channels, WTConv with levels[1] levels, half resolution
    heads   half: LayerNorm + 1 x 1 convolution of stage 1 -> ``features`` channels;
            full: LayerNorm + 1 x 1 convolution of [stage 0, stage 1 upsampled (linear)] -> ``features`` channels;
            each then centred and scaled per channel (BatchNorm without affine map: batch statistics in training,
            their running averages, fixed, in eval mode)

A block is ``x + gamma * pw2(gelu(pw1(norm(wtconv(x)))))`` (ConvNeXt with the 7 x 7 depthwise convolution replaced by
a WTConv layer; ``norm`` is a LayerNorm over channels at every voxel, ``pw1``/``pw2`` pointwise convolutions with
``mlp_ratio`` times the channels in between, ``gamma`` a per-channel layer scale). No statistic is taken over space
or over the batch in eval mode, so a voxel's features do not depend on the field of view beyond the receptive field.
The heads' centring removes what the features of all voxels of all images share, which would otherwise dominate
them and shrink their differences (it also keeps the contrastive training from starting at near-constant features).

Both outputs are L2-normalised over channels at every voxel. Under mixed precision (autocast) the convolutions run in
bfloat16 while the residual streams, the WTConv layers and the normalisation stay in float32. The full-resolution map
has the input's spatial shape; half-resolution voxel ``j`` sits at full-resolution index ``2 j + 1/2`` (per axis).

WTConv layers run the fused Triton kernels for CUDA tensors and the reference layers otherwise (``backend="auto"``,
see :func:`regkit.features.wtconv.wtconv`). Shipped weights: ``regkit/data/features-2d.pt`` and ``features-3d.pt``,
read by :func:`load_feature_network` with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from regkit import _atomic
from regkit.errors import RegkitError
from regkit.features.wtconv import WTConv
from regkit.spatial.filters import gaussian_smooth

__all__ = [
    "WEIGHTS_FORMAT",
    "FeatureMaps",
    "FeatureNetwork",
    "NetworkSpec",
    "load_feature_network",
    "save_feature_network",
    "self_similarity",
    "shipped_weights_path",
]

#: The ``format`` entry of a weights file; bumped when the layout of the file or of the network changes.
WEIGHTS_FORMAT = "regkit-features/1"

_CONV: dict[int, type[nn.Module]] = {2: nn.Conv2d, 3: nn.Conv3d}
_BATCH_NORM: dict[int, type[nn.Module]] = {2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_LINEAR_MODE = {2: "bilinear", 3: "trilinear"}
_LAYER_SCALE_INIT = 0.1
_SELF_SIMILARITY_EPS = 1e-4  # floor of the mean squared difference (intensities in [0, 1]): noise-only regions


@dataclass(frozen=True)
class NetworkSpec:
    """The hyper-parameters of a :class:`FeatureNetwork` (stored in every weights file)."""

    ndim: int = 2
    """Spatial dimensions, 2 or 3."""
    channels: tuple[int, int] = (16, 32)
    """Channels of stage 0 (full resolution) and stage 1 (half resolution)."""
    depths: tuple[int, int] = (2, 2)
    """WTConv blocks per stage."""
    levels: tuple[int, int] = (4, 3)
    """Wavelet levels of the WTConv layers of each stage."""
    kernel_size: int = 5
    """Odd size of every WTConv depthwise kernel."""
    features: int = 16
    """Channels of the two L2-normalised outputs."""
    mlp_ratio: int = 2
    """Hidden channels of a block's pointwise MLP, per channel."""
    self_similarity: int = 0
    """0: the stem reads the image; ``d > 0``: it reads the image's self-similarity descriptors at offset ``d``
    voxels (:func:`self_similarity`), which do not depend on the contrast."""


class FeatureMaps(NamedTuple):
    """The network's outputs: L2-normalised features at full and at half resolution."""

    full: Tensor
    """``(B, features, *spatial)``, the input's spatial shape."""
    half: Tensor
    """``(B, features, *ceil(spatial / 2))``; voxel ``j`` at full-resolution index ``2 j + 1/2``."""


class ChannelNorm(nn.Module):
    """LayerNorm over the channel axis of ``(B, C, *spatial)`` at every voxel, with a per-channel affine map."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` over channels: ``(B, C, *spatial)`` -> same shape."""
        y = F.layer_norm(x.movedim(1, -1), (x.shape[1],), self.weight, self.bias, self.eps)
        return y.movedim(-1, 1)


class WTConvBlock(nn.Module):
    """``x + gamma * pw2(gelu(pw1(norm(wtconv(x)))))`` on ``(B, C, *spatial)`` (module docstring)."""

    def __init__(self, ndim: int, channels: int, levels: int, kernel_size: int, mlp_ratio: int, backend: str) -> None:
        super().__init__()
        conv = _CONV[ndim]
        self.wtconv = WTConv[ndim](channels, kernel_size, levels, backend=backend)
        self.norm = ChannelNorm(channels)
        self.pw1 = conv(channels, mlp_ratio * channels, 1)
        self.pw2 = conv(mlp_ratio * channels, channels, 1)
        self.gamma = nn.Parameter(torch.full((1, channels) + (1,) * ndim, _LAYER_SCALE_INIT))

    def forward(self, x: Tensor) -> Tensor:
        """One residual block: same shape in and out."""
        return x + self.gamma * self.pw2(F.gelu(self.pw1(self.norm(self.wtconv(x)))))


class FeatureNetwork(nn.Module):
    """Dense contrast-robust features of a one-channel image (module docstring for the architecture).

    Args:
        spec: the hyper-parameters (:class:`NetworkSpec`).
        backend: WTConv backend, ``"auto"`` (fused kernels on CUDA, reference layers on the CPU), ``"reference"`` or
            ``"triton"``; not part of the state_dict, so weights move freely between backends.
    """

    def __init__(self, spec: NetworkSpec, backend: str = "auto") -> None:
        super().__init__()
        if spec.ndim not in _CONV:
            raise ValueError(f"the feature network is 2D or 3D, got ndim={spec.ndim}")
        n, (c0, c1), conv = spec.ndim, spec.channels, _CONV[spec.ndim]
        self.spec = spec
        inputs = 3**n - 1 if spec.self_similarity > 0 else 1
        self.stem = conv(inputs, c0, 3, padding=1)
        self.stage0 = nn.Sequential(
            *(
                WTConvBlock(n, c0, spec.levels[0], spec.kernel_size, spec.mlp_ratio, backend)
                for _ in range(spec.depths[0])
            )
        )
        self.down_norm = ChannelNorm(c0)
        self.down = conv(c0, c1, 2, stride=2)
        self.stage1 = nn.Sequential(
            *(
                WTConvBlock(n, c1, spec.levels[1], spec.kernel_size, spec.mlp_ratio, backend)
                for _ in range(spec.depths[1])
            )
        )
        self.half_norm = ChannelNorm(c1)
        self.half_head = conv(c1, spec.features, 1)
        self.half_centre = _BATCH_NORM[n](spec.features, affine=False)
        self.full_norm = ChannelNorm(c0 + c1)
        self.full_head = conv(c0 + c1, spec.features, 1)
        self.full_centre = _BATCH_NORM[n](spec.features, affine=False)

    def forward(self, x: Tensor) -> FeatureMaps:
        """Features of ``x`` ``(B, 1, *spatial)``: :class:`FeatureMaps` (full and half resolution, unit length)."""
        n = self.spec.ndim
        if x.dim() != n + 2 or x.shape[1] != 1:
            raise ValueError(f"expected an image (B, 1, *spatial) with {n} spatial axes, got {tuple(x.shape)}")
        size, dtype = x.shape[2:], _stream_dtype(x.dtype)
        if self.spec.self_similarity > 0:
            x = self_similarity(x, self.spec.self_similarity)
        full = self.stage0(self.stem(x).to(dtype))
        padded = F.pad(full, [p for s in reversed(size) for p in (0, s % 2)], mode="replicate")
        half = self.stage1(self.down(self.down_norm(padded)).to(dtype))
        up = F.interpolate(half, scale_factor=2, mode=_LINEAR_MODE[n], align_corners=False)
        for axis, s in enumerate(size):
            up = up.narrow(2 + axis, 0, s)
        fused = self.full_centre(self.full_head(self.full_norm(torch.cat((full, up), dim=1))))
        return FeatureMaps(_unit(fused), _unit(self.half_centre(self.half_head(self.half_norm(half)))))


def self_similarity(x: Tensor, distance: int, sigma: float = 1.0) -> Tensor:
    """MIND-like self-similarity descriptors of ``x`` ``(B, 1, *S)``: ``(B, 3**n - 1, *S)``, one channel per offset
    ``r`` in ``{-d, 0, d}^n`` except 0 (``d`` = ``distance`` voxels, index order of the tensor axes):
    ``exp(-D_r / mean_r D_r)`` with ``D_r = G_sigma * (x - x(. + r))^2`` (borders replicated), centred over the
    channels, in ``x``'s dtype (float32 at least; also under autocast). An affine or inverted intensity map leaves them
    unchanged and any other change of contrast changes them little: they carry the anatomy's edges, not its contrast
    (Heinrich et al., MIND, Medical Image Analysis 2012)."""
    n, d = x.dim() - 2, distance
    x = x.to(_stream_dtype(x.dtype))
    padded = F.pad(x, [d] * (2 * n), mode="replicate")
    size = x.shape[2:]
    distances = []
    for offset in itertools.product((-d, 0, d), repeat=n):
        if not any(offset):
            continue
        window = tuple(slice(d + o, d + o + s) for o, s in zip(offset, size, strict=True))
        shifted = padded[(slice(None), slice(None), *window)]
        distances.append((x - shifted) ** 2)
    with torch.autocast(x.device.type, enabled=False):  # the smoothing in x's dtype, as at inference
        squared = gaussian_smooth(torch.cat(distances, dim=1), sigma)
    variance = squared.mean(dim=1, keepdim=True).clamp_min(_SELF_SIMILARITY_EPS)
    descriptors = torch.exp(-squared / variance)
    return descriptors - descriptors.mean(dim=1, keepdim=True)


def _stream_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the residual streams: float32 at least, also under autocast (whose convolutions return bfloat16),
    so that the WTConv layers always see one dtype."""
    return torch.promote_types(dtype, torch.float32)


def _unit(x: Tensor) -> Tensor:
    """``x`` divided by its L2 norm over channels, in float32 at least (zero vectors stay zero)."""
    return F.normalize(x.to(_stream_dtype(x.dtype)), dim=1, eps=1e-6)


# ---- weights files --------------------------------------------------------------------------------------------------


def shipped_weights_path(ndim: int) -> Path:
    """Path of the weights shipped with regkit for ``ndim``-D images: ``regkit/data/features-{ndim}d.pt``."""
    return Path(str(resources.files("regkit") / "data" / f"features-{ndim}d.pt"))


def save_feature_network(network: FeatureNetwork, path: str | Path, meta: Mapping[str, Any] | None = None) -> Path:
    """Write ``network``'s weights (float32, CPU) with its :class:`NetworkSpec` and ``meta`` (plain values: how it was
    trained) to ``path``, readable by :func:`load_feature_network`; written to a temporary file, then renamed."""
    path = Path(path)
    payload = {
        "format": WEIGHTS_FORMAT,
        "spec": {key: list(v) if isinstance(v, tuple) else v for key, v in asdict(network.spec).items()},
        "state_dict": {key: v.detach().float().cpu().contiguous() for key, v in network.state_dict().items()},
        "meta": dict(meta or {}),
    }
    with _atomic.replacing(path) as tmp:
        torch.save(payload, tmp)
    return path


def load_feature_network(
    weights: str | Path | None = None, *, ndim: int | None = None, backend: str = "auto"
) -> FeatureNetwork:
    """A :class:`FeatureNetwork` in eval mode with frozen parameters, from a weights file.

    Args:
        weights: a file written by :func:`save_feature_network` (``regkit train-features``); None: the weights shipped
            for ``ndim``-D images (:func:`shipped_weights_path`).
        ndim: the spatial dimensions the caller needs; required without ``weights``, checked against the file with.
        backend: WTConv backend (see :class:`FeatureNetwork`).

    The file is read with ``torch.load(..., weights_only=True)`` on the CPU. Raises RegkitError naming the file if it is
    missing, not a regkit feature-network file, or made for another dimension.
    """
    if weights is None:
        if ndim is None:
            raise ValueError("give the weights file or ndim (for the shipped weights)")
        weights = shipped_weights_path(ndim)
    path = Path(weights)
    if not path.is_file():
        raise RegkitError(f"{path}: no such feature-network weights file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and torch errors alike: the file is not what we wrote
        raise RegkitError(f"{path}: not a regkit feature-network weights file ({type(err).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != WEIGHTS_FORMAT:
        raise RegkitError(f"{path}: not a regkit feature-network weights file (expected format {WEIGHTS_FORMAT!r})")
    values: dict[str, Any] = {key: tuple(v) if isinstance(v, list) else v for key, v in payload["spec"].items()}
    spec = NetworkSpec(**values)
    if ndim is not None and spec.ndim != ndim:
        raise RegkitError(f"{path}: a {spec.ndim}D feature network, but the images are {ndim}D")
    network = FeatureNetwork(spec, backend=backend)
    network.load_state_dict(payload["state_dict"])
    return network.eval().requires_grad_(False)
