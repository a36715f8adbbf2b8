"""``regkit.batch.spec``: spec validation with FILE:LINE, job sources (explicit, CSV, globs), inputs checked before
any work."""

from __future__ import annotations

import pytest

from regkit.batch import load_spec
from regkit.batch.spec import MAX_NAME_BYTES, MAX_PATH_BYTES
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
            "batch.yaml:4: jobs[0].moving: data/nope.nii.gz: no such file",
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
            "defaults: tiny.yaml\noutput: out\nlayout: '{out}/{index:>500000000}'\njobs: []\n",
            "batch.yaml:3: layout: fields take no format spec or conversion",
        ),
        (
            "defaults: tiny.yaml\noutput: out\nlayout: '{out}/{moving_stem!r}'\njobs: []\n",
            "batch.yaml:3: layout: fields take no format spec or conversion",
        ),
        ("defaults: tiny.yaml\noutput: out\nlayout: '{out}/{'\njobs: []\n", "batch.yaml:3: layout: not a valid layout"),
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
    with pytest.raises(ConfigError, match=r"pairs.csv:3: moving: .*nope.nii.gz: no such file"):
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


def test_csv_not_utf8_or_with_a_nul_is_located(tmp_path):
    make_data(tmp_path)
    spec = write_spec(tmp_path, "defaults: tiny.yaml\noutput: out\ncsv: pairs.csv\n")
    csv_path = tmp_path / "pairs.csv"
    csv_path.write_bytes(
        "fixed,moving\ndata/a.nii.gz,data/b.nii.gz\ndata/caf\u00e9.nii.gz,data/b.nii.gz\n".encode("latin-1")
    )
    with pytest.raises(ConfigError) as err:
        load_spec(spec)
    assert str(err.value) == f"{csv_path}:3: not a UTF-8 text file"
    csv_path.write_bytes(b"fixed,moving\ndata/a.nii.gz,data/b\x00.nii.gz\n")
    with pytest.raises(ConfigError) as err:
        load_spec(spec)
    assert str(err.value) == f"{csv_path}:2: a NUL character (\\0)"


def test_job_folders_must_really_be_inside_the_output_root(tmp_path):
    """The containment check follows symbolic links: a link inside the root that leads out of it is refused, and two
    layouts that lead to one real folder are one folder."""
    make_data(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "link").symlink_to(tmp_path / "elsewhere")
    spec = write_spec(tmp_path, LIST_SPEC + "layout: '{out}/link/{moving_stem}'\n")
    with pytest.raises(ConfigError) as err:
        load_spec(spec)
    message = str(err.value)
    assert message.startswith(f"{spec}:6: layout: {tmp_path / 'out' / 'link' / 'b'} leads to ")
    assert f"{tmp_path / 'elsewhere' / 'b'} through a symbolic link" in message
    (tmp_path / "out" / "b").symlink_to(tmp_path / "out" / "c")  # inside the root: allowed, but b and c are one folder
    with pytest.raises(ConfigError, match=r"batch.yaml:5: jobs\[1\].moving: job 1 \(a.nii.gz, c.nii.gz\) has the same"):
        load_spec(write_spec(tmp_path, LIST_SPEC + "layout: '{out}/{moving_stem}'\n"))


def test_output_folders_too_long_for_a_file_system_are_refused(tmp_path):
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC + f"layout: '{{out}}/{'x' * 255}_{{moving_stem}}'\n")
    with pytest.raises(ConfigError) as err:
        load_spec(spec)
    assert str(err.value) == (
        f"{spec}:6: layout: the output folder of job 0 (a.nii.gz, b.nii.gz) is too long: the name "
        f"'{'x' * 40}'... has 257 bytes (at most {MAX_NAME_BYTES})"
    )
    deep = write_spec(tmp_path, LIST_SPEC + f"layout: '{{out}}/{'a/' * 2100}{{moving_stem}}'\n")
    with pytest.raises(ConfigError, match=rf"its path has \d+ bytes \(at most {MAX_PATH_BYTES}\)"):
        load_spec(deep)
