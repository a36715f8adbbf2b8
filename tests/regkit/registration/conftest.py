"""Fixtures of the tests of regkit.registration: two real brain images, small enough to register in seconds."""

from __future__ import annotations

import pytest

from regkit.demo import load_template
from regkit.io import Image, read_image
from tests.helpers import itk_example
from tests.regkit.registration.cases import shrunk


@pytest.fixture(scope="package")
def brain2d() -> Image:
    """ITK's proton-density brain slice (20-pixel black border), 2 mm pixels: 110 x 128."""
    return shrunk(read_image(itk_example("BrainProtonDensitySliceBorder20.png")), 2)


@pytest.fixture(scope="package")
def brain3d() -> Image:
    """The bundled MNI152 T1 shrunk to 6 mm voxels: 33 x 39 x 31, RAS."""
    return shrunk(load_template(), 3)
