"""regkit.config.messages: every error is one line FILE:LINE: key.path: message."""

from __future__ import annotations

import pytest

from tests.regkit.config.yaml_files import config_error, write_yaml

AFFINE = "  - type: affine\n    similarity: {name: ncc}\n"

ERRORS = {
    "tab": ("dim: 3\nstages:\n\t- type: affine\n", 3, "", "spaces, not tabs"),
    "unknown key": (
        f"stages:\n{AFFINE}    optimizer:\n      iteratons: 5\n",
        5,
        "stages[0].optimizer.iteratons",
        "unknown key 'iteratons'; did you mean 'iterations'?",
    ),
    "wrong type": (
        "stages:\n  - type: cpab\n    similarity: {name: ncc}\n    steps: '50'\n",
        4,
        "stages[0].steps",
        "expected an integer, got a string '50'",
    ),
    "out of range": (
        f"dim: 3\nstages:\n  - type: moments\n{AFFINE}    optimizer:\n      learning_rate: -1\n",
        7,
        "stages[1].optimizer.learning_rate",
        "must be > 0 (got -1)",
    ),
    "schedule length": (
        "stages:\n  - type: cpab\n    similarity: {name: ncc}\n    tessellation: [4, 8]\n",
        4,
        "stages[0].tessellation",
        "2 levels but the pyramid has 3",
    ),
    "schedule decreasing": (
        "stages:\n  - type: cpab\n    similarity: {name: ncc}\n    tessellation:\n"
        "      - 4\n      - 8\n      - [8, 4, 8]\n",
        7,
        "stages[0].tessellation[2]",
        "must not decrease",
    ),
    "cell count": (
        "stages:\n  - type: cpab\n    similarity: {name: ncc}\n    tessellation: [0, 8, 8]\n",
        4,
        "stages[0].tessellation[0]",
        "must be >= 1 (got 0)",
    ),
    "similarity name": (
        "stages:\n  - type: cpab\n    similarity:\n      name: lnc\n      window: 5\n",
        4,
        "stages[0].similarity.name",
        "unknown name 'lnc'; did you mean 'lncc'?",
    ),
    "stage type": ("stages:\n  - type: afine\n", 2, "stages[0].type", "did you mean 'affine'?"),
    "duplicate key": ("dim: 3\nseed: 1\ndim: 2\nstages: []\n", 3, "dim", "duplicate key (first set on line 1)"),
    "empty": ("# only a comment\n", 1, "", "empty"),
    "top-level list": ("- type: affine\n", 1, "", "expected a mapping"),
    "missing key": ("dim: 3\nstages:\n  - type: rigid\n", 3, "stages[0].similarity", "required key missing"),
    "even window": (
        "stages:\n  - type: cpab\n    similarity: {name: lncc, window: 8}\n",
        3,
        "stages[0].similarity.window",
        "must be odd",
    ),
    "even features lncc window": (
        "stages:\n  - type: cpab\n    similarity: {name: features, lncc_weight: 1.0, lncc_window: 4}\n",
        3,
        "stages[0].similarity.lncc_window",
        "must be odd (got 4)",
    ),
    "negative features lncc weight": (
        "stages:\n  - type: cpab\n    similarity: {name: features, lncc_weight: -1.0}\n",
        3,
        "stages[0].similarity.lncc_weight",
        "must be >= 0",
    ),
    "features distance": (
        "stages:\n  - type: cpab\n    similarity: {name: features, distance: l2}\n",
        3,
        "stages[0].similarity.distance",
        "'cosine'",
    ),
    "literal": (
        f"stages:\n{AFFINE}    optimizer: {{name: adamw}}\n",
        4,
        "stages[0].optimizer.name",
        "must be 'adam' or 'lbfgs' (got a string 'adamw'); did you mean 'adam'?",
    ),
    "iterations count": (
        f"stages:\n{AFFINE}    optimizer:\n      iterations: [10, 5]\n",
        5,
        "stages[0].optimizer.iterations",
        "2 entries for 3 pyramid levels",
    ),
    "pyramid order": (
        f"stages:\n{AFFINE}    pyramid:\n      - {{shrink: 1, smoothing: 0}}\n      - {{shrink: 2, smoothing: 0}}\n",
        6,
        "stages[0].pyramid[1].shrink",
        "must not increase",
    ),
    "device": ("device: gpu\nstages:\n  - type: moments\n", 1, "device", "'cuda:N' (got 'gpu')"),
    "dim vs cells": (
        "dim: 2\nstages:\n  - type: cpab\n    similarity: {name: ncc}\n    tessellation: [4, 8, [12, 14, 10]]\n",
        5,
        "stages[0].tessellation[2]",
        "3 per-axis cell counts but dim is 2",
    ),
    "moments not first": (
        f"stages:\n{AFFINE}  - type: moments\n",
        4,
        "stages[1].type",
        "can only be the first stage",
    ),
    "no stages": ("dim: 3\nstages: []\n", 2, "stages", "at least one stage"),
    "bool as int": ("seed: true\nstages:\n  - type: moments\n", 1, "seed", "expected an integer, got a boolean"),
    "syntax": ("dim: 3\nstages: [1, 2\nseed: 3\n", 3, "", "invalid YAML"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_error_names_file_line_and_key(case, tmp_path):
    text, line, key, message = ERRORS[case]
    path = write_yaml(tmp_path, text)
    error = config_error(str(path))
    prefix = f"{path}:{line}: " + (f"{key}: " if key else "")
    assert error.startswith(prefix), error
    assert message in error, error


def test_several_errors_report_the_first_by_line(tmp_path):
    path = write_yaml(tmp_path, "dtype: float16\nseed: -1\nstages:\n  - type: moments\n")
    error = config_error(str(path))
    assert error.startswith(f"{path}:1: dtype: must be 'float32' or 'float64'")
    assert error.endswith("(and 1 more)")


def test_unknown_top_level_key(tmp_path):
    error = config_error(str(write_yaml(tmp_path, "stages:\n  - type: moments\nbackand: torch\n")))
    assert error.endswith(":3: backand: unknown key 'backand'; did you mean 'backend'?")
