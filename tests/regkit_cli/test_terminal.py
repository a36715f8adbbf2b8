"""The summary lines printed after a registration (regkit_cli.terminal)."""

from pathlib import Path

from regkit_cli.terminal import summary_lines


def _metrics(warnings: list[str]) -> dict:
    return {
        "similarity": {"ncc": {"before": 0.5, "after": 0.1}},
        "jacobian": {"fraction_nonpositive": 0.0, "sdlogj": 0.03, "analytic_min": 0.8, "analytic_max": 1.2},
        "invertibility": {
            "points": 1000,
            "inverse_consistency_mm": {"max": 2.5e-5, "p99": 8e-6},
            "probe_mm": 0.001,
            "largest_jump_mm": 0.0013,
        },
        "runtime": {"total_seconds": 1.0, "stages": [{"kind": "cpab", "seconds": 1.0}]},
        "peak_memory": {"bytes": None},
        "device": "cpu",
        "warnings": warnings,
    }


def test_warnings_end_the_summary():
    lines = summary_lines(Path("out"), _metrics(["stage 2 (cpab): the deformable stage made its similarity worse"]))
    assert lines[-1] == "warning: stage 2 (cpab): the deformable stage made its similarity worse"
    assert not [line for line in summary_lines(Path("out"), _metrics([])) if line.startswith("warning")]


def test_the_guarantees_are_printed():
    lines = summary_lines(Path("out"), _metrics([]))
    expected = "inverse consistency: max 2.5e-05 mm, p99 8e-06 mm; points 0.001 mm apart map at most 0.0013 mm apart"
    assert expected in lines


def test_stage_notes_follow_the_outputs_line():
    metrics = _metrics([])
    note = "multi-modal pair detected: r^2/eta^2 = 0.31 after the earlier stages (below 0.7); the stage uses mi"
    metrics["runtime"]["stages"] = [{"kind": "affine", "seconds": 1.0}, {"kind": "cpab", "seconds": 1.0, "note": note}]
    assert summary_lines(Path("out"), metrics)[1] == f"stage 1 (cpab): {note}"
