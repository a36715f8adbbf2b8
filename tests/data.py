"""Locations of the offline test data (installed packages and Debian's insighttoolkit5-examples)."""

from __future__ import annotations

from pathlib import Path

import pytest

ITK_DATA = Path("/usr/share/doc/insighttoolkit5-examples/examples/Data")


def itk_example(name: str) -> Path:
    """Path of a file from Debian's insighttoolkit5-examples; skips the test if the package is not installed."""
    path = ITK_DATA / name
    if not path.exists():
        pytest.skip(f"{path} missing: apt-get install insighttoolkit5-examples")
    return path


def nibabel_data(name: str) -> Path:
    """Path of a file shipped in nibabel's tests/data folder (e.g. 'anatomical.nii')."""
    import nibabel.tests

    return Path(nibabel.tests.__file__).parent / "data" / name
