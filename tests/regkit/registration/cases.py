"""What the tests of regkit.registration share: smaller copies of the bundled and ITK example images, and the
configurations of a few quick stages on the CPU."""

from __future__ import annotations

from regkit.config import RegistrationConfig
from regkit.io import Image
from regkit.spatial.filters import gaussian_smooth
from regkit.spatial.pyramid import downsample


def shrunk(image: Image, factor: int) -> Image:
    """``image`` as float32, smoothed (sigma factor/2 voxels) and shrunk by ``factor``."""
    data = gaussian_smooth(image.data.float()[None, None], factor / 2)
    small, grid = downsample(data, image.grid, factor)
    return Image(small[0, 0].contiguous(), grid)


def cpu_config(*stages: dict, dim: int) -> RegistrationConfig:
    """A configuration of these stages for ``dim``-D images, on the CPU."""
    return RegistrationConfig.model_validate({"dim": dim, "device": "cpu", "stages": list(stages)})


def pyramid_levels(iterations: list[int]) -> list[dict]:
    """Pyramid levels for ``len(iterations)`` levels: shrink 2 then 1, or 1 alone."""
    return [{"shrink": 2, "smoothing": 1.0}, {"shrink": 1, "smoothing": 0.0}][-len(iterations) :]


def linear_stage(kind: str, iterations: list[int], learning_rate: float = 1.0, optimizer: str = "adam") -> dict:
    """A ``rigid`` or ``affine`` stage on NCC with these iterations per pyramid level (no early stop)."""
    return {
        "type": kind,
        "similarity": {"name": "ncc"},
        "pyramid": pyramid_levels(iterations),
        "optimizer": {"name": optimizer, "learning_rate": learning_rate, "iterations": iterations, "tolerance": 0.0},
    }


def cpab_stage(cells: int, iterations: list[int], similarity: str = "ncc", learning_rate: float = 0.1) -> dict:
    """A CPAB stage of ``cells`` per axis at every level, with these iterations per pyramid level (no early stop)."""
    return {
        "type": "cpab",
        "similarity": {"name": similarity},
        "pyramid": pyramid_levels(iterations),
        "tessellation": [cells] * len(iterations),
        "steps": 10,
        "optimizer": {"learning_rate": learning_rate, "iterations": iterations, "tolerance": 0.0},
        "prior": {"weight": 0.001},
    }
