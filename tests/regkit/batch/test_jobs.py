"""``regkit.batch.jobs``: a job that fails alone, labels and masks reaching a job's outputs, the device label."""

from __future__ import annotations

import csv
import json
import re
from xml.etree import ElementTree

import pytest
import torch

from regkit.batch import device_label, load_spec, run_batch
from regkit.io import Image, write_image
from regkit.spatial.grid import Grid
from tests.regkit.batch.batch_cases import LIST_SPEC, blob, make_data, write_spec


def test_dimension_mismatch_fails_alone(tmp_path):
    make_data(tmp_path)
    write_image(Image(torch.rand(6, 7, 8), Grid.create((8, 7, 6))), tmp_path / "data" / "c.nii.gz")
    report = run_batch(load_spec(write_spec(tmp_path, LIST_SPEC)))
    assert [o.state for o in report.outcomes] == ["done", "failed"]
    assert "3D" in report.outcomes[1].error and "2D" in report.outcomes[1].error


def test_labels_and_masks_from_csv_reach_the_outputs(tmp_path):
    make_data(tmp_path, ("a", "b"))
    for name, shift in (("a", 0.0), ("b", 1.0)):
        image = blob(shift)
        write_image(Image((image.data > 0.4).to(torch.int16), image.grid), tmp_path / "data" / f"{name}_seg.nii.gz")
    (tmp_path / "pairs.csv").write_text(
        "fixed,moving,fixed_labels,moving_labels,fixed_mask\n"
        "data/a.nii.gz,data/b.nii.gz,data/a_seg.nii.gz,data/b_seg.nii.gz,data/a_seg.nii.gz\n"
    )
    report = run_batch(load_spec(write_spec(tmp_path, "defaults: tiny.yaml\noutput: out\ncsv: pairs.csv\n")))
    assert [o.state for o in report.outcomes] == ["done"]
    assert (tmp_path / "out" / "b_to_a" / "warped_labels.nii.gz").is_file()
    metrics = json.loads((tmp_path / "out" / "b_to_a" / "metrics.json").read_text())
    with open(tmp_path / "out" / "summary.csv", newline="") as handle:
        (summary,) = csv.DictReader(handle)
    assert float(summary["mean_dice_after"]) == pytest.approx(metrics["labels"]["mean_dice_after"])
    text = (tmp_path / "out" / "report.html").read_text()
    svgs = re.findall(r"<svg.*?</svg>", text, flags=re.S)
    assert len(svgs) == 4 and "no values" not in text  # Dice before and after, folds, runtime
    for svg in svgs:
        assert ElementTree.fromstring(svg).tag == "svg"  # well-formed


def test_device_label_names_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert device_label("cuda") == "cuda (CUDA_VISIBLE_DEVICES=3)"
    assert device_label("cpu") == "cpu"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert device_label("cuda:0") == "cuda:0"
