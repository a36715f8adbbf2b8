"""WTConv reference layers: the Haar transform, agreement with a transcription of the authors' layer, the closed-form
synthesis identity the fused kernels rest on, gradcheck, parameters and state_dicts, backend choice."""

import math

import pytest
import torch
import torch.nn.functional as F

from regkit._backend import BackendError
from regkit.features import WTConv, WTConv2d, WTConv3d, haar_analysis, haar_synthesis, wtconv, wtconv_reference

_CONV = {2: F.conv2d, 3: F.conv3d}
_CONV_T = {2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _haar_filters(channels: int, ndim: int) -> torch.Tensor:
    """The authors' ``create_wavelet_filter('db1')`` generalised to ndim: (C * 2**ndim, 1, 2, ...) filters, sub-band b
    taking the high-pass along spatial axis a when bit a of b is set (so LL, LH, HL, HH in 2D)."""
    lo = torch.tensor([1.0, 1.0], dtype=torch.float64) / math.sqrt(2)
    hi = torch.tensor([1.0, -1.0], dtype=torch.float64) / math.sqrt(2)
    bank = []
    for b in range(2**ndim):
        f = torch.ones((), dtype=torch.float64)
        for axis in range(ndim):
            f = torch.tensordot(f, hi if b >> axis & 1 else lo, dims=0)
        bank.append(f)
    return torch.stack(bank)[:, None].repeat(channels, *([1] * (ndim + 1)))


def _authors_layer(x, params, ndim):
    """Transcription of the authors' WTConv2d.forward (strided conv analysis, transposed conv synthesis)."""
    base_weight, base_bias, base_scale, weights, scales = params
    c, pad = x.shape[1], base_weight.shape[-1] // 2
    filters = _haar_filters(c, ndim).to(x.dtype)
    lows, highs, shapes, cur = [], [], [], x
    for w, s in zip(weights, scales, strict=True):
        shapes.append(cur.shape)
        if any(n % 2 for n in cur.shape[2:]):
            cur = F.pad(cur, [p for n in reversed(cur.shape[2:]) for p in (0, n % 2)])
        bands = _CONV[ndim](cur, filters, stride=2, groups=c)
        cur = bands.unflatten(1, (c, 2**ndim))[:, :, 0]
        tag = (s * _CONV[ndim](bands, w, padding=pad, groups=bands.shape[1])).unflatten(1, (c, 2**ndim))
        lows.append(tag[:, :, 0])
        highs.append(tag[:, :, 1:])
    nxt = 0
    for _ in range(len(weights)):
        low, high, shape = lows.pop() + nxt, highs.pop(), shapes.pop()
        bands = torch.cat([low.unsqueeze(2), high], dim=2).flatten(1, 2)
        nxt = _CONV_T[ndim](bands, filters, stride=2, groups=c)[(..., *(slice(0, n) for n in shape[2:]))]
    return base_scale * _CONV[ndim](x, base_weight, base_bias, padding=pad, groups=c) + nxt


def _random_params(layer):
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return (
        layer.base_conv.weight,
        layer.base_conv.bias,
        layer.base_scale.weight,
        [m.weight for m in layer.wavelet_convs],
        [m.weight for m in layer.wavelet_scale],
    )


def test_haar_is_orthonormal_and_ordered_as_the_authors():
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    bands = haar_analysis(x)
    assert bands.shape == (2, 3, 4, 3, 4)
    torch.testing.assert_close(haar_synthesis(bands), x)
    torch.testing.assert_close(bands.square().sum(), x.square().sum())
    a, b, c, d = x[..., 0, 0], x[..., 0, 1], x[..., 1, 0], x[..., 1, 1]
    expected = torch.stack([a + b + c + d, a + b - c - d, a - b + c - d, a - b - c + d], dim=2) / 2
    torch.testing.assert_close(bands[..., 0, 0], expected)
    torch.testing.assert_close(bands, _CONV[2](x, _haar_filters(3, 2), stride=2, groups=3).unflatten(1, (3, 4)))
    x3 = torch.randn(1, 2, 4, 6, 2, dtype=torch.float64)
    bands3 = haar_analysis(x3)
    torch.testing.assert_close(haar_synthesis(bands3), x3)
    torch.testing.assert_close(bands3, _CONV[3](x3, _haar_filters(2, 3), stride=2, groups=2).unflatten(1, (2, 8)))


@pytest.mark.parametrize(
    "ndim, shape, levels, k", [(2, (2, 3, 16, 16), 2, 5), (2, (1, 2, 57, 43), 5, 3), (3, (1, 2, 9, 10, 11), 3, 3)]
)
def test_matches_the_authors_layer(ndim, shape, levels, k):
    layer = WTConv[ndim](shape[1], k, levels, backend="reference").double()
    params = _random_params(layer)
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _authors_layer(x, params, ndim))


