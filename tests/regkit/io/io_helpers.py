"""Helpers shared by the tests of regkit.io: rotations and RAS affines, world points of every voxel as regkit and as
nibabel compute them, the one-line error check, and a DICOM series writer."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
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


def write_dicom_series(folder: Path, image: sitk.Image, series_uid: str) -> None:
    """Write a 3D int16 image as one DICOM file per slice, with the position/orientation tags a series needs."""
    folder.mkdir(exist_ok=True)
    direction = np.array(image.GetDirection()).reshape(3, 3)
    orientation = "\\".join(f"{v:.12g}" for v in (*direction[:, 0], *direction[:, 1]))
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    for k in range(image.GetDepth()):
        slice_k = image[:, :, k]
        position = "\\".join(f"{v:.12g}" for v in image.TransformIndexToPhysicalPoint((0, 0, k)))
        tags = {
            "0008|0060": "MR",
            "0020|000d": "1.2.826.0.1.3680043.2.1125.7",
            "0020|000e": series_uid,
            "0008|0018": f"{series_uid}.{k + 1}",
            "0020|0013": str(k + 1),
            "0020|0032": position,
            "0020|0037": orientation,
            "0018|0050": f"{image.GetSpacing()[2]:.12g}",
        }
        for tag, value in tags.items():
            slice_k.SetMetaData(tag, value)
        writer.SetFileName(str(folder / f"{series_uid[-3:]}_{k:03d}.dcm"))
        writer.Execute(slice_k)
