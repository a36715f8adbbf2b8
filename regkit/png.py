"""PNG pictures of 8-bit RGB arrays ``(H, W, 3)`` (rows top to bottom), encoded by SimpleITK (libpng): the QC
picture ``qc.png`` of :func:`regkit.results.write_outputs` and the thumbnails of the batch report."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["encode_png", "write_png"]


def write_png(rgb: np.ndarray, path: Path) -> Path:
    """Write the uint8 array ``rgb`` ``(H, W, 3)`` as the PNG file ``path``; returns ``path``."""
    import SimpleITK as sitk

    sitk.WriteImage(sitk.GetImageFromArray(rgb, isVector=True), str(path))
    return path


def encode_png(rgb: np.ndarray) -> bytes:
    """The uint8 array ``rgb`` ``(H, W, 3)`` as PNG file bytes (written by :func:`write_png` into a temporary
    folder: SimpleITK writes files only)."""
    with tempfile.TemporaryDirectory() as folder:
        return write_png(rgb, Path(folder) / "picture.png").read_bytes()
