"""Bad and hostile input to every command, run as a user runs them (in-process through ``main``): broken, odd and
hostile image files in every image argument, configurations, transform files, output paths, batch specs, options.

Every case must end within :data:`LIMIT_S` seconds, without a traceback or a crash, with either a clean refusal (exit
code 1 and one ``error:`` line naming the culprit; 2 for typer's usage errors) or, where the input is odd but usable
(``either``), a success; and nothing in the input folders may change (no input lost or overwritten), nor any output be
left by a refused case. ``test_the_suite_covers_every_command`` states the counts.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import signal
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk

from tests.helpers import run_cli

LIMIT_S = 10
"""The longest a case may take before it counts as a hang."""


@dataclass(frozen=True)
class Case:
    """One command line (``{name}`` fields: the files of :func:`bad`, ``{out}`` a fresh output path); ``expect``:
    ``refuse`` (must fail cleanly) or ``either``; ``names``: what the error line must contain (a template too)."""

    id: str
    argv: tuple[str, ...]
    names: str
    expect: str = "refuse"


# ---- the inputs ----------------------------------------------------------------------------------------------------

IMAGES = {  # name -> (file name in the bad folder, refused by commands that only read a grid or describe the image)
    "missing": ("missing.nii.gz", True),
    "empty": ("empty.nii.gz", True),
    "garbage": ("garbage.nii.gz", True),
    "truncated": ("truncated.nii.gz", True),
    "text": ("text.nii", True),
    "unknown_ext": ("image.xyz", True),
    "folder": ("folder.nii.gz", True),
    "empty_dicom_folder": ("dicom_folder", True),
    "fifo": ("fifo.nii.gz", True),
    "device": ("device.nii.gz", True),
    "loop": ("loop.nii.gz", True),
    "not_utf8": (os.fsdecode(b"\xff\xfe.nii.gz"), True),
    "four_d": ("four_d.nii.gz", True),
    "huge_header": ("huge.nii", True),
    "gzip_bomb": ("bomb.nii.gz", True),
    "nan_spacing": ("nan_spacing.nii", True),
    "zero_spacing": ("zero_spacing.nii", True),
    "mhd_passwd": ("passwd.mhd", True),
    "mhd_missing_raw": ("no_raw.mhd", True),
    "mha_negative_size": ("negative.mha", True),
    "nrrd_zero_size": ("zero.nrrd", True),
    "png_garbage": ("garbage.png", True),
    "nan_voxels": ("nan.nii.gz", False),
    "inf_voxels": ("inf.nii.gz", False),
    "thin": ("thin.nii.gz", False),
}


def _nifti_header(size: tuple[int, ...], spacing: tuple[float, ...], data_bytes: int = 0) -> bytes:
    """A NIfTI-1 single file (.nii) of float32 voxels with this size and spacing, and ``data_bytes`` zero bytes."""
    header = np.zeros(
        1,
        dtype=[
            ("sizeof_hdr", "<i4"),
            ("pad", "V36"),
            ("dim", "<i2", 8),
            ("pad2", "V14"),
            ("datatype", "<i2"),
            ("bitpix", "<i2"),
            ("pad3", "V2"),
            ("pixdim", "<f4", 8),
            ("vox_offset", "<f4"),
            ("pad4", "V236"),
            ("magic", "S4"),
        ],
    )
    header["sizeof_hdr"] = 348
    header["dim"][0, : len(size) + 1] = (len(size), *size)
    header["datatype"], header["bitpix"] = 16, 32
    header["pixdim"][0, : len(spacing) + 1] = (1.0, *spacing)
    header["vox_offset"] = 352
    header["magic"] = b"n+1\x00"
    return header.tobytes() + b"\x00" * (4 + data_bytes)


def _write_images(folder: Path, valid: Path) -> None:
    """The files of :data:`IMAGES` in ``folder`` (``valid``: a good 2D .nii.gz to damage)."""
    good = valid.read_bytes()
    rng = np.random.default_rng(0)
    (folder / "empty.nii.gz").write_bytes(b"")
    (folder / "garbage.nii.gz").write_bytes(rng.bytes(2000))
    (folder / "truncated.nii.gz").write_bytes(good[: len(good) // 2])
    (folder / "text.nii").write_text("not an image\n")
    (folder / "image.xyz").write_bytes(good)
    (folder / "folder.nii.gz").mkdir()
    (folder / "dicom_folder").mkdir()
    os.mkfifo(folder / "fifo.nii.gz")
    (folder / "device.nii.gz").symlink_to("/dev/zero")
    (folder / "loop.nii.gz").symlink_to(folder / "loop.nii.gz")
    (folder / os.fsdecode(b"\xff\xfe.nii.gz")).write_bytes(good)
    sitk.WriteImage(
        sitk.GetImageFromArray(np.zeros((2, 3, 4, 5), np.float32), isVector=False), folder / "four_d.nii.gz"
    )
    (folder / "huge.nii").write_bytes(_nifti_header((30000, 30000, 30000), (1.0, 1.0, 1.0)))
    with gzip.open(folder / "bomb.nii.gz", "wb") as bomb:  # 4 GB of voxels declared, compressed to a few MB
        bomb.write(_nifti_header((2048, 2048, 256), (1.0, 1.0, 1.0)))
        block = b"\x00" * 2**24
        for _ in range(16):
            bomb.write(block)
    (folder / "nan_spacing.nii").write_bytes(_nifti_header((8, 8), (float("nan"), 1.0), 8 * 8 * 4))
    (folder / "zero_spacing.nii").write_bytes(_nifti_header((8, 8), (0.0, 1.0), 8 * 8 * 4))
    (folder / "passwd.mhd").write_text(
        "ObjectType = Image\nNDims = 2\nDimSize = 4 4\nElementType = MET_UCHAR\nElementDataFile = /etc/passwd\n"
    )
    (folder / "no_raw.mhd").write_text(
        "ObjectType = Image\nNDims = 2\nDimSize = 4 4\nElementType = MET_UCHAR\nElementDataFile = no_raw.raw\n"
    )
    (folder / "negative.mha").write_bytes(
        b"ObjectType = Image\nNDims = 2\nDimSize = -5 4\nElementType = MET_UCHAR\nElementDataFile = LOCAL\n"
        + b"\0" * 20
    )
    (folder / "zero.nrrd").write_bytes(
        b"NRRD0004\ntype: float\ndimension: 2\nsizes: 0 0\nencoding: raw\nendian: little\n\n"
    )
    (folder / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n" + rng.bytes(300))
    for name, value in (("nan", float("nan")), ("inf", float("inf"))):
        data = sitk.GetArrayFromImage(sitk.ReadImage(str(valid))).astype(np.float32)
        data[2, 3] = value
        sitk.WriteImage(sitk.GetImageFromArray(data), folder / f"{name}.nii.gz")
    sitk.WriteImage(sitk.GetImageFromArray(rng.random((50, 1)).astype(np.float32)), folder / "thin.nii.gz")


CONFIGS = {  # name -> YAML text (bytes for undecodable ones)
    "syntax": "stages: [\n",
    "unknown_key": "base: quick-2d\nstpes: 3\n",
    "wrong_type": "base: quick-2d\nseed: abc\n",
    "huge_seed": "base: quick-2d\nseed: 1.0e32\n",
    "negative_seed": "base: quick-2d\nseed: -1\n",
    "huge_learning_rate": "base: quick-2d\nstages:\n  - type: affine\n    optimizer: {learning_rate: 1.0e30}\n",
    "huge_iterations": "base: quick-2d\nstages:\n  - type: affine\n    optimizer: {iterations: [1000000000000]}\n",
    "huge_smoothing": "base: quick-2d\nstages:\n  - type: affine\n    pyramid: [{shrink: 1, smoothing: 1.0e7}]\n",
    "huge_chain": "base: quick-2d\nstages:\n  - {type: cpab, chain: 100000}\n",
    "alias_bomb": "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)),
    "recursive_alias": "stages: &s [*s]\n",
    "deep": "stages: " + "[" * 5000 + "]" * 5000 + "\n",
    "not_utf8": b"seed: \xff\xfe\n",
    "empty": "",
    "binary": bytes(range(256)) * 4,
    "python_tag": "!!python/object/apply:os.system ['touch {dir}/pwned']\n",
    "top_level_list": "- 1\n- 2\n",
    "oversized": "# " + "x" * (16 * 2**20) + "\nbase: quick-2d\n",
    "unknown_base": "base: no-such-preset\n",
}

TRANSFORMS = {  # name -> how the saved transform.json is damaged (data -> data, or text)
    "theta_nan": lambda d: _flow(d, theta=[float("nan")] * len(d["cpab"][0]["theta"])),
    "theta_huge": lambda d: _flow(d, theta=[1e30] * len(d["cpab"][0]["theta"])),
    "theta_short": lambda d: _flow(d, theta=[0.0]),
    "theta_text": lambda d: _flow(d, theta="zero"),
    "steps_huge": lambda d: _flow(d, steps=10**9),
    "steps_zero": lambda d: _flow(d, steps=0),
    "steps_text": lambda d: _flow(d, steps="ten"),
    "dtype_int8": lambda d: _flow(d, dtype="int8"),
    "cells_zero": lambda d: _flow(d, cells=[0, 3]),
    "cells_huge": lambda d: _flow(d, cells=[100000, 100000]),
    "box_inverted": lambda d: _flow(d, lower=d["cpab"][0]["upper"], upper=d["cpab"][0]["lower"]),
    "boundary_unknown": lambda d: _flow(d, boundary="wrap"),
    "matrix_singular": lambda d: {**d, "matrix": [[0.0] * 3] * 3},
    "matrix_nan": lambda d: {**d, "matrix": [[float("nan")] * 3] * 3},
    "matrix_shape": lambda d: {**d, "matrix": np.eye(4).tolist()},
    "matrix_missing": lambda d: {k: v for k, v in d.items() if k != "matrix"},
    "cpab_missing": lambda d: {k: v for k, v in d.items() if k != "cpab"},
    "grid_negative": lambda d: {**d, "fixed_grid": {**d["fixed_grid"], "size": [-3, 4]}},
    "grid_zero_spacing": lambda d: {**d, "fixed_grid": {**d["fixed_grid"], "spacing": [0.0, 1.0]}},
    "format_other": lambda d: {**d, "format": "other"},
    "version_future": lambda d: {**d, "version": 99},
    "top_level_list": lambda d: [d],
    "truncated": lambda d: json.dumps(d)[:200],
    "not_json": lambda d: "transform: yes\n",
    "empty": lambda d: "",
    "deep": lambda d: "[" * 100000 + "]" * 100000,
    "not_utf8": lambda d: b'{"format": "\xff"}',
}


def _flow(data: dict, **changes: object) -> dict:
    return {**data, "cpab": [{**data["cpab"][0], **changes}, *data["cpab"][1:]]}


# ---- the cases -----------------------------------------------------------------------------------------------------

REGISTER = ("register", "{fixed}", "{moving}", "-o", "{out}", "-c", "{config}", "--quiet")
IMAGE_ARGUMENTS = {  # where an image goes: the command line with IMAGE in its place
    "info": ("info", "IMAGE"),
    "register-fixed": ("register", "IMAGE", "{moving}", "-o", "{out}", "-c", "{config}", "-q"),
    "register-moving": ("register", "{fixed}", "IMAGE", "-o", "{out}", "-c", "{config}", "-q"),
    "register-moving-labels": (*REGISTER, "--moving-labels", "IMAGE"),
    "register-fixed-labels": (*REGISTER, "--moving-labels", "{ml}", "--fixed-labels", "IMAGE"),
    "register-fixed-mask": (*REGISTER, "--fixed-mask", "IMAGE"),
    "register-moving-mask": (*REGISTER, "--moving-mask", "IMAGE"),
    "apply-image": ("apply", "{result}/transform.json", "IMAGE", "-r", "{fixed}", "-o", "{out}.nii.gz"),
    "apply-reference": ("apply", "{result}/transform.json", "{moving}", "-r", "IMAGE", "-o", "{out}.nii.gz"),
    "apply-h5-image": ("apply", "{result}/transform.h5", "IMAGE", "-r", "{fixed}", "-o", "{out}.nii.gz"),
    "invert-reference": ("invert", "{result}", "-r", "IMAGE", "-o", "{out}.nii.gz"),
    "export-reference": ("export", "{result}", "-r", "IMAGE", "-o", "{out}.nii.gz"),
}
TRANSFORM_COMMANDS = {
    "apply": ("apply", "TRANSFORM", "{moving}", "-r", "{fixed}", "-o", "{out}.nii.gz"),
    "invert": ("invert", "TRANSFORM", "-r", "{moving}", "-o", "{out}.nii.gz"),
    "jacobian": ("jacobian", "TRANSFORM", "-o", "{out}.nii.gz"),
    "export": ("export", "TRANSFORM", "-r", "{moving}", "-o", "{out}.nii.gz"),
}
OUTPUTS = {  # name -> (output path, the part of it the error names)
    "existing_file": ("{existing}", "{existing}"),
    "an_input": ("{moving}", "{moving}"),
    "parent_is_a_file": ("{existing}/out.nii.gz", "{existing}"),
    "missing_parent": ("{dir}/no/such/folder/out.nii.gz", "{dir}/no/such/folder"),
    "unwritable": ("/proc/regkit-out.nii.gz", "/proc"),
}
OUTPUT_COMMANDS = {
    "apply": ("apply", "{result}/transform.json", "{moving}", "-r", "{fixed}", "-o", "OUTPUT"),
    "invert": ("invert", "{result}", "-o", "OUTPUT"),
    "jacobian": ("jacobian", "{result}", "-o", "OUTPUT"),
    "export": ("export", "{result}", "-o", "OUTPUT"),
}
SPECS = {  # name -> (batch spec YAML, what the error names)
    "csv_not_utf8": ("output: {out}\ncsv: {dir}/not_utf8.csv\n", "not_utf8.csv"),
    "csv_columns": ("output: {out}\ncsv: {dir}/columns.csv\n", "columns.csv"),
    "missing_image": ("output: {out}\njobs: [{{fixed: {fixed}, moving: {dir}/missing.nii.gz}}]\n", "missing.nii.gz"),
    "layout_padding": (
        "output: {out}\nlayout: '{{out}}/{{index:>500000000}}'\njobs: [{{fixed: {fixed}, moving: {moving}}}]\n",
        "layout",
    ),
    "layout_outside": (
        "output: {out}\nlayout: '{{out}}/../../outside/{{index}}'\njobs: [{{fixed: {fixed}, moving: {moving}}}]\n",
        "layout",
    ),
    "layout_field": (
        "output: {out}\nlayout: '{{out}}/{{nope}}'\njobs: [{{fixed: {fixed}, moving: {moving}}}]\n",
        "layout",
    ),
    "fifo_input": ("output: {out}\njobs: [{{fixed: {fixed}, moving: {dir}/fifo.nii.gz}}]\n", "fifo.nii.gz"),
    "mhd_passwd_input": ("output: {out}\njobs: [{{fixed: {fixed}, moving: {dir}/passwd.mhd}}]\n", "passwd.mhd"),
    "jobs_type": ("output: {out}\njobs: 5\n", "jobs"),
    "unknown_key": ("output: {out}\nunknwn: 1\njobs: [{{fixed: {fixed}, moving: {moving}}}]\n", "unknwn"),
    "alias_bomb": ("output: {out}\n" + CONFIGS["alias_bomb"].replace("{", "{{").replace("}", "}}"), "spec"),
    "output_is_a_file": ("output: {existing}\njobs: [{{fixed: {fixed}, moving: {moving}}}]\n", "{existing}"),
    "two_jobs_one_folder": (
        "output: {out}\njobs: [{{fixed: {fixed}, moving: {moving}}}, {{fixed: {fixed}, moving: {moving}}}]\n",
        "moving_to_fixed",
    ),
    "glob_matches_nothing": (
        "output: {out}\nglob: {{pairing: atlas, images: '{dir}/none-*.nii.gz', atlas: {fixed}}}\n",
        "none-*.nii.gz",
    ),
    "unknown_defaults": (
        "output: {out}\ndefaults: no-such-preset\njobs: [{{fixed: {fixed}, moving: {moving}}}]\n",
        "no-such-preset",
    ),
    "empty": ("", "spec"),
    "job_config_bound": (
        "output: {out}\njobs: [{{fixed: {fixed}, moving: {moving}, config: {{base: quick-2d, seed: -4}}}}]\n",
        "seed",
    ),
}


def _cases() -> list[Case]:
    cases = []
    for image, (file_name, grid_refused) in IMAGES.items():
        for where, argv in IMAGE_ARGUMENTS.items():
            # NaN voxels or a thin image: refused as a pair to register, elsewhere described, resampled or used
            expect = "refuse" if grid_refused or where in ("register-fixed", "register-moving") else "either"
            path = "{dir}/" + file_name
            cases.append(
                Case(
                    f"image-{image}-{where}",
                    tuple(path if a == "IMAGE" else a for a in argv),
                    ascii(os.path.basename(file_name))[1:-1],
                    expect,
                )
            )
    cases.append(Case("image-float-labels", (*REGISTER, "--moving-labels", "{float_labels}"), "labels"))
    for name in CONFIGS:
        path = "{dir}/config_" + name + ".yaml"
        cases.append(Case(f"config-{name}-check-config", ("check-config", path), f"config_{name}.yaml"))
        argv = ("register", "{fixed}", "{moving}", "-o", "{out}", "-c", path, "-q")
        cases.append(Case(f"config-{name}-register", argv, f"config_{name}.yaml"))
    for preset in ("no-such-preset", "brain-mri-3d"):
        cases.append(
            Case(
                f"config-preset-{preset}",
                ("register", "{fixed}", "{moving}", "-o", "{out}", "-c", preset),
                preset if preset.startswith("no") else "3D",
            )
        )
    for name in TRANSFORMS:
        for command, argv in TRANSFORM_COMMANDS.items():
            path = "{dir}/transform_" + name + ".json"
            cases.append(
                Case(
                    f"transform-{name}-{command}",
                    tuple(path if a == "TRANSFORM" else a for a in argv),
                    f"transform_{name}.json",
                )
            )
    for name, (path, names) in OUTPUTS.items():
        for command, argv in OUTPUT_COMMANDS.items():
            cases.append(Case(f"output-{name}-{command}", tuple(path if a == "OUTPUT" else a for a in argv), names))
    for name, (path, names) in [("an_input", ("{moving}", "{moving}")), ("a_file", ("{existing}", "{existing}"))]:
        argv = ("register", "{fixed}", "{moving}", "-o", path, "-c", "{config}", "-q")
        cases.append(Case(f"output-{name}-register", argv, names))
        cases.append(Case(f"output-{name}-register-overwrite", (*argv, "--overwrite"), names))
    for name, (_, names) in SPECS.items():
        cases.append(Case(f"batch-{name}", ("batch", "{dir}/spec_" + name + ".yaml", "-q"), names))
    options = {
        "seed-not-an-integer": (("register", "{fixed}", "{moving}", "-o", "{out}", "--seed", "1e23"), "seed"),
        "seed-beyond-bound": (("register", "{fixed}", "{moving}", "-o", "{out}", "--seed", str(2**70)), "seed"),
        "seed-negative": (("register", "{fixed}", "{moving}", "-o", "{out}", "--seed", "-1"), "seed"),
        "device-unknown": (("register", "{fixed}", "{moving}", "-o", "{out}", "--device", "gpu"), "gpu"),
        "device-absent": (("register", "{fixed}", "{moving}", "-o", "{out}", "--device", "cuda:7"), "cuda"),
        "interp-unknown": (
            (
                "apply",
                "{result}/transform.json",
                "{moving}",
                "-r",
                "{fixed}",
                "-o",
                "{out}.nii.gz",
                "--interp",
                "cubic",
            ),
            "interp",
        ),
        "scheduler-not-an-address": (
            ("batch", "{dir}/spec_valid.yaml", "--executor", "dask", "--scheduler", "not-an-address", "-q"),
            "not-an-address",
        ),
        "workers-zero": (("batch", "{dir}/spec_valid.yaml", "--executor", "dask", "--workers", "0"), "workers"),
        "export-folder-without-ids": (("export", "{result}", "-o", "{out}"), "--fixed-id"),
        "train-garbage-checkpoint": (
            ("train-features", "features-2d", "-o", "{dir}/garbage_run", "--resume", "--device", "cpu"),
            "checkpoint",
        ),
        "train-unknown-recipe": (("train-features", "no-such-recipe", "-o", "{out}"), "no-such-recipe"),
    }
    for name, (argv, names) in options.items():
        cases.append(Case(f"option-{name}", argv, names))
    return cases


CASES = _cases()


# ---- the fixtures --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad(files, result_dir, tmp_path_factory) -> dict[str, str]:
    """The bad inputs as files in one folder, with the good ones of the package's fixtures: name -> path."""
    folder = tmp_path_factory.mktemp("bad")
    _write_images(folder, files["moving"])
    names = {key: str(path) for key, path in files.items()}
    names.update(dir=str(folder), result=str(result_dir), existing=str(folder / "existing.nii.gz"))
    (folder / "existing.nii.gz").write_bytes(files["fixed"].read_bytes())
    for name, text in CONFIGS.items():
        data = text if isinstance(text, bytes) else text.replace("{dir}", str(folder)).encode()
        (folder / f"config_{name}.yaml").write_bytes(data)
    saved = json.loads((result_dir / "transform.json").read_text())
    assert saved["cpab"], "the shared result has a CPAB flow"
    for name, damage in TRANSFORMS.items():
        changed = damage(saved)
        data = changed if isinstance(changed, bytes) else changed if isinstance(changed, str) else json.dumps(changed)
        (folder / f"transform_{name}.json").write_bytes(data if isinstance(data, bytes) else data.encode())
    (folder / "not_utf8.csv").write_bytes(b"fixed,moving\n\xff\xfe.nii.gz,b.nii.gz\n")
    (folder / "columns.csv").write_text("a,b\nx,y\n")
    for name, (text, _) in SPECS.items():
        (folder / f"spec_{name}.yaml").write_text(text.format(**names, out=folder / f"batch_{name}"))
    (folder / "spec_valid.yaml").write_text(
        f"output: {folder / 'batch_valid'}\ndefaults: {files['config']}\n"
        f"jobs: [{{fixed: {files['fixed']}, moving: {files['moving']}}}]\n"
    )
    run = folder / "garbage_run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(np.random.default_rng(1).bytes(4000))
    return names


