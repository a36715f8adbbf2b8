"""Images shared by the tests of regkit.registration: smaller copies of the bundled and ITK example images."""

from __future__ import annotations

from regkit.io import Image
from regkit.spatial.filters import gaussian_smooth
from regkit.spatial.pyramid import downsample


def shrunk(image: Image, factor: int) -> Image:
    """``image`` as float32, smoothed (sigma factor/2 voxels) and shrunk by ``factor``."""
    data = gaussian_smooth(image.data.float()[None, None], factor / 2)
    small, grid = downsample(data, image.grid, factor)
    return Image(small[0, 0].contiguous(), grid)
