"""``regkit.batch.report``: report.html, self-contained, with a row per job, QC thumbnails and histograms."""

from __future__ import annotations

import base64
import time
import urllib.parse
from html.parser import HTMLParser

from regkit.batch import load_spec, run_batch
from tests.regkit.batch.batch_cases import LIST_SPEC, TINY_CONFIG, corrupt, make_data, write_spec


class _Page(HTMLParser):
    """The parts of report.html the tests look at: body rows, image sources, every URL-like attribute, SVGs."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.images: list[str] = []
        self.links: list[str] = []
        self.svgs = 0
        self.headers: list[str] = []
        self._in_body = self._in_th = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._in_body |= tag == "tbody"
        self._in_th = tag == "th"
        if tag == "tr" and self._in_body:
            self.rows.append([attrs.get("class", "")])
        if tag == "img":
            self.images.append(attrs["src"])
        self.links += [v for k, v in attrs.items() if k in ("href", "src") and v is not None]
        self.svgs += tag == "svg"

    def handle_endtag(self, tag):
        self._in_body &= tag != "tbody"
        self._in_th = False

    def handle_data(self, data):
        if self._in_th:
            self.headers.append(data)


def test_report_html_is_self_contained_with_a_row_per_job(tmp_path):
    make_data(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.replace("qc_png: false", "qc_png: true"))
    spec = write_spec(tmp_path, LIST_SPEC + "  - {fixed: data/b.nii.gz, moving: data/c.nii.gz}\n")
    corrupt(tmp_path / "data" / "b.nii.gz")  # b_to_a and c_to_b fail
    run_batch(load_spec(spec))
    report = tmp_path / "out" / "report.html"
    for rerun in (False, True):  # a rerun (everything skipped) rewrites the report over all jobs
        if rerun:
            before = report.stat().st_mtime_ns
            time.sleep(0.01)
            assert {o.state for o in run_batch(load_spec(spec)).outcomes} == {"skipped"}
            assert report.stat().st_mtime_ns != before
        text = report.read_text()
        page = _Page()
        page.feed(text)
        page.close()
        assert [row[0] for row in page.rows] == ["failed", "done", "failed"]
        assert len(page.images) == 1 and page.images[0].startswith("data:image/png;base64,")
        thumbnail = base64.b64decode(page.images[0].split(",", 1)[1])
        assert thumbnail.startswith(b"\x89PNG\r\n\x1a\n")
        assert page.links == ["./c_to_a/qc.png", page.images[0]]  # a relative link to the full picture
        assert "://" not in text and "url(" not in text and "@import" not in text  # nothing from the network
        assert page.svgs == 2 and text.count("no values") == 2  # folds and runtime; no labels: no Dice
        assert {"Dice after", "folds %", "runtime s", "device", "warnings", "error"} <= set(page.headers)
        assert "<script>" in text and "<style>" in text
    assert not list((tmp_path / "out").glob("*.tmp-*"))


def test_file_names_never_become_urls_of_their_own(tmp_path):
    """A job named after a hostile file name links to its folder, percent-encoded, never to a scheme or a host."""
    from regkit.batch.report import relative_url

    for name in ("javascript:alert(1);x=", "//evil.example/x", "a?b#c", 'q"><script>'):
        url = relative_url(f"{name}/qc.png")
        assert url.startswith("./") and ":" not in url and "?" not in url and "#" not in url and '"' not in url
        assert urllib.parse.unquote(url) == f"./{name}/qc.png"