class Hang(BaseException):
    """A case ran past :data:`LIMIT_S` (a BaseException, so that no command's error handling turns it into a line)."""


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _snapshot(*folders: str) -> dict[str, object]:
    """Every entry under ``folders`` (not followed through links): regular files by content hash, others by type."""
    found: dict[str, object] = {}
    for folder in folders:
        for root, dirs, names in os.walk(folder):
            for name in dirs + names:
                path = os.path.join(root, name)
                mode = os.lstat(path).st_mode
                if stat.S_ISREG(mode):
                    found[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                else:
                    found[path] = stat.S_IFMT(mode)
    return found


# ---- the tests -----------------------------------------------------------------------------------------------------


def test_the_suite_covers_every_command() -> None:
    commands = {case.argv[0] for case in CASES}
    assert commands == {
        "info",
        "check-config",
        "register",
        "apply",
        "invert",
        "jacobian",
        "export",
        "batch",
        "train-features",
    }
    assert len(CASES) >= 300, len(CASES)
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_refused_in_one_line_and_loses_nothing(bad, files, result_dir, tmp_path, capsys, case) -> None:
    names = {**bad, "out": str(tmp_path / "out")}
    argv = [part.format(**names) for part in case.argv]
    inputs = (bad["dir"], str(files["fixed"].parent), str(result_dir))
    before = _snapshot(*inputs)
    with _time_limit(LIMIT_S):
        code = run_cli(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    if code == 0:
        assert case.expect == "either", f"exit 0 for bad input: {argv}"
    elif code != 2:  # typer's usage errors (exit 2) print their own box
        assert code == 1, (code, err)
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert case.names.format(**names) in lines[0], (case.names, lines[0])
    assert _snapshot(*inputs) == before, "an input changed"
    assert not os.path.exists(os.path.join(bad["dir"], "pwned")), "a configuration ran code"
    if code != 0:
        assert os.listdir(tmp_path) == [], "a refused command left output"
