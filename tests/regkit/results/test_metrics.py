"""regkit.results.metrics: the contents of metrics.json, read from the registrations of tests/regkit/conftest.py."""

from __future__ import annotations

import json

import pytest
import torch

from regkit.config import load_config
from regkit.io import read_image
from regkit.results import field_of_view_overlap, read_moving_grid
from regkit.spatial.grid import Grid
from tests.helpers import same_grid


def test_jacobian_positive_and_consistent_with_metrics(registration_case):
    result, _, out = registration_case
    det = read_image(out / "jacobian.nii.gz")
    assert same_grid(det.grid, result.fixed.grid) and det.data.dtype == torch.float32
    assert float(det.data.min()) > 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["jacobian"]["fraction_nonpositive"] == 0.0
    assert metrics["jacobian"]["analytic_min"] == pytest.approx(float(det.data.min()), rel=1e-6)


def test_metrics_content(registration_case):
    result, _, out = registration_case
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) == {
        "similarity",
        "labels",
        "jacobian",
        "invertibility",
        "warnings",
        "failed_checks",
        "field_of_view_overlap",
        "runtime",
        "peak_memory",
        "device",
        "seed",
        "versions",
        "images",
    }
    assert metrics["warnings"] == [] and metrics["failed_checks"] == []
    assert set(metrics["similarity"]) == {"ncc", "mse", "lncc"}
    for values in metrics["similarity"].values():
        assert values["after"] < values["before"]
    labels = metrics["labels"]
    assert labels["labels"] == [1, 2]
    assert labels["mean_dice_after"] > labels["mean_dice_before"]
    assert set(labels["hd95_after_mm"]) == {"1", "2"}
    assert metrics["jacobian"]["sdlogj"] > 0
    invertibility = metrics["invertibility"]
    assert invertibility["points"] > 100 and invertibility["probe_mm"] == 0.001
    assert invertibility["inverse_consistency_mm"]["max"] < 1e-3  # float32 flows: rounding only
    assert 0 < invertibility["largest_jump_mm"] < 0.01
    assert [s["kind"] for s in metrics["runtime"]["stages"]] == ["moments", "affine", "cpab"]
    assert metrics["runtime"]["total_seconds"] == result.seconds
    assert metrics["peak_memory"]["bytes"] > 0 and metrics["peak_memory"]["measure"] == "process_peak_rss"
    assert metrics["device"] == "cpu" and metrics["seed"] == 0
    assert set(metrics["versions"]) == {"regkit", "torch", "python"}
    assert read_moving_grid(out) == result.moving.grid
    assert load_config(str(out / "config.yaml")) == result.config


def test_field_of_view_overlap():
    grid = Grid.create((10, 10), (1.0, 1.0))
    assert field_of_view_overlap(grid, grid) == 1.0
    assert field_of_view_overlap(grid, Grid.create((10, 10), origin=(100.0, 0.0))) == 0.0
    assert 0.4 < field_of_view_overlap(grid, Grid.create((10, 10), origin=(5.0, 0.0))) < 0.6


def test_warnings_name_what_went_wrong(registration_case):
    from regkit.results.metrics import metrics_warnings

    result = registration_case[0]
    fine = {"fraction_nonpositive": 0.0, "sdlogj": 0.03, "analytic_min": 0.8, "analytic_max": 1.2}
    better = {"ncc": {"before": 0.5, "after": 0.1}}
    exact = {"inverse_consistency_mm": {"max": 1e-6, "p99": 1e-7}, "probe_mm": 0.001, "largest_jump_mm": 0.0012}
    assert metrics_warnings(result, better, fine, exact) == []
    worse = {"ncc": {"before": 0.1, "after": 0.5}}
    assert metrics_warnings(result, worse, fine, exact) == [
        "the registration made the similarity ncc worse than no registration (0.1 -> 0.5)"
    ]
    folds = {**fine, "analytic_min": -0.2, "fraction_nonpositive": 0.01}
    assert metrics_warnings(result, better, folds, exact) == [
        "the transformation folds: analytic Jacobian determinant down to -0.2",
        "0.01 of the voxels have a non-positive finite-difference Jacobian",
    ]
    extreme = {**fine, "analytic_min": 0.09, "analytic_max": 12.6}
    (line,) = metrics_warnings(result, better, extreme, exact)
    assert line.startswith("extreme local volume change: analytic Jacobian determinant in [0.09, 12.6]")
    broken = {"inverse_consistency_mm": {"max": 2.1, "p99": 0.2}, "probe_mm": 0.001, "largest_jump_mm": 1.03}
    assert metrics_warnings(result, better, fine, broken) == [
        "the inverse transformation maps points back to within 2.1 mm only",
        "points 0.001 mm apart map up to 1.03 mm apart: the map is discontinuous or stretches extremely",
    ]


def test_failed_checks_are_the_warnings_that_make_a_result_wrong(registration_case):
    import dataclasses

    from regkit.results.metrics import failed_checks

    result = registration_case[0]
    fine = {"fraction_nonpositive": 0.0, "sdlogj": 0.03, "analytic_min": 0.8, "analytic_max": 12.6}  # extreme: a doubt
    better, worse = {"ncc": {"before": 0.5, "after": 0.1}}, {"ncc": {"before": 0.1, "after": 0.5}}
    assert failed_checks(result, better, fine) == []
    assert failed_checks(result, worse, fine) == [
        "the registration made the similarity ncc worse than no registration (0.1 -> 0.5)"
    ]
    assert failed_checks(result, better, {**fine, "analytic_min": -0.2}) == [
        "the transformation folds: analytic Jacobian determinant down to -0.2"
    ]
    assert failed_checks(result, better, {**fine, "analytic_min": None}) == [
        "the transformation's Jacobian determinant is not finite"
    ]
    # with a fixed mask the similarity that counted is not the whole image's, which metrics.json measures
    masked = dataclasses.replace(result, fixed_mask=result.fixed)
    assert failed_checks(masked, worse, fine) == []
