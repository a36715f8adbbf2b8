"""Fused WTConv kernels against the reference layer: output and every gradient (input, base weight, bias and scale,
per-level weights and scales), fp32 tight and bf16 loose, plus state_dicts across backends.

On CPU the kernels run in Triton's interpreter, which is slow: the default cases are few and small (one channel, whole
planes per program); the full grid of levels 1..5, k in {3, 5, 7} and sizes is marked ``slow``. The ``gpu`` cases
run the WTConvNeXt stage shapes (set REGKIT_TEST_CUDA=1 so that the conftest leaves the interpreter off).
"""

import itertools

import pytest
import torch

pytest.importorskip("triton")

from regkit.features import WTConv
from tests.helpers import assert_relative_close, relative_tolerance


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _layer(ndim: int, channels: int, k: int, levels: int, device: str) -> torch.nn.Module:
    layer = WTConv[ndim](channels, k, levels).to(device)
    with torch.no_grad():  # away from the initial values, so that every term and gradient is exercised
        for p in layer.parameters():
            p.uniform_(-1.0, 1.0)
    return layer


def _run(layer, x, grad, backend):
    """Output and gradients (input first, then the parameters by name) of one forward + backward."""
    layer.backend = backend
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = layer(x)
    out.backward(grad)
    return {"out": out, "x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


def _compare(ndim, shape, k, levels, dtype):
    torch.manual_seed(sum(shape) + 7 * k + levels)
    device = _device()
    layer = _layer(ndim, shape[1], k, levels, device)
    x = torch.randn(shape, device=device).to(dtype)
    grad = torch.randn(shape, device=device).to(dtype)
    want = _run(layer, x.float(), grad.float(), "reference")
    got = _run(layer, x, grad, "triton")
    assert got.keys() == want.keys()
    for name in want:  # the shared tolerance of the fused kernels, per dtype
        assert_relative_close(got[name], want[name], relative_tolerance(dtype), name)


# A small representative set for the CPU suite: odd and even sizes, a batch of 2, every level count down to 1 x 1 grids.
@pytest.mark.parametrize(
    "ndim, shape, k, levels, dtype",
    [
        (2, (1, 1, 57, 43), 3, 5, torch.float32),
        (2, (2, 1, 7, 7), 5, 2, torch.float32),
        (2, (1, 1, 8, 6), 7, 1, torch.float32),
        (2, (1, 1, 7, 7), 3, 3, torch.bfloat16),
        (3, (1, 1, 9, 10, 11), 3, 2, torch.float32),
    ],
)
def test_fused_matches_reference(ndim, shape, k, levels, dtype):
    _compare(ndim, shape, k, levels, dtype)


_GRID_2D = [
    (2, (1, 1, *size), k, levels, dtype)
    for size, k, levels, dtype in itertools.product(
        [(7, 7), (57, 43)], [3, 5, 7], [1, 2, 3, 4, 5], [torch.float32, torch.bfloat16]
    )
]
_GRID_3D = [
    (3, (1, 1, 9, 10, 11), k, levels, dtype)
    for k, levels, dtype in itertools.product([3, 5], [1, 2, 3], [torch.float32, torch.bfloat16])
]


@pytest.mark.slow
@pytest.mark.parametrize("ndim, shape, k, levels, dtype", _GRID_2D + _GRID_3D)
def test_fused_matches_reference_full_grid(ndim, shape, k, levels, dtype):
    _compare(ndim, shape, k, levels, dtype)


@pytest.mark.parametrize(
    "ndim, shape, k, levels",
    [(2, (2, 2, 13, 11), 3, 3), (2, (2, 2, 9, 12), 5, 2), (3, (1, 2, 5, 6, 7), 3, 2)],
    ids=["2d", "2d-k5", "3d"],
)
def test_weight_gradients_split_into_many_shares(ndim, shape, k, levels, monkeypatch):
    """The GPU's tiling on the CPU: small blocks and spans give every level several partial-sum rows (and 2D level 1
    a last, partial share), so that the program plan and the final sum over the rows are exercised, and the other
    kernels several programs per channel; with k = 5, 2D level 1 has tap rows whose pixels feed no base tap (run
    without the base sums)."""
    from regkit_kernels.wtconv import ops

    monkeypatch.setattr(ops, "wgrad_tiling", lambda *args: (4, 8))
    monkeypatch.setattr(ops, "INTERPRETER_BLOCK", 16)
    ops.launch_plan.cache_clear()  # launch plans are cached per shape
    try:
        _compare(ndim, shape, k, levels, torch.float32)
    finally:
        ops.launch_plan.cache_clear()


def test_state_dict_moves_between_backends():
    device = _device()
    reference = _layer(2, 2, 3, 2, device)
    reference.backend = "reference"
    fused = WTConv[2](2, 3, 2, backend="triton").to(device)
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(1, 2, 9, 8, device=device)
    torch.testing.assert_close(fused(x), reference(x), rtol=1e-5, atol=1e-5)


# WTConvNeXt-T stages (kernel 5, levels 5, 4, 3, 2) at batch 4, and the 3D feature-network shape at a smaller size.
@pytest.mark.gpu
@pytest.mark.parametrize(
    "ndim, shape, levels",
    [
        (2, (4, 96, 56, 56), 5),
        (2, (4, 192, 28, 28), 4),
        (2, (4, 384, 14, 14), 3),
        (2, (4, 768, 7, 7), 2),
        (3, (2, 8, 48, 56, 48), 3),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_reference_on_gpu(ndim, shape, levels, dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # a float32 reference, not TF32
    _compare(ndim, shape, 5, levels, dtype)
