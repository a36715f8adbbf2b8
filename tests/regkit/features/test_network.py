"""The feature network: shapes and unit length in 2D and 3D, the fused layers against the reference ones, weights
files (round trip, errors) and the shipped weights."""

import pytest
import torch

from regkit.errors import RegkitError
from regkit.features import FeatureNetwork, NetworkSpec, load_feature_network, save_feature_network
from regkit.features.network import self_similarity, shipped_weights_path

_TINY = {2: NetworkSpec(ndim=2, channels=(4, 8), depths=(1, 1), levels=(2, 1), kernel_size=3, features=6)}
_TINY[3] = NetworkSpec(ndim=3, channels=(4, 8), depths=(1, 1), levels=(1, 1), kernel_size=3, features=6)


def _network(ndim: int, backend: str = "reference") -> FeatureNetwork:
    torch.manual_seed(0)
    return FeatureNetwork(_TINY[ndim], backend=backend)


@pytest.mark.parametrize(("ndim", "shape"), [(2, (2, 1, 13, 10)), (3, (1, 1, 7, 6, 9))])
def test_shapes_and_unit_length(ndim, shape):
    maps = _network(ndim)(torch.rand(shape))
    half = tuple(-(-s // 2) for s in shape[2:])
    assert maps.full.shape == (shape[0], 6, *shape[2:])
    assert maps.half.shape == (shape[0], 6, *half)
    for m in maps:
        assert m.dtype == torch.float32
        torch.testing.assert_close(m.norm(dim=1), torch.ones_like(m[:, 0]))


def test_rejects_a_multichannel_input():
    with pytest.raises(ValueError, match=r"\(B, 1, \*spatial\)"):
        _network(2)(torch.rand(1, 2, 8, 8))


def test_gradients_reach_every_parameter():
    network = _network(2)
    maps = network(torch.rand(2, 1, 12, 12))
    (maps.full[:, 0].sum() + maps.half[:, 1].sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in network.parameters())


def test_fused_layers_match_the_reference():
    """The same weights on the Triton kernels (interpreted on the CPU) and on the reference layers."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("runs the interpreter on CPU tensors; the GPU path is covered by tests/kernels")
    reference, fused = _network(2), _network(2, backend="triton")
    fused.load_state_dict(reference.state_dict())
    x = torch.rand(1, 1, 12, 10)
    for a, b in zip(reference(x), fused(x), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_weights_round_trip(tmp_path):
    network = _network(3)
    network(torch.rand(2, 1, 6, 5, 4))  # training mode: updates the heads' running statistics, which are saved too
    network.eval()
    path = save_feature_network(network, tmp_path / "w.pt", {"steps": 3})
    loaded = load_feature_network(path, ndim=3, backend="reference")
    assert loaded.spec == network.spec
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    x = torch.rand(1, 1, 6, 5, 4)
    torch.testing.assert_close(loaded(x).full, network(x).full)
    assert torch.load(path, weights_only=True)["meta"] == {"steps": 3}


def test_weights_errors(tmp_path):
    with pytest.raises(RegkitError, match="no such feature-network weights file"):
        load_feature_network(tmp_path / "absent.pt")
    (tmp_path / "junk.pt").write_text("not torch")
    with pytest.raises(RegkitError, match=r"junk.pt: not a regkit feature-network weights file"):
        load_feature_network(tmp_path / "junk.pt")
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(RegkitError, match="expected format"):
        load_feature_network(tmp_path / "other.pt")
    path = save_feature_network(_network(2), tmp_path / "w2.pt")
    with pytest.raises(RegkitError, match="a 2D feature network, but the images are 3D"):
        load_feature_network(path, ndim=3)


@pytest.mark.parametrize("ndim", [2, 3])
def test_shipped_weights_load_and_give_finite_features(ndim):
    assert shipped_weights_path(ndim).stat().st_size < 4 * 2**20
    network = load_feature_network(ndim=ndim, backend="reference")
    meta = torch.load(shipped_weights_path(ndim), weights_only=True)["meta"]
    assert meta["config"]["dim"] == ndim and meta["steps"] > 0
    shape = (1, 1, 40, 36) if ndim == 2 else (1, 1, 20, 18, 16)
    image = torch.zeros(shape)
    image[(..., *(slice(s // 4, 3 * s // 4) for s in shape[2:]))] = 1.0
    maps = network(image + 0.05 * torch.rand(shape))
    assert all(torch.isfinite(m).all() for m in maps)
    torch.testing.assert_close(maps.full.norm(dim=1), torch.ones(shape[0], *shape[2:]))


@pytest.mark.parametrize(("ndim", "shape"), [(2, (2, 1, 13, 10)), (3, (1, 1, 7, 6, 9))])
def test_self_similarity_ignores_the_contrast(ndim, shape):
    """The descriptors have one channel per offset and do not change under an affine or inverted intensity map."""
    x = torch.rand(shape, dtype=torch.float64)
    descriptors = self_similarity(x, 2)
    assert descriptors.shape == (shape[0], 3**ndim - 1, *shape[2:])
    torch.testing.assert_close(self_similarity(3.0 * x + 0.5, 2), descriptors)
    torch.testing.assert_close(self_similarity(1.0 - x, 2), descriptors)


def test_network_on_self_similarity_inputs():
    """With ``self_similarity`` the stem reads the descriptors: the features ignore an inverted contrast."""
    torch.manual_seed(0)
    spec = NetworkSpec(ndim=2, channels=(4, 8), depths=(1, 1), levels=(2, 1), kernel_size=3, features=6)
    network = FeatureNetwork(NetworkSpec(**{**spec.__dict__, "self_similarity": 1}), backend="reference").eval()
    x = torch.rand(1, 1, 12, 10)
    for a, b in zip(network(x), network(1.0 - x), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
