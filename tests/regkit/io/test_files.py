"""regkit.io.files: reading and writing images with geometry, on real files (nibabel, dipy, nilearn, ITK examples) and
on files written here in every supported format."""

from __future__ import annotations

import gzip
import io
import itertools
import os
import socket
import threading
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
import torch

from regkit.errors import GeometryError, ImageDimensionError, ImageReadError, ImageValueError, ImageWriteError
from regkit.io import Image, describe_image, orientation_code, read_image, read_image_nibabel, write_image
from regkit.spatial import Grid
from tests.helpers import itk_example, nibabel_data, write_dicom_series
from tests.regkit.io.io_helpers import assert_one_line_naming, lps_world, nibabel_world, rotation


@pytest.fixture(scope="module")
def mni_path(tmp_path_factory) -> Path:
    """nilearn's MNI152 2 mm template (RAS, uint8 with intensity scaling), saved as .nii.gz."""
    datasets = pytest.importorskip("nilearn.datasets")
    path = tmp_path_factory.mktemp("mni") / "mni152_2mm.nii.gz"
    nib.save(datasets.load_mni152_template(resolution=2), path)
    return path


@pytest.fixture(scope="module")
def aniso_vox_path() -> Path:
    """dipy's aniso_vox.nii.gz: 4 x 4 x 5 mm voxels, oblique (about 35 degrees), LPS."""
    dipy_data = pytest.importorskip("dipy.data")
    return Path(dipy_data.__file__).parent / "files" / "aniso_vox.nii.gz"


# ----------------------------------------------------------------------------------------------------------------------
# Real inputs: geometry, orientation and values


