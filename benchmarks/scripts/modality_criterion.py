"""How linear the intensity relation of a pair is after its affine stage: a truth-free criterion for telling
same-contrast from different-contrast pairs, on the pairs of ``python -m benchmarks accuracy``.

    PYTHONPATH=. python benchmarks/scripts/modality_criterion.py [--sets 2mm,contrast,itk2d,mni2d,nibabel] [--count 2]

Per pair: a moments and affine (MI) registration on the CPU, then, over the fixed voxels where either image has signal
(above 5 % of its rescaled range), Pearson's ``r`` of the fixed and the affinely mapped moving intensities and the
correlation ratio ``eta^2`` (the share of the moving intensities' variance explained by the fixed intensity, in 32
bins). ``r^2 <= eta^2`` up to the binning; their ratio is 1 when the relation is linear (one contrast, up to gain and
offset, which the local NCC assumes) and falls when it is non-linear (another contrast). Prints one line per pair with
the pair's recorded modality.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.accuracy_pairs import make_pairs
from regkit.config import RegistrationConfig
from regkit.intensity import rescale_intensities
from regkit.io import Image
from regkit.registration import register
from regkit.results.resampling import sample_world

BINS = 32


def linearity(fixed: torch.Tensor, moving: torch.Tensor) -> tuple[float, float]:
    """``(r, eta^2)`` of two intensity vectors in [0, 1] (``eta^2`` of ``moving`` given ``fixed``, in :data:`BINS`)."""
    r = float(torch.corrcoef(torch.stack([fixed, moving]))[0, 1])
    bins = torch.clamp((fixed * BINS).long(), 0, BINS - 1)
    counts = torch.bincount(bins, minlength=BINS).clamp_min(1)
    means = torch.zeros(BINS, dtype=moving.dtype).scatter_add(0, bins, moving) / counts
    eta2 = float(((means[bins] - moving.mean()) ** 2).mean() / moving.var())
    return r, eta2


def affine_config(ndim: int) -> RegistrationConfig:
    pyramid = [{"shrink": 4, "smoothing": 2.0}, {"shrink": 2, "smoothing": 1.0}]
    affine = {"learning_rate": 0.5, "iterations": [30, 10]}
    stages = [
        {"type": "moments"},
        {"type": "affine", "similarity": {"name": "mi"}, "pyramid": pyramid, "optimizer": affine},
    ]
    return RegistrationConfig.model_validate({"dim": ndim, "device": "cpu", "stages": stages})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="2mm,contrast,itk2d,mni2d,nibabel")
    parser.add_argument("--count", type=int, default=2, help="pairs per MNI set")
    args = parser.parse_args()
    print(f"{'pair':18s} {'modality':8s} {'r':>7s} {'r^2':>6s} {'eta^2':>6s} {'r^2/eta^2':>9s}")
    for pair_set in args.sets.split(","):
        for pair in make_pairs(pair_set, args.count, 0):
            ndim = pair.fixed.ndim
            result = register(pair.fixed, pair.moving, affine_config(ndim))
            world = pair.fixed.grid.world_points(torch.float64)
            mapped = result.transform.transform_world(world.reshape(-1, ndim)).reshape(world.shape)
            fixed = rescale_intensities(pair.fixed.data).double().flatten()
            moving = Image(rescale_intensities(pair.moving.data), pair.moving.grid)
            moved = sample_world(moving, mapped).double().flatten()
            signal = (fixed > 0.05) | (moved > 0.05)
            r, eta2 = linearity(fixed[signal], moved[signal])
            print(f"{pair.name:18s} {pair.modality:8s} {r:+7.3f} {r * r:6.3f} {eta2:6.3f} {r * r / eta2:9.3f}")


if __name__ == "__main__":
    main()
