"""``regkit.batch.spec``: spec validation with FILE:LINE, job sources (explicit, CSV, globs), inputs checked before
any work."""

from __future__ import annotations

import pytest

from regkit.batch import load_spec
from regkit.errors import ConfigError
from regkit.io import write_image
from tests.regkit.batch.batch_cases import LIST_SPEC, blob, make_data, write_spec


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "defaults: tiny.yaml\noutput: out\njobz: []\n",
            "batch.yaml:3: jobz: unknown key 'jobz'; did you mean 'jobs'?",
        ),
        ("defaults: tiny.yaml\noutput: out\n", "batch.yaml:1: top level: no jobs"),
        (
            "defaults: tiny.yaml\noutput: out\njobs:\n  - fixed: data/a.nii.gz\n    movin: data/b.nii.gz\n",
            "batch.yaml:5: jobs[0].movin: unknown key",
        ),
        (
            "defaults: tiny.yaml\noutput: out\njobs:\n  - {fixed: data/a.nii.gz, moving: data/nope.nii.gz}\n",
            "batch.yaml:4: jobs[0].moving: no such file",
        ),
        (
            "defaults: tiny.yaml\noutput: out\nglob: {pairing: atlas, atlas: data/a.nii.gz, images: 'x/*.nii.gz'}\n",
            "batch.yaml:3: glob.images: 'x/*.nii.gz' matches no file",
        ),
        (
            "defaults: tiny.yaml\noutput: out\nglob:\n  pairing: atlas\n  images: 'data/*.nii.gz'\n",
            "glob.atlas: pairing 'atlas' needs 'atlas'",
        ),
        ("defaults: tiny.yaml\noutput: out\nlayout: '{out}/{stem}'\njobs: []\n", "batch.yaml:3: layout: unknown field"),
        (
            "defaults: tiny.yaml\noutput: out\nlayout: '{out}/{fixed_stem}'\n" + LIST_SPEC.split("output: out\n")[1],
            "batch.yaml:6: jobs[1].moving: job 1 (a.nii.gz, c.nii.gz) has the same output folder",
        ),
        (
            "defaults:\n  base: tiny.yaml\n  seed: -1\noutput: out\n" + LIST_SPEC.split("output: out\n")[1],
            "batch.yaml:3: seed: must be >= 0",
        ),
        (
            LIST_SPEC.replace("c.nii.gz}", "c.nii.gz, config: {stages: [{type: rigd}]}}"),
            "batch.yaml:5: stages[0].type: unknown type 'rigd'",
        ),
        ("defaults: nopreset\noutput: out\n" + LIST_SPEC.split("output: out\n")[1], "batch.yaml:1: defaults: 'nopre"),
    ],
)
def test_invalid_spec_names_key_and_line(tmp_path, body, expected):
    make_data(tmp_path)
    spec = write_spec(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_spec(spec)
    assert expected in str(err.value).replace(str(tmp_path) + "/", "")
    assert not (tmp_path / "out").exists()


def test_unreadable_header_fails_before_any_work(tmp_path):
    make_data(tmp_path)
    (tmp_path / "data" / "b.nii.gz").write_bytes(b"not an image")
    with pytest.raises(ConfigError, match=r"batch.yaml:4: jobs\[0\].moving: cannot read the image header"):
        load_spec(write_spec(tmp_path, LIST_SPEC))


def test_job_sources(tmp_path):
    paths = make_data(tmp_path, ("a", "b", "c"))
    (tmp_path / "sub").mkdir()
    write_image(blob(0.0), tmp_path / "sub" / "s1_t1.nii.gz")
    write_image(blob(1.0), tmp_path / "sub" / "s1_t2.nii.gz")
    write_image(blob(1.0), tmp_path / "sub" / "s9_t2.nii.gz")  # no partner: left out
    (tmp_path / "pairs.csv").write_text("fixed,moving,moving_labels\ndata/a.nii.gz,data/b.nii.gz,\n")
    spec = write_spec(
        tmp_path,
        """\
        defaults: tiny.yaml
        output: out
        layout: "{out}/{index}_{moving_stem}_to_{fixed_stem}"
        jobs:
          - {fixed: data/b.nii.gz, moving: data/c.nii.gz, config: {seed: 4}}
        csv: pairs.csv
        glob: {pairing: pattern, fixed: "sub/*_t1.nii.gz", moving: "sub/*_t2.nii.gz"}
        """,
    )
    plan = load_spec(spec)
    pairs = [(j.inputs["fixed"].name, j.inputs["moving"].name) for j in plan.jobs]
    assert pairs == [("b.nii.gz", "c.nii.gz"), ("a.nii.gz", "b.nii.gz"), ("s1_t1.nii.gz", "s1_t2.nii.gz")]
    assert [j.name for j in plan.jobs] == ["0_c_to_b", "1_b_to_a", "2_s1_t2_to_s1_t1"]
    assert plan.jobs[0].config.seed == 4 and plan.jobs[1].config.seed == 0
    assert plan.jobs[0].config.stages == plan.jobs[1].config.stages
    assert plan.jobs[1].inputs["fixed"] == paths["a"] and plan.jobs[1].inputs["moving_labels"] is None

    atlas = write_spec(
        tmp_path, "defaults: tiny.yaml\noutput: out\nglob: {pairing: atlas, atlas: data/a.nii.gz, images: 'sub/*'}\n"
    )
    assert [j.name for j in load_spec(atlas).jobs] == ["s1_t1_to_a", "s1_t2_to_a", "s9_t2_to_a"]
    within = write_spec(
        tmp_path, "defaults: tiny.yaml\noutput: out\nglob: {pairing: within_folder, images: 'data/*'}\n"
    )
    assert [j.name for j in load_spec(within).jobs] == ["b_to_a", "c_to_a", "c_to_b"]


def test_unknown_extension_and_bad_csv_are_located(tmp_path):
    make_data(tmp_path)
    (tmp_path / "data" / "x.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"batch.yaml:4: jobs\[0\].moving: .*unknown image extension .txt"):
        load_spec(write_spec(tmp_path, LIST_SPEC.replace("b.nii.gz", "x.txt")))
    (tmp_path / "pairs.csv").write_text("fixed,moving,labels\ndata/a.nii.gz,data/b.nii.gz,\n")
    with pytest.raises(ConfigError, match=r"pairs.csv:1: unknown column 'labels'"):
        load_spec(write_spec(tmp_path, "defaults: tiny.yaml\noutput: out\ncsv: pairs.csv\n"))
    (tmp_path / "pairs.csv").write_text("fixed,moving\ndata/a.nii.gz,data/b.nii.gz\ndata/a.nii.gz,data/nope.nii.gz\n")
    with pytest.raises(ConfigError, match=r"pairs.csv:3: moving: no such file"):
        load_spec(write_spec(tmp_path, "defaults: tiny.yaml\noutput: out\ncsv: pairs.csv\n"))


def test_spec_without_defaults_takes_the_default_configuration_of_each_dimension(tmp_path):
    """No ``defaults``: every job gets ``regkit.config.default_config`` of its fixed image's dimension, and a job's
    config mapping merges over it."""
    from regkit.config import default_config

    make_data(tmp_path)  # 2D images
    body = LIST_SPEC.replace("defaults: tiny.yaml\n", "").replace("c.nii.gz}", "c.nii.gz, config: {seed: 3}}")
    plan = load_spec(write_spec(tmp_path, body))
    assert plan.jobs[0].config == default_config(2)
    assert plan.jobs[1].config == default_config(2).model_copy(update={"seed": 3})