def test_closed_form_synthesis_equals_the_cascade():
    """sum_j 2**(-j ndim/2) sum_b sign_b(y) Z_j[b](y >> j), sign from bit j-1 of y, equals the cascade with crops."""
    for size in [(57, 43), (9, 10, 11)]:
        ndim, levels = len(size), 4
        sizes = [tuple(-(-s // 2**j) for s in size) for j in range(levels + 1)]
        processed = [torch.randn(1, 2, 2**ndim, *sizes[j], dtype=torch.float64) for j in range(1, levels + 1)]
        cascade = None
        for j in range(levels, 0, -1):
            z = processed[j - 1].clone()
            if cascade is not None:
                z[:, :, 0] += cascade
            cascade = haar_synthesis(z)[(..., *(slice(0, s) for s in sizes[j - 1]))]
        coords = torch.meshgrid(*(torch.arange(s) for s in size), indexing="ij")
        closed = torch.zeros(1, 2, *size, dtype=torch.float64)
        for j in range(1, levels + 1):
            for b in range(2**ndim):
                sign = torch.ones(size, dtype=torch.float64)
                for axis in range(ndim):
                    if b >> axis & 1:
                        sign = sign * (1 - 2 * ((coords[axis] >> (j - 1)) & 1))
                coarse = processed[j - 1][:, :, b][(..., *(c >> j for c in coords))]
                closed += 2 ** (-j * ndim / 2) * sign * coarse
        torch.testing.assert_close(closed, cascade)


@pytest.mark.parametrize("ndim, shape, fast", [(2, (1, 1, 7, 6), False), (3, (1, 1, 5, 4, 3), True)])
def test_gradcheck(ndim, shape, fast):
    layer = WTConv[ndim](shape[1], 3, 2, backend="reference").double()
    _random_params(layer)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    names, params = zip(*layer.named_parameters(), strict=True)

    def f(x, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps, strict=True)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params), fast_mode=fast)


def test_parameters_and_initial_values():
    layer = WTConv2d(6, 5, levels=3)
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == {
        "base_conv.weight": (6, 1, 5, 5),
        "base_conv.bias": (6,),
        "base_scale.weight": (1, 6, 1, 1),
        **{f"wavelet_convs.{i}.weight": (24, 1, 5, 5) for i in range(3)},
        **{f"wavelet_scale.{i}.weight": (1, 24, 1, 1) for i in range(3)},
    }
    assert sum(p.numel() for p in layer.parameters()) == 6 * (25 + 2) + 3 * 4 * 6 * (25 + 1)
    assert torch.all(layer.base_scale.weight == 1.0) and torch.all(layer.wavelet_scale[2].weight == 0.1)
    layer3 = WTConv3d(2, 3, levels=1, bias=False)
    assert layer3.base_conv.bias is None and layer3.wavelet_convs[0].weight.shape == (16, 1, 3, 3, 3)
    x = torch.randn(1, 2, 5, 6, 7)
    assert layer3(x).shape == x.shape


def test_loads_a_state_dict_of_the_authors_layer():
    """The authors' state_dict (with their fixed Haar filters ``wt_filter`` and ``iwt_filter``) loads: every parameter
    takes the state's value, the filters are dropped, and the layer computes the authors' layer with those weights."""
    layer = WTConv2d(3, 5, levels=2)
    state = {name: torch.randn_like(p) for name, p in layer.state_dict().items()}
    state["wt_filter"] = state["iwt_filter"] = _haar_filters(3, 2).float()
    loaded = WTConv2d(3, 5, levels=2)
    loaded.load_state_dict(state)
    assert set(loaded.state_dict()) == set(state) - {"wt_filter", "iwt_filter"}
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, state[name]), name
    loaded.double()
    x = torch.randn(1, 3, 12, 10, dtype=torch.float64)
    weights = {name: value.double() for name, value in state.items()}
    params = (
        weights["base_conv.weight"],
        weights["base_conv.bias"],
        weights["base_scale.weight"],
        [weights[f"wavelet_convs.{i}.weight"] for i in range(2)],
        [weights[f"wavelet_scale.{i}.weight"] for i in range(2)],
    )
    torch.testing.assert_close(loaded(x), _authors_layer(x, params, 2))


def test_errors_quote_what_they_received():
    with pytest.raises(ValueError, match="odd"):
        WTConv2d(4, kernel_size=4)
    with pytest.raises(ValueError, match="levels"):
        WTConv3d(4, levels=0)
    with pytest.raises(ValueError, match=r"\(2, 3, 8\)"):
        WTConv2d(3)(torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match=r"\(1, 4, 8, 8\)"):
        WTConv2d(3)(torch.zeros(1, 4, 8, 8))


def test_backend_choice(monkeypatch):
    layer = WTConv2d(2, 3, levels=2)
    params = (
        layer.base_conv.weight,
        layer.base_conv.bias,
        layer.base_scale.weight,
        [m.weight for m in layer.wavelet_convs],
        [m.weight for m in layer.wavelet_scale],
    )
    x = torch.randn(1, 2, 8, 8)
    torch.testing.assert_close(wtconv(x, *params, backend="auto"), wtconv_reference(x, *params))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendError, match="needs CUDA"):
        wtconv(x, *params, backend="triton")
    with pytest.raises(BackendError, match="not offered"):
        wtconv(x, *params, backend="torch")
