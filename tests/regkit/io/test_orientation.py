"""regkit.io.orientation: NIfTI's sform/qform as ITK chooses them, one world position for every orientation on disk,
orientation codes and reorient."""

from __future__ import annotations

import itertools
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
import torch
from nibabel.orientations import apply_orientation, axcodes2ornt, inv_ornt_aff, io_orientation, ornt_transform

from regkit.errors import GeometryError
from regkit.io import Image, orientation_code, read_image, read_image_nibabel, reorient, write_image
from regkit.spatial import Grid
from tests.helpers import nibabel_data
from tests.regkit.io.io_helpers import (
    LPS_FROM_RAS,
    assert_one_line_naming,
    lps_world,
    nibabel_world,
    ras_affine,
    rotation,
)

# ----------------------------------------------------------------------------------------------------------------------
# NIfTI sform and qform, by ITK's rules


def _nifti_sources(tmp: Path) -> dict[str, tuple[Path, np.ndarray]]:
    """NIfTI files with sform/qform combinations, each with the RAS affine ITK must use for it."""
    data = np.arange(5 * 6 * 7, dtype=np.float32).reshape(5, 6, 7)
    zooms = (1.5, 2.0, 2.5)
    s_aff = ras_affine(rotation((10, 20, 30)), zooms, (10.0, -20.0, 30.0))
    q_aff = ras_affine(rotation((-15, 5, 40)), zooms, (-5.0, 7.0, 9.0))
    sheared = s_aff.copy()
    sheared[0, 1] += 0.7
    cases = {  # name: (sform, sform_code, qform, qform_code, affine ITK uses)
        "sform_scanner_differs_from_qform": (s_aff, 1, q_aff, 1, s_aff),
        "sform_aligned_differs_from_qform": (s_aff, 2, q_aff, 1, q_aff),  # nibabel's img.affine would be the sform
        "qform_only": (s_aff, 0, q_aff, 1, q_aff),
        "sform_only": (s_aff, 2, q_aff, 0, s_aff),
        "sheared_sform_with_qform": (sheared, 2, q_aff, 1, q_aff),
        "no_orientation": (s_aff, 0, q_aff, 0, np.diag([-1.5, -2.0, 2.5, 1.0])),
    }
    out = {}
    for name, (sform, scode, qform, qcode, expected) in cases.items():
        img = nib.Nifti1Image(data, None)
        img.set_sform(sform, code=scode)
        img.set_qform(qform, code=qcode)
        nib.save(img, tmp / f"{name}.nii.gz")
        out[name] = (tmp / f"{name}.nii.gz", expected)
    return out


def test_sform_qform_choice_follows_itk(tmp_path: Path) -> None:
    for name, (path, expected_ras) in _nifti_sources(tmp_path).items():
        image = read_image(path)
        itk = sitk.ReadImage(str(path))  # raw SimpleITK, for reference
        np.testing.assert_allclose(image.origin, itk.GetOrigin(), atol=1e-5, err_msg=name)
        np.testing.assert_allclose(image.direction.ravel(), itk.GetDirection(), atol=1e-6, err_msg=name)
        np.testing.assert_allclose(lps_world(image), nibabel_world(path, expected_ras), atol=1e-4, err_msg=name)
    # Where ITK does not take the sform although sform_code > 0, nibabel's own img.affine disagrees with ITK.
    path, expected = _nifti_sources(tmp_path)["sform_aligned_differs_from_qform"]
    assert not np.allclose(nib.load(path).affine, expected, atol=1e-3)


def test_sheared_sform_without_qform_is_refused_by_both_readers(tmp_path: Path) -> None:
    affine = ras_affine(np.eye(3), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0))
    affine[0, 1] = 0.5
    img = nib.Nifti1Image(np.zeros((3, 4, 5), np.float32), None)
    img.set_sform(affine, code=2)
    img.set_qform(None, code=0)
    path = tmp_path / "sheared.nii"
    nib.save(img, path)
    for reader in (read_image, read_image_nibabel):
        with pytest.raises(GeometryError, match="shear") as err:
            reader(path)
        assert_one_line_naming(err, path)


def test_nibabel_reader_agrees_on_sform_qform_cases(tmp_path: Path) -> None:
    for name, (path, _) in _nifti_sources(tmp_path).items():
        np.testing.assert_allclose(
            lps_world(read_image(path)), lps_world(read_image_nibabel(path)), atol=1e-4, err_msg=name
        )


# ----------------------------------------------------------------------------------------------------------------------
# The same anatomy, whatever the orientation on disk


