"""Shared inputs of the batch tests (here and in tests/regkit_cli): 2D images of blobs, a tiny CPU configuration, batch
specs, and the isolation of the settings that RegkitWorkerPlugin makes in a process."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from regkit.batch import NODE_CACHE, WORKER_THREADS
from regkit.io import Image, write_image
from regkit.process import cache_root
from regkit.spatial.grid import Grid
from tests.helpers import gaussian_blobs

TINY_CONFIG = """\
dim: 2
device: cpu
outputs: {inverse_displacement: false, transform_h5: false, qc_png: false}
stages:
  - {type: moments}
  - type: cpab
    similarity: {name: ncc}
    pyramid: [{shrink: 1, smoothing: 0.0}]
    optimizer: {iterations: 3, learning_rate: 0.2}
    tessellation: [2]
    steps: 5
"""


def blob(shift: float, size: int = 24) -> Image:
    """A 2D image of two Gaussian blobs, the first one shifted by ``shift`` mm in x."""
    grid = Grid.create((size, size), (1.0, 1.0), (0.0, 0.0))
    return gaussian_blobs(grid, [(10.0 + shift, 12.0), (16.0, 8.0)], (20.0, 10.0), (1.0, 0.6))


def make_data(folder: Path, names: tuple[str, ...] = ("a", "b", "c")) -> dict[str, Path]:
    """Images ``data/NAME.nii.gz`` and the tiny config ``tiny.yaml`` in ``folder``."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, name in enumerate(names):
        paths[name] = folder / "data" / f"{name}.nii.gz"
        write_image(blob(float(i)), paths[name])
    (folder / "tiny.yaml").write_text(TINY_CONFIG)
    return paths


def corrupt(path: Path) -> None:
    """Cut a .nii.gz file after its header: the header reads, the voxels do not."""
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def write_spec(folder: Path, body: str) -> Path:
    spec = folder / "batch.yaml"
    spec.write_text(textwrap.dedent(body))
    return spec


LIST_SPEC = """\
defaults: tiny.yaml
output: out
jobs:
  - {fixed: data/a.nii.gz, moving: data/b.nii.gz}
  - {fixed: data/a.nii.gz, moving: data/c.nii.gz}
"""


_SETTINGS = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NUMBA_CACHE_DIR", "TRITON_CACHE_DIR", WORKER_THREADS)


def isolate_worker_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let RegkitWorkerPlugin make its settings in this process (in-process dask workers) or in worker processes
    started from it, and undo them after the test: the variables it sets are restored, one torch thread, and the
    compile caches stay in regkit's own cache folder (warm: a cold numba cache costs each new worker its kernels'
    compilation)."""
    for name in _SETTINGS:
        monkeypatch.setenv(name, os.environ.get(name, ""))  # recorded: restored (or removed) after the test
        if not os.environ[name]:
            monkeypatch.delenv(name)
    monkeypatch.setenv(WORKER_THREADS, "1")
    monkeypatch.setenv(NODE_CACHE, str(cache_root()))
    numba = sys.modules.get("numba")
    if numba is not None:
        monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
