"""regkit.io.describe: the one-line description of an image, on real files."""

from __future__ import annotations

from regkit.io import describe_image, read_image
from tests.helpers import itk_example, nibabel_data

# ----------------------------------------------------------------------------------------------------------------------
# describe_image


def test_describe_image_of_anatomical_nii() -> None:
    info = describe_image(read_image(nibabel_data("anatomical.nii")))
    assert info == {
        "size": "33 x 41 x 25 (x, y, z); tensor [z, y, x]",
        "spacing": "2 x 2 x 2 mm",
        "origin": "(-32, 40, -16) mm LPS",
        "direction": "i (1, 0, 0), j (0, -1, 0), k (0, 0, 1)",
        "orientation": "LAS (i to Left, j to Anterior, k to Superior)",
        "dtype": "int16",
        "range": "-610 .. 30393",
    }
    oblique = describe_image(read_image(itk_example("BrainProtonDensitySliceBorder20DirectionPlus30.mhd")))
    assert oblique["direction"] == "i (0.866025, 0.5), j (-0.5, 0.866025); oblique by up to 30.00 deg"
    assert oblique["orientation"] == "LP (i to Left, j to Posterior)"