def _landmark_volume() -> tuple[np.ndarray, np.ndarray]:
    """An asymmetric [i, j, k] int16 volume with one brightest voxel, and its LPS-oriented RAS affine."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 1000, size=(9, 10, 11)).astype(np.int16)
    data[2, 7, 3] = 5000
    return data, ras_affine(np.diag([-1.0, -1.0, 1.0]), (0.8, 1.1, 1.7), (40.0, 25.0, -12.0))  # LPS on disk


def test_landmark_has_one_world_position_in_lps_ras_las_and_oblique_files(tmp_path: Path) -> None:
    data, affine = _landmark_volume()
    ijk = np.array([2, 7, 3, 1.0])
    landmark_ras = affine @ ijk
    landmark_lps = (LPS_FROM_RAS @ landmark_ras)[:3]
    reference = read_image(_save(nib.Nifti1Image(data, affine), tmp_path / "lps.nii.gz"))
    assert orientation_code(reference.grid) == "LPS"
    for code in ("RAS", "LAS", "PIR", "SLA"):  # flip/permute the array and update the header, with nibabel
        transform = ornt_transform(io_orientation(affine), axcodes2ornt(tuple(code)))
        img = nib.Nifti1Image(apply_orientation(data, transform), affine @ inv_ornt_aff(transform, data.shape))
        image = read_image(_save(img, tmp_path / f"{code}.nii.gz"))
        assert orientation_code(image.grid) == code
        _assert_landmark_at(image, landmark_lps)
        _assert_same_world_values(image, reference)
    # Oblique: a rotated grid with the landmark voxel placed where that grid reaches the same world point.
    oblique = ras_affine(rotation((20, -35, 50)), (0.8, 1.1, 1.7), (0.0, 0.0, 0.0))
    place = np.array([4, 3, 6, 1.0])
    oblique[:3, 3] = landmark_ras[:3] - oblique[:3, :3] @ place[:3]
    volume = np.zeros((9, 10, 11), np.int16)
    volume[4, 3, 6] = 5000
    _assert_landmark_at(read_image(_save(nib.Nifti1Image(volume, oblique), tmp_path / "oblique.nii.gz")), landmark_lps)
    # The same through write_image in MetaImage and NRRD, after reorient().
    for code, ext in (("RAS", ".mha"), ("LAS", ".nrrd"), ("IPL", ".mhd")):
        written = read_image(write_image(reorient(reference, code), tmp_path / f"re_{code}{ext}"))
        assert orientation_code(written.grid) == code
        _assert_landmark_at(written, landmark_lps)


def _save(img: nib.Nifti1Image, path: Path) -> Path:
    nib.save(img, path)
    return path


def _assert_landmark_at(image: Image, world_lps: np.ndarray) -> None:
    """The brightest voxel of ``image`` has its centre at ``world_lps``."""
    kji = np.unravel_index(int(image.data.argmax()), image.shape)
    world = image.index_to_world(torch.tensor(kji[::-1], dtype=torch.float64)).numpy()
    np.testing.assert_allclose(world, world_lps, atol=1e-4)


def _assert_same_world_values(image: Image, reference: Image) -> None:
    """Every voxel of ``image`` holds the value ``reference`` has at the same world point (grids of equal voxels)."""
    index = reference.world_to_index(image.grid.world_points(torch.float64))
    rounded = index.round()
    assert (index - rounded).abs().max() < 1e-4  # NIfTI stores the geometry as float32
    tensor_index = rounded.long().unbind(-1)[::-1]  # (i, j[, k]) -> [k,] j, i
    torch.testing.assert_close(reference.data[tensor_index], image.data, rtol=0, atol=0)


def test_as_closest_canonical_copy_of_anatomical_keeps_every_voxel_in_place(tmp_path: Path) -> None:
    path = nibabel_data("anatomical.nii")
    canonical = read_image(_save(nib.as_closest_canonical(nib.load(path)), tmp_path / "canonical.nii"))
    assert orientation_code(canonical.grid) == "RAS"
    _assert_same_world_values(canonical, read_image(path))


# ----------------------------------------------------------------------------------------------------------------------
# orientation_code and reorient


def test_orientation_code_matches_nibabel_for_signed_permutations_and_oblique_directions() -> None:
    rng = np.random.default_rng(0)
    directions = []
    for perm in itertools.permutations(range(3)):
        for signs in itertools.product((1.0, -1.0), repeat=3):
            directions.append(np.eye(3)[:, perm] * signs)
    for _ in range(40):
        q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
        directions.append(q)
    for lps in directions:
        grid = Grid.create((4, 5, 6), spacing=(1.0, 2.0, 3.0), direction=lps)
        ras = LPS_FROM_RAS @ grid.affine()
        assert orientation_code(grid) == "".join(nib.aff2axcodes(ras)), lps
    assert orientation_code(Grid.create((4, 5))) == "LP"
    assert orientation_code(Grid.create((4, 5), direction=[[0, -1], [-1, 0]])) == "AR"


@pytest.mark.parametrize("oblique", [False, True])
def test_reorient_moves_voxels_with_the_header(oblique: bool) -> None:
    rng = np.random.default_rng(1)
    direction = rotation((12, -25, 33)) if oblique else np.diag([1.0, -1.0, 1.0])
    grid = Grid.create((5, 6, 7), spacing=(0.7, 1.3, 2.1), origin=(-3.0, 8.0, 11.0), direction=direction)
    image = Image(torch.from_numpy(rng.normal(size=grid.shape)), grid)
    for code in ("RAS", "LPS", "IRP", "ASL"):
        out = reorient(image, code)
        assert orientation_code(out.grid) == code
        _assert_same_world_values(out, image)
        back = reorient(out, orientation_code(grid))
        torch.testing.assert_close(back.data, image.data, rtol=0, atol=0)
        np.testing.assert_allclose(lps_world(back), lps_world(image), atol=1e-12)
    image2d = Image(torch.arange(12.0).reshape(3, 4), Grid.create((4, 3), spacing=(0.5, 2.0), origin=(1.0, 2.0)))
    for code in ("RA", "AL", "PR"):
        out = reorient(image2d, code)
        assert orientation_code(out.grid) == code
        _assert_same_world_values(out, image2d)
    for bad in ("RAX", "RRS", "RA", "LPSI"):
        with pytest.raises(GeometryError, match="orientation code"):
            reorient(image, bad)
    with pytest.raises(GeometryError, match="orientation code"):
        reorient(image2d, "RS")
