"""``python -m benchmarks wtconv --quick``: tiny shapes on the CPU (fused rows through the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from benchmarks.__main__ import app


@pytest.mark.slow  # a whole benchmark run: over 30 s on 2 cores
def test_bench_wtconv_quick_prints_and_writes_tables(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    result = CliRunner().invoke(app, ["wtconv", "--quick", "--output", str(out)])
    assert result.exit_code == 0, result.output
    markdown = out.read_text()
    header = (
        "| version | forward ms | fwd+bwd ms | graphed ms | peak MiB | peak, sum loss | I/O MB | GB/s | of copy "
        "| first use s |"
    )
    assert header in markdown
    assert "**(1, 2, 8, 6) L2 k3" in markdown and "**(1, 1, 4, 4, 3) L1 k3" in markdown
    for version in ("fused fp32", "fused bf16", "reference", "reference (cudnn.benchmark)", "depthwise conv"):
        assert markdown.count(f"| {version} |") == 2
    for version in ("authors' layer", "authors' layer (cudnn.benchmark)"):  # 2D only
        assert markdown.count(f"| {version} |") == 1
    assert "2D fused fp32 fwd+bwd: " in markdown and "geometric mean" in markdown
    assert "(1, 2, 8, 6) L2 k3: interleaved eager fwd+bwd, 3 rounds: fused fp32 " in markdown
    assert "per round bf16 / fp32 " in markdown and "(1, 1, 4, 4, 3) L1 k3: interleaved" not in markdown  # 2D only


def test_bench_wtconv_ndim_keeps_only_those_shapes(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    result = CliRunner().invoke(app, ["wtconv", "--quick", "--ndim", "3", "--output", str(out)])
    assert result.exit_code == 0, result.output
    markdown = out.read_text()
    assert "**(1, 1, 4, 4, 3) L1 k3" in markdown and "**(1, 2, 8, 6)" not in markdown


def test_fused_io_model_counts_every_launch() -> None:
    """One 2D level (no coarse levels): the output kernel reads x and writes out; the backward reads dy and x and
    writes dx. Two levels add the low-pass pyramid and the level-2 sub-bands (float32)."""
    from benchmarks.wtconv import Case, fused_bytes

    n = 2 * 3 * 8 * 8
    assert fused_bytes(Case((2, 3, 8, 8), 1, 5), 4) == 4 * (2 * n + 3 * n)
    low, sub = n // 4, n // 4  # level-1 grid elements; level-2 sub-bands: 4 bands x n / 16
    lowpass = 4 * n + 4 * low  # x -> LL_1
    forward = lowpass + 4 * low + 2 * 4 * sub + 2 * 4 * n
    backward = lowpass + 2 * 4 * low + 2 * 4 * sub + 3 * 4 * n
    assert fused_bytes(Case((2, 3, 8, 8), 2, 5), 4) == forward + backward


@pytest.mark.parametrize(("shape", "levels", "k"), [((2, 3, 7, 7), 3, 3), ((1, 2, 57, 43), 5, 5)])
def test_authors_layer_is_the_reference_layer(shape: tuple[int, ...], levels: int, k: int) -> None:
    """The "authors' layer" baseline (Haar by strided and transposed grouped convolutions) computes the reference
    layer: the same output and gradients from the same parameters, odd sizes included."""
    from benchmarks.wtconv import Case, build_layer

    case = Case(shape, levels, k)
    (ref, x, grad), (authors, x2, grad2) = (build_layer(case, v, "cpu") for v in ("reference", "authors' layer"))
    out, out2 = ref(x), authors(x2)
    out.backward(grad)
    out2.backward(grad2)
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x2.grad, x.grad, atol=1e-5, rtol=1e-5)
    for p, p2 in zip(ref.parameters(), authors.parameters(), strict=True):
        torch.testing.assert_close(p2.grad, p.grad, atol=1e-4, rtol=1e-5)
