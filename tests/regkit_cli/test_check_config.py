"""``regkit check-config``: presets and files validate, --show prints loadable YAML, errors are one line on stderr."""

from __future__ import annotations

import pytest

from regkit.config import load_config
from tests.helpers import run_cli


def test_valid_preset(capsys):
    assert run_cli(["check-config", "demo"]) == 0
    assert capsys.readouterr().out == "demo: valid\n"


def test_show_prints_yaml_that_loads(capsys, tmp_path):
    assert run_cli(["check-config", "brain-mri-3d", "--show"]) == 0
    path = tmp_path / "shown.yaml"
    path.write_text(capsys.readouterr().out)
    assert load_config(str(path)) == load_config("brain-mri-3d")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("stages:\n  - type: moments\nseed: x\n", ":3: seed: expected an integer"),
        ("stages:\n\t- type: moments\n", ":2: invalid YAML"),
    ],
)
def test_invalid_file_is_one_line_on_stderr(capsys, tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert run_cli(["check-config", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {path}{expected}")
    assert captured.err.count("\n") == 1
    assert "Traceback" not in captured.err


def test_unknown_preset(capsys):
    assert run_cli(["check-config", "no-such-preset"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: 'no-such-preset' is neither a YAML file nor a preset")
    assert err.count("\n") == 1
