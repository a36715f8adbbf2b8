"""The configuration reference (docs/configuration.md) matches the models, and the user docs' links resolve.

When the first test fails, regenerate the page from the repository root:

    python -m regkit.config.reference --output docs/configuration.md
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from regkit.config import SIMILARITIES, STAGES, RegistrationConfig
from regkit.config.reference import PARTS, main, render_reference

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "configuration.md"
USER_DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ANCHOR = re.compile(r'<a name="([^"]+)"></a>')


def test_committed_page_is_the_generated_one() -> None:
    assert PAGE.read_text(encoding="utf-8") == render_reference(), (
        "docs/configuration.md is out of date: run python -m regkit.config.reference --output docs/configuration.md"
    )


def test_page_lists_every_stage_and_measure_with_its_keys() -> None:
    page = render_reference()
    for name in RegistrationConfig.model_fields:
        assert f"| `{name}` |" in page
    for kind, model in STAGES.items():
        assert f"`stages[]` with `type: {kind}`" in page
        assert all(f"| `{key}` |" in page for key in model.model_fields)
    for name, measure in SIMILARITIES.items():  # the configuration's similarity union comes from the registry
        assert f"`similarity` with `name: {name}`" in page
        assert all(f"| `{key}` |" in page for key in measure.options.model_fields)


def test_page_is_deterministic() -> None:
    assert render_reference() == render_reference()


def test_every_anchor_link_of_the_page_has_its_anchor() -> None:
    page = render_reference()
    anchors = set(ANCHOR.findall(page))
    assert {part.anchor for part in PARTS} <= anchors
    targets = {target[1:] for target in LINK.findall(page) if target.startswith("#")}
    assert targets and targets <= anchors, sorted(targets - anchors)


def test_registration_example_is_valid() -> None:
    example = re.search(r"```yaml\n(.*?)```", render_reference(), re.S)
    assert example is not None
    data = yaml.safe_load(example.group(1))
    data.pop("base")
    RegistrationConfig.model_validate({**data, "stages": [{"type": "moments"}]})


def test_check_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "configuration.md"
    assert main(["--output", str(out)]) == 0
    assert main(["--output", str(out), "--check"]) == 0
    out.write_text("stale\n", encoding="utf-8")
    assert main(["--output", str(out), "--check"]) == 1
    assert "out of date" in capsys.readouterr().out


def _anchors(path: Path) -> set[str]:
    """The link targets a Markdown file defines: its headings as GitHub slugs them, and its ``<a name>`` anchors."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    slugs = {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}
    return slugs | set(ANCHOR.findall(text))


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)  # links in code are not links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        file = doc.parent / path if path else doc
        if not file.exists() or (fragment and file.suffix == ".md" and fragment not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing files or anchors: {broken}"