def test_anatomical_nii_is_las_with_header_geometry() -> None:
    path = nibabel_data("anatomical.nii")
    image = read_image(path)
    assert orientation_code(image.grid) == "LAS" == "".join(nib.aff2axcodes(nib.load(path).affine))
    assert image.data.dtype == torch.int16  # stored big-endian int16; kept as int16
    assert image.grid.size == (33, 41, 25) and image.shape == (25, 41, 33)
    np.testing.assert_array_equal(image.spacing, [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(image.origin, [-32.0, 40.0, -16.0])  # RAS (32, -40, -16) in LPS
    np.testing.assert_array_equal(image.direction, np.diag([1.0, -1.0, 1.0]))
    # Layout: tensor[k, j, i] is nibabel's array[i, j, k], and every voxel has nibabel's world position.
    np.testing.assert_array_equal(image.data.numpy(), np.asarray(nib.load(path).dataobj).transpose(2, 1, 0))
    np.testing.assert_allclose(lps_world(image), nibabel_world(path), atol=1e-5)


def test_ras_mni_template_and_oblique_lps_dipy_volume(mni_path: Path, aniso_vox_path: Path) -> None:
    mni = read_image(mni_path)
    assert orientation_code(mni.grid) == "RAS"
    assert mni.data.dtype == torch.float32  # uint8 on disk with scl_slope: scaled, as ITK does
    np.testing.assert_allclose(mni.data.numpy(), np.asarray(nib.load(mni_path).dataobj).transpose(2, 1, 0), rtol=1e-6)
    np.testing.assert_allclose(lps_world(mni), nibabel_world(mni_path), atol=1e-5)

    aniso = read_image(aniso_vox_path)
    assert orientation_code(aniso.grid) == "LPS" == "".join(nib.aff2axcodes(nib.load(aniso_vox_path).affine))
    np.testing.assert_allclose(aniso.spacing, [4.0, 4.0, 5.0])
    assert describe_image(aniso)["direction"].endswith("deg")  # oblique
    np.testing.assert_allclose(lps_world(aniso), nibabel_world(aniso_vox_path), atol=1e-3)


@pytest.mark.parametrize(
    "source",
    ["anatomical.nii", "resampled_anat_moved.nii", "reoriented_anat_moved.nii", "aniso_vox", "mni", "itk_kmeans"],
)
def test_simpleitk_and_nibabel_readers_agree(source: str, mni_path: Path, aniso_vox_path: Path) -> None:
    path = {"aniso_vox": aniso_vox_path, "mni": mni_path}.get(source)
    if source == "itk_kmeans":
        path = itk_example("KmeansTest_T1UCharRaw.nii.gz")  # 128 x 128 x 62, coronal-like direction
    path = path or nibabel_data(source)
    a = read_image(path, check_finite=False)
    b = read_image_nibabel(path)
    assert a.grid.size == b.grid.size and a.data.dtype == b.data.dtype
    np.testing.assert_allclose(lps_world(a), lps_world(b), atol=1e-4)
    torch.testing.assert_close(a.data, b.data, equal_nan=True, rtol=0, atol=0)
    # The voxels also match SimpleITK's own reading wherever they are finite (ITK's NIfTI reader zeroes NaN/Inf).
    itk_voxels = sitk.GetArrayFromImage(sitk.ReadImage(str(path)))
    finite = np.isfinite(a.data.numpy())
    np.testing.assert_array_equal(a.data.numpy()[finite], itk_voxels[finite])


def test_itk_example_2d_slices_mhd_nrrd_and_png_agree() -> None:
    plus30 = read_image(itk_example("BrainProtonDensitySliceBorder20DirectionPlus30.mhd"))
    c, s = np.cos(np.radians(30)), np.sin(np.radians(30))
    np.testing.assert_allclose(plus30.direction, [[c, -s], [s, c]], atol=1e-7)  # columns: i (c, s), j (-s, c)
    assert plus30.ndim == 2 and plus30.data.dtype == torch.uint8 and plus30.shape == (257, 221)
    assert orientation_code(plus30.grid) == "LP"
    minus30 = read_image(itk_example("BrainProtonDensitySliceBorder20DirectionMinus30.mhd"))
    np.testing.assert_allclose(minus30.direction, [[c, s], [-s, c]], atol=1e-7)
    nrrd = read_image(itk_example("BrainProtonDensitySliceBorder20DirectionPlus30.nhdr"))  # 6 digits in the text
    np.testing.assert_allclose(lps_world(nrrd), lps_world(plus30), atol=1e-4)
    # The PNG is the same slice stored as RGB with equal channels: read as gray, identity geometry.
    png = read_image(itk_example("BrainProtonDensitySliceBorder20.png"))
    torch.testing.assert_close(png.data, plus30.data, rtol=0, atol=0)
    np.testing.assert_array_equal(png.direction, np.eye(2))
    for name in ("BrainProtonDensitySliceShifted13x17y", "BrainProtonDensitySliceShifted13x17yDirectionPlus30"):
        mhd, nhdr = read_image(itk_example(f"{name}.mhd")), read_image(itk_example(f"{name}.nhdr"))
        torch.testing.assert_close(mhd.data, nhdr.data, rtol=0, atol=0)
        np.testing.assert_allclose(lps_world(mhd), lps_world(nhdr), atol=1e-4)
    volume = read_image(itk_example("BrainProtonDensity3Slices.mha"))
    assert volume.shape == (3, 217, 181)
    assert read_image(itk_example("BrainProtonDensity3Slices.mha"), ndim=3).shape == (3, 217, 181)


# ----------------------------------------------------------------------------------------------------------------------
# Round trips


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64]
# Largest direction/spacing/origin error of each format for arbitrary float64 geometry (see regkit.io.files' docstring).
GEOMETRY_ATOL = {".nii": 1e-6, ".nii.gz": 1e-6, ".mha": 0.0, ".mhd": 0.0, ".nrrd": 1e-15, ".nhdr": 1e-15}


def _random_image(ndim: int, dtype: torch.dtype, oblique: bool, seed: int = 0) -> Image:
    rng = np.random.default_rng(seed)
    size = (7, 6, 5)[:ndim]
    if oblique:
        direction = rotation((17, -31, 45)) if ndim == 3 else rotation((0, 0, 30))[:2, :2]
    else:
        direction = np.eye(ndim)
    grid = Grid.create(size, rng.uniform(0.3, 3.0, ndim), rng.uniform(-150, 150, ndim), direction)
    if dtype.is_floating_point:
        data = torch.from_numpy(rng.normal(size=grid.shape) * 1e3).to(dtype)
        data.view(-1)[0] = torch.finfo(dtype).max  # extremes survive bit for bit
        data.view(-1)[1] = torch.finfo(dtype).tiny
    else:
        info = torch.iinfo(dtype)
        data = torch.from_numpy(rng.integers(info.min, info.max, size=grid.shape, endpoint=True)).to(dtype)
        data.view(-1)[0], data.view(-1)[1] = info.min, info.max
    return Image(data, grid)


@pytest.mark.parametrize("ext", list(GEOMETRY_ATOL))
@pytest.mark.parametrize("ndim", [2, 3])
def test_round_trip_is_bit_exact_for_values_and_keeps_geometry(tmp_path: Path, ext: str, ndim: int) -> None:
    for dtype, oblique in itertools.product(DTYPES, (False, True)):
        image = _random_image(ndim, dtype, oblique)
        path = write_image(image, tmp_path / f"img_{dtype}_{oblique}{ext}".replace("torch.", ""))
        back = read_image(path)
        assert back.data.dtype == dtype and back.shape == image.shape, (dtype, ext)
        assert torch.equal(back.data, image.data), (dtype, ext)
        atol = GEOMETRY_ATOL[ext]
        rtol = 1e-7 if ext.startswith(".nii") else 0.0
        np.testing.assert_allclose(back.direction, image.direction, atol=atol, rtol=0)
        np.testing.assert_allclose(back.spacing, image.spacing, atol=0, rtol=rtol)
        np.testing.assert_allclose(back.origin, image.origin, atol=0, rtol=rtol)
    assert sorted(os.listdir(tmp_path)) == sorted(_expected_files(tmp_path, ext))


def _expected_files(folder: Path, ext: str) -> list[str]:
    """Header files written in ``folder`` plus the companion data file .mhd/.nhdr need; no temporary leftovers."""
    headers = [p.name for p in folder.iterdir() if p.name.endswith(ext)]
    companion = {".mhd": ".zraw", ".nhdr": ".raw.gz"}.get(ext)
    return headers + [h.removesuffix(ext) + companion for h in headers] if companion else headers


def test_nifti_geometry_is_exact_when_float32_holds_it(tmp_path: Path) -> None:
    direction = np.eye(3)[:, [1, 0, 2]] * [1.0, -1.0, -1.0]
    grid = Grid.create((4, 5, 6), spacing=(0.5, 1.25, 2.0), origin=(-90.25, 126.5, -72.0), direction=direction)
    image = Image(torch.arange(120, dtype=torch.float32).reshape(grid.shape), grid)
    back = read_image(write_image(image, tmp_path / "exact.nii.gz"))
    assert back.grid == grid


def test_companion_files_are_written_under_the_final_name(tmp_path: Path) -> None:
    image = _random_image(3, torch.int16, oblique=True)
    write_image(image, tmp_path / "scan.mhd")
    write_image(image, tmp_path / "scan.nhdr")
    assert "ElementDataFile = scan.zraw" in (tmp_path / "scan.mhd").read_text()
    assert "data file: scan.raw.gz" in (tmp_path / "scan.nhdr").read_text()
    assert sorted(os.listdir(tmp_path)) == ["scan.mhd", "scan.nhdr", "scan.raw.gz", "scan.zraw"]
    # Overwriting replaces both files.
    write_image(Image(image.data + 1, image.grid), tmp_path / "scan.mhd")
    assert torch.equal(read_image(tmp_path / "scan.mhd").data, image.data + 1)


def test_png_round_trip_keeps_8_and_16_bit_values_and_spacing(tmp_path: Path) -> None:
    grid = Grid.create((5, 4), spacing=(0.5, 0.25))
    u8 = Image(torch.arange(20, dtype=torch.uint8).reshape(4, 5) * 12, grid)
    assert torch.equal(read_image(write_image(u8, tmp_path / "u8.png")).data, u8.data)
    u16 = Image(torch.arange(20, dtype=torch.int32).reshape(4, 5) * 3000 + 5, grid)  # uint16 in the file
    back = read_image(write_image(u16, tmp_path / "u16.png"))
    assert back.data.dtype == torch.int32 and torch.equal(back.data, u16.data)
    np.testing.assert_array_equal(back.spacing, [0.5, 0.25])
    moved = Image(u8.data, Grid.create((5, 4), origin=(3.0, 4.0)))
    with pytest.warns(UserWarning, match="origin"):
        write_image(moved, tmp_path / "moved.png")
    for bad, match in (
        (Image(u16.data - 10, grid), "unsigned"),
        (Image(u8.data.float(), grid), "unsigned"),
        (_random_image(3, torch.uint8, False), "2D"),
    ):
        with pytest.raises(ImageWriteError, match=match):
            write_image(bad, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_unsigned_types_are_widened_and_bool_half_are_written_as_uint8_float32(tmp_path: Path) -> None:
    values = np.array([[0, 1, 65535], [7, 8, 9]], dtype=np.uint16)
    for dtype, expected in ((np.uint16, torch.int32), (np.uint32, torch.int64), (np.uint64, torch.int64)):
        itk = sitk.GetImageFromArray(values.astype(dtype) * (65536 if dtype != np.uint16 else 1))
        sitk.WriteImage(itk, str(tmp_path / "u.mha"))
        image = read_image(tmp_path / "u.mha")
        assert image.data.dtype == expected
        np.testing.assert_array_equal(image.data.numpy(), sitk.GetArrayFromImage(itk).astype(np.int64))
    big = sitk.GetImageFromArray(np.array([[2**63 + 5]], dtype=np.uint64))
    sitk.WriteImage(big, str(tmp_path / "big.mha"))
    with pytest.raises(ImageValueError, match="uint64") as err:
        read_image(tmp_path / "big.mha")
    assert_one_line_naming(err, tmp_path / "big.mha")
    grid = Grid.create((3, 2))
    mask = read_image(
        write_image(Image(torch.tensor([[True, False, True], [False, True, False]]), grid), tmp_path / "mask.nii.gz")
    )
    assert mask.data.dtype == torch.uint8 and mask.data.tolist() == [[1, 0, 1], [0, 1, 0]]
    half = read_image(write_image(Image(torch.full((2, 3), 0.5, dtype=torch.float16), grid), tmp_path / "h.mha"))
    assert half.data.dtype == torch.float32 and torch.all(half.data == 0.5)


# ----------------------------------------------------------------------------------------------------------------------
# DICOM series


def test_dicom_series_folder_is_read_with_its_geometry(tmp_path: Path) -> None:
    voxels = (np.arange(4 * 5 * 6).reshape(4, 5, 6) * 7 - 50).astype(np.int16)
    itk = sitk.GetImageFromArray(voxels)
    itk.SetDirection(rotation((10, -20, 30)).ravel().tolist())
    itk.SetSpacing((0.8, 0.9, 2.5))
    itk.SetOrigin((-10.5, 20.25, 33.0))
    write_dicom_series(tmp_path / "series", itk, "1.2.826.0.1.3680043.2.1125.7.101")
    image = read_image(tmp_path / "series")
    assert image.data.dtype == torch.int16
    np.testing.assert_array_equal(image.data.numpy(), voxels)
    np.testing.assert_allclose(image.spacing, itk.GetSpacing(), rtol=1e-8)
    np.testing.assert_allclose(image.origin, itk.GetOrigin(), atol=1e-8)
    np.testing.assert_allclose(image.direction.ravel(), itk.GetDirection(), atol=1e-9)
    # A second series in the same folder: the first one is read, with a warning.
    write_dicom_series(tmp_path / "series", itk[:, :, :2], "1.2.826.0.1.3680043.2.1125.7.102")
    with pytest.warns(UserWarning, match="2 DICOM series"):
        read_image(tmp_path / "series")


def test_folder_without_dicom_series_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "empty_study"
    folder.mkdir()
    (folder / "notes.txt").write_text("no images here")
    with pytest.raises(ImageReadError, match="no DICOM series") as err:
        read_image(folder)
    assert_one_line_naming(err, folder)


# ----------------------------------------------------------------------------------------------------------------------
# Bad input: one specific exception and one line naming the file


def _write_mha(path: Path, *, spacing: str = "1 1 1", matrix: str = "1 0 0 0 1 0 0 0 1") -> Path:
    """A 4 x 3 x 2 int16 MetaImage with the given header fields (text, as ITK would store them)."""
    header = (
        f"ObjectType = Image\nNDims = 3\nBinaryData = True\nBinaryDataByteOrderMSB = False\n"
        f"TransformMatrix = {matrix}\nOffset = 0 0 0\nElementSpacing = {spacing}\nDimSize = 4 3 2\n"
        f"ElementType = MET_SHORT\nElementDataFile = LOCAL\n"
    )
    path.write_bytes(header.encode() + np.arange(24, dtype="<i2").tobytes())
    return path


def _write_nifti(path: Path, data: np.ndarray, zooms: tuple[float, ...] | None = None, **header) -> Path:
    img = nib.Nifti1Image(data, np.eye(4))
    if zooms is not None:
        img.header["pixdim"][1 : len(zooms) + 1] = zooms
    for key, value in header.items():
        img.header[key] = value
    nib.save(img, path)
    return path


def test_missing_file_and_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(ImageReadError, match="no such file") as err:
        read_image(tmp_path / "absent.nii.gz")
    assert_one_line_naming(err, tmp_path / "absent.nii.gz")
    (tmp_path / "scan.img.bz2").write_bytes(b"x")
    with pytest.raises(ImageReadError, match=r"\.nii\.gz.*\.nrrd.*DICOM folder") as err:
        read_image(tmp_path / "scan.img.bz2")
    assert_one_line_naming(err, tmp_path / "scan.img.bz2")
    with pytest.raises(ImageReadError, match="NIfTI files"):
        read_image_nibabel(itk_example("BrainProtonDensity3Slices.mha"))


def test_truncated_and_corrupt_files(tmp_path: Path) -> None:
    full = _write_nifti(tmp_path / "full.nii.gz", np.random.default_rng(0).random((20, 20, 20), dtype=np.float32))
    blob = full.read_bytes()
    cases = {
        "truncated.nii.gz": blob[: len(blob) * 2 // 3],  # ITK alone would fill the missing voxels with 0
        "crc.nii.gz": blob[:-8] + bytes([blob[-8] ^ 0xFF]) + blob[-7:],
        "garbage.nii.gz": b"not an image at all" * 10,
        "empty.nii": b"",
    }
    plain = _write_nifti(tmp_path / "plain.nii", np.zeros((20, 20, 20), np.float32)).read_bytes()
    cases["truncated.nii"] = plain[: len(plain) // 2]
    mha = _write_mha(tmp_path / "ok.mha").read_bytes()
    cases["truncated.mha"] = mha[:-10]
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        readers = (read_image, read_image_nibabel) if ".nii" in name else (read_image,)
        for reader in readers:
            with pytest.raises(ImageReadError, match=r"corrupt|truncated") as err:
                reader(path)
            assert_one_line_naming(err, path)


def test_four_and_five_dimensional_and_vector_images(tmp_path: Path) -> None:
    path = _write_nifti(tmp_path / "bold.nii.gz", np.zeros((9, 10, 11, 4), np.float32))
    with pytest.raises(ImageDimensionError, match=r"4 dimensions \(9x10x11x4\).*axis 4.*fslroi") as err:
        read_image(path)
    assert_one_line_naming(err, path)
    with pytest.raises(ImageDimensionError, match=r"4 dimensions"):
        read_image_nibabel(path)
    one_volume = _write_nifti(tmp_path / "one.nii.gz", np.zeros((9, 10, 11, 1), np.float32))
    assert read_image(one_volume).shape == (11, 10, 9) == read_image_nibabel(one_volume).shape
    five = _write_nifti(tmp_path / "five.nii.gz", np.zeros((9, 10, 11, 2, 3), np.float32))
    with pytest.raises(ImageDimensionError, match=r"5 dimensions \(9x10x11x2x3\)") as err:
        read_image(five)
    assert_one_line_naming(err, five)
    vector = nib.Nifti1Image(np.zeros((9, 10, 11, 1, 3), np.float32), np.eye(4))
    vector.header.set_intent("vector")  # a displacement field as ITK/ANTs store it
    nib.save(vector, tmp_path / "warp.nii.gz")
    with pytest.raises(ImageDimensionError, match="3 components") as err:
        read_image(tmp_path / "warp.nii.gz")
    assert_one_line_naming(err, tmp_path / "warp.nii.gz")
    red, gray = sitk.Image(4, 5, sitk.sitkUInt8) + 200, sitk.Image(4, 5, sitk.sitkUInt8) + 9
    rgb = sitk.Compose([red, gray, gray])
    sitk.WriteImage(rgb, str(tmp_path / "colour.png"))
    with pytest.raises(ImageDimensionError, match="RGB") as err:
        read_image(tmp_path / "colour.png")
    assert_one_line_naming(err, tmp_path / "colour.png")


def test_single_slice_volumes_and_ndim(tmp_path: Path) -> None:
    data = np.arange(20, dtype=np.float32).reshape(5, 4, 1)
    path = _write_nifti(tmp_path / "slice.nii.gz", data)
    assert read_image(path).shape == (1, 4, 5)
    flat = read_image(path, ndim=2)
    assert flat.shape == (4, 5) and flat.ndim == 2
    np.testing.assert_array_equal(flat.data.numpy(), data[:, :, 0].T)
    stack = _write_nifti(tmp_path / "stack.nii.gz", np.zeros((5, 4, 3), np.float32))
    with pytest.raises(ImageDimensionError, match=r"2D image here.*axis 3") as err:
        read_image(stack, ndim=2)
    assert_one_line_naming(err, stack)
    png = itk_example("BrainProtonDensitySliceBorder20.png")
    with pytest.raises(ImageDimensionError, match="3D volume is expected") as err:
        read_image(png, ndim=3)
    assert_one_line_naming(err, png)
    tilted = sitk.GetImageFromArray(np.zeros((1, 4, 5), np.float32))
    tilted.SetDirection(rotation((30, 0, 0)).ravel().tolist())
    sitk.WriteImage(tilted, str(tmp_path / "tilted.mha"))
    assert read_image(tmp_path / "tilted.mha").ndim == 3
    with pytest.raises(ImageDimensionError, match="oblique") as err:
        read_image(tmp_path / "tilted.mha", ndim=2)
    assert_one_line_naming(err, tmp_path / "tilted.mha")


@pytest.mark.parametrize(
    ("name", "make", "match"),
    [
        ("zero_spacing.mha", lambda p: _write_mha(p, spacing="0 1 1"), "spacing"),
        ("negative_spacing.mha", lambda p: _write_mha(p, spacing="-1 1 1"), "spacing"),
        ("singular.mha", lambda p: _write_mha(p, matrix="1 0 0 1 0 0 0 0 1"), "singular"),
        ("skewed.mha", lambda p: _write_mha(p, matrix="1 0 0 0.5 1 0 0 0 1"), "orthonormal"),
        ("zero_pixdim.nii", lambda p: _write_nifti(p, np.zeros((3, 4, 5), np.int16), zooms=(0.0, 1.0, 1.0)), "pixdim"),
        ("negative_pixdim.nii.gz", lambda p: _write_nifti(p, np.zeros((3, 4, 5), np.int16), zooms=(1, -2, 1)), "pix"),
        # ITK reads these as 0 (spacing 0, or a silently wrong origin or direction): refused as not finite
        ("nan_spacing.mha", lambda p: _write_mha(p, spacing="1 nan 1"), "ElementSpacing holds 'nan', not a finite"),
        ("inf_matrix.mha", lambda p: _write_mha(p, matrix="1 0 0 0 1 0 0 0 inf"), "TransformMatrix holds 'inf'"),
        ("word_spacing.mha", lambda p: _write_mha(p, spacing="1 1 one"), "holds 'one', not a finite number"),
        ("nan_pixdim.nii", lambda p: _write_nifti(p, np.zeros((3, 4, 5), np.int16), zooms=(np.nan, 1, 1)), "finite"),
    ],
)
def test_invalid_geometry(tmp_path: Path, name: str, make, match: str) -> None:
    path = make(tmp_path / name)
    readers = (read_image, read_image_nibabel) if ".nii" in name else (read_image,)
    for reader in readers:
        with pytest.raises(GeometryError, match=match) as err:
            reader(path)
        assert_one_line_naming(err, path)


def test_non_finite_voxels(tmp_path: Path) -> None:
    data = np.ones((4, 5, 6), np.float32)
    data[0, 0, 0], data[1, 2, 3], data[3, 4, 5] = np.nan, np.inf, -np.inf
    for name in ("nan.nii.gz", "nan.mha"):
        path = tmp_path / name
        if name.endswith(".mha"):
            sitk.WriteImage(sitk.GetImageFromArray(data.transpose(2, 1, 0)), str(path))
        else:
            _write_nifti(path, data)
        with pytest.raises(ImageValueError, match=r"3 non-finite voxels \(1 NaN, 2 Inf\)") as err:
            read_image(path)
        assert_one_line_naming(err, path)
        kept = read_image(path, check_finite=False).data.numpy()  # NaN stays NaN (ITK's NIfTI reader gives 0)
        assert np.isnan(kept).sum() == 1 and np.isinf(kept).sum() == 2
        assert "1 NaN, 2 Inf" in describe_image(read_image(path, check_finite=False))["range"]


# ----------------------------------------------------------------------------------------------------------------------
# Failed writes leave nothing behind


def test_write_to_missing_folder_or_unknown_extension(tmp_path: Path) -> None:
    image = _random_image(3, torch.float32, oblique=False)
    with pytest.raises(ImageWriteError, match="does not exist") as err:
        write_image(image, tmp_path / "no" / "such" / "out.nii.gz")
    assert_one_line_naming(err, tmp_path / "out.nii.gz")
    with pytest.raises(ImageWriteError, match="unknown image extension") as err:
        write_image(image, tmp_path / "out.tiff")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["out.nii.gz", "out.mhd", "out.nhdr", "out.mha"])
def test_writer_failing_midway_leaves_no_partial_file(tmp_path: Path, monkeypatch, name: str) -> None:
    image = _random_image(3, torch.float32, oblique=True)
    write_image(image, tmp_path / name)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def failing_write(itk_image, filename, *args, **kwargs):
        Path(filename).write_bytes(b"partial header")
        Path(filename).with_name(Path(filename).name.split(".")[0] + ".zraw").write_bytes(b"partial data")
        raise RuntimeError("Exception thrown in SimpleITK ImageFileWriter_Execute:\nITK ERROR: disk full")

    monkeypatch.setattr(sitk, "WriteImage", failing_write)
    with pytest.raises(ImageWriteError, match="disk full") as err:
        write_image(Image(image.data * 2, image.grid), tmp_path / name)
    assert_one_line_naming(err, tmp_path / name)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # old file intact, no temporaries


def test_data_file_is_moved_into_place_before_its_header(tmp_path: Path, monkeypatch) -> None:
    moved: list[str] = []
    real_replace = os.replace

    def recording_replace(src, dst) -> None:
        moved.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    write_image(_random_image(3, torch.int16, oblique=False), tmp_path / "scan.mhd")
    assert moved == ["scan.zraw", "scan.mhd"]  # a reader never finds a header whose data file is missing


@pytest.mark.parametrize("header", ["BrainProtonDensitySliceBorder20.mhd", "BrainProtonDensitySliceBorder20.nhdr"])
def test_detached_headers_read_voxels_only_from_their_own_folder(tmp_path, monkeypatch, header):
    """A MetaImage or NRRD header naming a voxel file outside its folder is refused (it could make regkit read any
    file, e.g. /etc/passwd), unless REGKIT_DATA_FILES_ANYWHERE=1; a missing voxel file is named."""
    from regkit.io.files import DATA_FILES_ANYWHERE

    source = itk_example(header)
    raw = itk_example("BrainProtonDensitySliceBorder20.raw")
    text = source.read_text()
    here = tmp_path / "here"
    here.mkdir()
    (here / raw.name).write_bytes(raw.read_bytes())
    (here / header).write_text(text)
    expected = read_image(here / header)
    assert expected.data.shape == (257, 221)

    outside = text.replace(raw.name, f"../{raw.name}")
    (tmp_path / raw.name).write_bytes(raw.read_bytes())
    (here / header).write_text(outside)
    with pytest.raises(ImageReadError) as err:
        read_image(here / header)
    assert_one_line_naming(err, here / header)
    assert "outside the header's folder" in str(err.value) and DATA_FILES_ANYWHERE in str(err.value)
    (here / header).write_text(text.replace(raw.name, "/etc/passwd"))
    with pytest.raises(ImageReadError, match="outside the header's folder"):
        read_image(here / header)

    monkeypatch.setenv(DATA_FILES_ANYWHERE, "1")
    (here / header).write_text(outside)
    assert torch.equal(read_image(here / header).data, expected.data)

    (here / header).write_text(text.replace(raw.name, "missing.raw"))
    with pytest.raises(ImageReadError, match=r"missing\.raw does not exist"):
        read_image(here / header)


# ----------------------------------------------------------------------------------------------------------------------
# Hostile inputs: refused before a native reader opens them (tests/regkit/io/test_fuzz_readers.py mutates files)


def _nifti_bytes(data: np.ndarray, **fields) -> bytes:
    """A single-file NIfTI-1 of ``data`` whose header ``fields`` (name: value) are then set in the bytes as stored."""
    img = nib.Nifti1Image(data, np.eye(4))
    raw = bytearray(img.to_bytes())
    header = nib.Nifti1Header.from_fileobj(io.BytesIO(raw), check=False)
    for key, value in fields.items():
        header[key] = value
    raw[:348] = header.binaryblock
    return bytes(raw)


def test_file_names_simpleitk_cannot_take_are_refused(tmp_path: Path) -> None:
    """A name that is not valid UTF-8 (lone surrogates in Python) aborted the process inside SimpleITK."""
    image = _random_image(3, torch.int16, oblique=False)
    valid = write_image(image, tmp_path / "valid.nii.gz")
    bad = tmp_path / os.fsdecode(b"\xff.nii.gz")
    bad.write_bytes(valid.read_bytes())
    for reader in (read_image, read_image_nibabel):
        with pytest.raises(ImageReadError, match=r"'.*\\udcff\.nii\.gz': the file name is not valid UTF-8") as err:
            reader(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ImageWriteError, match="not valid UTF-8"):
        write_image(image, tmp_path / os.fsdecode(b"out\xfe.mha"))
    with pytest.raises(ImageReadError, match="NUL byte"):
        read_image(tmp_path / "a\0.nii")
    # A DICOM folder is refused only for the names of the series' files.
    series = tmp_path / "series"
    write_dicom_series(series, sitk.GetImageFromArray(np.zeros((3, 4, 5), np.int16)), "1.2.3.4.100")
    first = sorted(series.iterdir())[0]
    first.rename(series / os.fsdecode(b"\xfe.dcm"))
    with pytest.raises(ImageReadError, match="not valid UTF-8") as err:
        read_image(series)
    assert "\n" not in str(err.value)


def _error_within(read, path: Path, seconds: float = 10.0) -> BaseException:
    """The exception ``read(path)`` raises, which must come within ``seconds`` (a reader that opened a named pipe
    would block forever: its thread is then left behind and the test fails)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            read(path)
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert errors, f"{read.__name__}({path}) neither raised nor returned within {seconds} s"
    return errors[0]


def test_pipes_devices_and_sockets_are_refused_unopened(tmp_path: Path) -> None:
    """A named pipe blocked the reader forever (ignoring Ctrl-C); devices and sockets are not files either."""
    fifo = tmp_path / "pipe.nii.gz"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.mha"))
    cases = {fifo: "a named pipe", Path("/dev/null"): "a character device", tmp_path / "sock.mha": "a socket"}
    for path, kind in cases.items():
        for reader in (read_image, read_image_nibabel):
            err = _error_within(reader, path)
            assert isinstance(err, ImageReadError) and f"is {kind}" in str(err), err
            assert "\n" not in str(err) and str(path) in str(err)
    sock.close()
    # The voxel file a detached header names must be a regular file too.
    header = tmp_path / "scan.mhd"
    write_image(_random_image(3, torch.int16, oblique=False), header)
    header.write_text(header.read_text().replace("scan.zraw", "pipe.nii.gz"))
    err = _error_within(read_image, header)
    assert isinstance(err, ImageReadError) and "pipe.nii.gz is not a regular file" in str(err), err


def test_declared_size_is_checked_before_voxels_are_read(tmp_path: Path) -> None:
    """A header claiming 10^12 voxels gave "MemoryError" naming no file; a compressed MetaImage declaring far more
    than its bytes can hold made ITK work for minutes."""
    huge = tmp_path / "huge.nii"
    huge.write_bytes(_nifti_bytes(np.zeros((4, 3, 2), np.int16), dim=[3, 10000, 10000, 10000, 1, 1, 1, 1]))
    for reader in (read_image, read_image_nibabel):
        with pytest.raises(
            ImageReadError,
            match=r"declares 10000 x 10000 x 10000 voxels of 2 bytes( from byte 352)? \(2000 GB\), more "
            r"than the [\d.]+ GB of memory available",
        ) as err:
            reader(huge)
        assert_one_line_naming(err, huge)
    mha = tmp_path / "huge.mha"
    write_image(Image(torch.zeros(4, 8, 8), Grid.create((8, 8, 4))), mha)  # zlib-compressed voxels
    mha.write_bytes(mha.read_bytes().replace(b"DimSize = 8 8 4", b"DimSize = 4096 4096 4"))
    with pytest.raises(ImageReadError, match=r"bytes \(0.2684 GB\), more than its \d+ bytes on disk can hold") as err:
        read_image(mha)
    assert_one_line_naming(err, mha)


def test_nifti_is_read_no_further_than_its_header_declares(tmp_path: Path) -> None:
    """A 1 MB .nii.gz that expands to 1 GB took 3.1 GB of memory: now the stream is read as far as the header's
    voxels, and a file holding more is refused (as is one holding less)."""
    raw_data = np.arange(24, dtype=np.int16).reshape(4, 3, 2)
    raw = _nifti_bytes(raw_data)
    bomb = tmp_path / "bomb.nii.gz"
    bomb.write_bytes(gzip.compress(raw + bytes(64 << 20), compresslevel=1))
    assert bomb.stat().st_size < 1 << 20
    for reader in (read_image, read_image_nibabel):
        with pytest.raises(ImageReadError, match=r"more data than its header declares \(400 bytes\)") as err:
            reader(bomb)
        assert_one_line_naming(err, bomb)
    (tmp_path / "exact.nii.gz").write_bytes(gzip.compress(raw))
    np.testing.assert_array_equal(read_image(tmp_path / "exact.nii.gz").data.numpy(), raw_data.T)


def test_one_rule_for_nifti_voxel_offsets_in_both_readers(tmp_path: Path) -> None:
    """vox_offset = 0 in a single file made nibabel read the header's bytes as voxels (ITK read from byte 352)."""
    data = np.arange(24, dtype=np.int16).reshape(4, 3, 2)
    for offset, name in ((0.0, "zero.nii"), (351.0, "inside_header.nii"), (np.nan, "nan.nii")):
        path = tmp_path / name
        path.write_bytes(_nifti_bytes(data, vox_offset=offset))
        for reader in (read_image, read_image_nibabel):
            with pytest.raises(ImageReadError, match=rf"vox_offset {offset:g} is invalid; .* at byte 352") as err:
                reader(path)
            assert_one_line_naming(err, path)
    # A larger offset (the space of header extensions) is read from that offset by both.
    padded = nib.Nifti1Image(data, np.eye(4))
    padded.header.set_data_offset(416)
    nib.save(padded, tmp_path / "padded.nii")
    assert (tmp_path / "padded.nii").stat().st_size == 416 + data.nbytes
    for reader in (read_image, read_image_nibabel):
        np.testing.assert_array_equal(reader(tmp_path / "padded.nii").data.numpy(), data.T)
