"""The YAML files of the repository's ``configs/``: the presets (installed as ``regkit.presets``) resolve and are all
listed and valid, the packaging ships them, and the example batch spec parses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from regkit.batch import load_spec
from regkit.config import DEFAULT_PRESETS, default_config, list_presets, load_config
from regkit.config.layers import open_config, presets_folder
from regkit.config.schema import CpabStage
from regkit.errors import ConfigError
from regkit.io import Image, write_image
from regkit.similarity.options import MiSimilarity
from regkit.spatial.grid import Grid

ROOT = Path(__file__).resolve().parents[3]
PRESETS = ROOT / "configs" / "presets"
PRESET_FILES = sorted(PRESETS.glob("*.yaml"))


def test_presets_folder_resolves_and_lists_every_file():
    assert presets_folder().is_dir()
    assert list_presets() == sorted(path.stem for path in PRESET_FILES)
    assert {"brain-mri-3d", "histology-2d", "demo"} <= set(list_presets())


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda path: path.stem)
def test_every_file_is_a_preset(path):
    """Each file loads by its name (under the label of its place in the repository) as by its path."""
    source = open_config(path.stem, Path(), "")
    assert source.label == f"configs/presets/{path.name}"
    assert source.path.read_text() == path.read_text()
    assert load_config(path.stem) == load_config(path)
    assert path.read_text().startswith("# ")


def test_the_benchmark_and_training_files_are_not_presets():
    assert not [name for name in list_presets() if name.startswith(("accuracy-", "features-"))]


def test_packaging_lists_every_package_folder():
    """pyproject.toml lists the packages (``regkit.presets`` lives outside ``regkit/``): every folder of the packages
    must be there, and the YAML files must be package data."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    assert folders["regkit.presets"] == "configs/presets"
    roots = {"regkit": "regkit"} | {name: folder for name, folder in folders.items() if "." not in name}
    found = {"regkit.presets"}
    for name, folder in roots.items():
        top = ROOT / folder
        found |= {
            ".".join((name, *sub.relative_to(top).parts))
            for sub in (top, *top.rglob("*"))
            if sub.is_dir() and sub.name != "__pycache__"
        }
    assert sorted(setuptools["packages"]) == sorted(found)
    data = setuptools["package-data"]
    assert "*.yaml" in data["regkit.presets"] and "*.yaml" in data["regkit.features.training"]


def test_example_batch_spec_parses(tmp_path):
    """configs/batch/example.yaml, copied next to tiny images at its paths: 2 explicit jobs and 2 from the glob."""
    spec = tmp_path / "example.yaml"
    shutil.copy(ROOT / "configs" / "batch" / "example.yaml", spec)
    image = Image(torch.zeros(4, 4, 4), Grid.create((4, 4, 4), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0)))
    names = ["templates/tpl-MNI152NLin2009cAsym_T1w.nii.gz", "data/sub-01/anat/sub-01_FLAIR.nii.gz"]
    names += [f"data/sub-02/anat/sub-02_{kind}.nii.gz" for kind in ("T2w", "T1w_dseg", "T2w_dseg")]
    names += [f"data/sub-0{i}/anat/sub-0{i}_T1w.nii.gz" for i in (1, 2)]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        write_image(image, tmp_path / name)
    plan = load_spec(spec)
    assert [job.name for job in plan.jobs] == [
        "sub-01_FLAIR_to_sub-01_T1w",
        "sub-02_T2w_to_sub-02_T1w",
        "sub-01_T1w_to_tpl-MNI152NLin2009cAsym_T1w",
        "sub-02_T1w_to_tpl-MNI152NLin2009cAsym_T1w",
    ]
    assert plan.root == tmp_path / "results"
    multimodal = load_config("brain-mri-3d-multimodal")
    assert plan.jobs[0].config == multimodal
    assert plan.jobs[1].config == multimodal.model_copy(update={"seed": 1})
    assert plan.jobs[1].inputs["moving_labels"] == tmp_path / "data/sub-02/anat/sub-02_T2w_dseg.nii.gz"
    assert plan.jobs[2].config == plan.jobs[3].config == load_config("brain-mri-3d")
    cpab = plan.jobs[0].config.stages[-1]
    assert isinstance(cpab, CpabStage) and isinstance(cpab.similarity, MiSimilarity)


@pytest.mark.parametrize("ndim", [2, 3])
def test_the_default_configurations_choose_the_similarity_by_the_pair(ndim):
    """The default of each dimension is a preset whose deformable stage measures the pair's modality (a multi-modal
    similarity beside its mono-modal one), after a linear stage with mutual information (robust to both)."""
    config = default_config(ndim)
    assert config == load_config(DEFAULT_PRESETS[ndim]) and config.dim == ndim
    cpab = config.stages[-1]
    assert isinstance(cpab, CpabStage) and cpab.multimodal is not None
    assert cpab.multimodal.name != cpab.similarity.name


def test_default_config_refuses_other_dimensions():
    with pytest.raises(ConfigError, match="not 4D"):
        default_config(4)
