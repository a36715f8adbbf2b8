"""Helpers of the tests of regkit.io: rotations and RAS affines, world points of every voxel as regkit and as nibabel
compute them, and the one-line error check (the DICOM series writer, shared with napari_regkit's tests, is in
tests/helpers.py)."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from regkit.io import Image

LPS_FROM_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


def rotation(angles_deg: tuple[float, float, float]) -> np.ndarray:
    """Rotation matrix R = Rz Ry Rx for angles about x, y, z in degrees."""
    ax, ay, az = np.radians(angles_deg)
    rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
    ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
    rz = np.array([[np.cos(az), -np.sin(az), 0], [np.sin(az), np.cos(az), 0], [0, 0, 1]])
    return rz @ ry @ rx


def ras_affine(rot: np.ndarray, zooms: tuple[float, ...], offset: tuple[float, ...]) -> np.ndarray:
    """4x4 voxel-to-RAS matrix with the given rotation, voxel sizes and translation."""
    a = np.eye(4)
    a[:3, :3] = rot @ np.diag(zooms)
    a[:3, 3] = offset
    return a


def lps_world(image: Image) -> np.ndarray:
    """LPS world points of all voxel centres, shape (*image.shape, ndim), float64."""
    return image.grid.world_points(torch.float64).numpy()


def nibabel_world(path: Path, affine: np.ndarray | None = None) -> np.ndarray:
    """World points from a RAS affine (default: nibabel's img.affine), converted to LPS, in [k, j, i] layout."""
    img = nib.load(path)
    affine = img.affine if affine is None else affine
    ijk = np.stack(np.meshgrid(*[np.arange(s) for s in img.shape[:3]], indexing="ij"), axis=-1)
    ras = ijk @ affine[:3, :3].T + affine[:3, 3]
    return (ras @ LPS_FROM_RAS[:3, :3].T).transpose(2, 1, 0, 3)


def assert_one_line_naming(err: pytest.ExceptionInfo, path: Path) -> None:
    message = str(err.value)
    assert "\n" not in message, message
    assert path.name in message, message
