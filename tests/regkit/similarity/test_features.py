"""The learned ``features`` similarity: registry and parameters, values, caching of the fixed features, the two
modes, gradients, a registration through the engine, and the true alignment of a real multi-modal pair."""

import pytest
import torch

from regkit.config import load_config
from regkit.errors import ConfigError
from regkit.intensity import rescale_intensities
from regkit.io import Image, read_image
from regkit.registration import register
from regkit.similarity import SIMILARITIES, build_similarity
from regkit.similarity.features import FeatureSimilarity
from regkit.spatial.grid import Grid
from regkit.spatial.pyramid import build_pyramid
from regkit.spatial.sampling import sample_image
from tests.helpers import gaussian_blobs, itk_example


def _blobs(size: int = 32, shift: float = 0.0) -> torch.Tensor:
    """Two Gaussian blobs on size x size pixels of 1 mm, the first shifted by ``shift`` in x: (1, 1, size, size)."""
    centres = [(12.0 + shift, 14.0), (22.0, 20.0)]
    image = gaussian_blobs(Grid.create((size, size)), centres, (20.0, 8.0), (1.0, 0.6), dtype=torch.float32)
    return image.data[None, None]


def test_registered_and_built_from_the_configuration(tmp_path):
    assert SIMILARITIES["features"].measure_class() is FeatureSimilarity
    sim = build_similarity("features", mode="warp_features", weights=None)
    assert sim.mode == "warp_features" and sim.weights is None
    with pytest.raises(ConfigError, match="features mode must be"):
        build_similarity("features", mode="warp")
    with pytest.raises(ConfigError, match="has no parameter 'window'"):
        build_similarity("features", window=3)


@pytest.mark.parametrize("mode", ["warp_image", "warp_features"])
def test_the_lncc_term_adds_the_images_local_ncc(mode):
    grid = Grid.create((32, 32), (1.5, 1.5), (3.0, -2.0))
    fixed, moving = _blobs(), _blobs(shift=2.0)[0]
    points = grid.world_points() + torch.tensor([0.7, -0.4])
    hybrid = build_similarity("features", mode=mode, lncc_weight=0.5, lncc_window=5)
    alone = FeatureSimilarity(mode).loss_at_points(fixed, moving, grid, points)
    lncc = build_similarity("lncc", window=5).loss_at_points(fixed, moving, grid, points)
    torch.testing.assert_close(hybrid.loss_at_points(fixed, moving, grid, points), alone + 0.5 * lncc)
    warped = sample_image(moving, grid, points)[None]
    torch.testing.assert_close(hybrid(fixed, warped), FeatureSimilarity(mode)(fixed, warped) + 0.5 * lncc)
    with pytest.raises(ConfigError, match="lncc_weight must be at least 0"):
        FeatureSimilarity(lncc_weight=-1.0)
    with pytest.raises(ConfigError, match="lncc window must be odd"):
        FeatureSimilarity(lncc_window=4)


@pytest.mark.parametrize("mode", ["warp_image", "warp_features"])
def test_the_lncc_distance_is_the_local_ncc_of_the_feature_maps(mode):
    grid = Grid.create((32, 32), (1.5, 1.5), (3.0, -2.0))
    fixed, moving = _blobs(), _blobs(shift=2.0)[0]
    points = grid.world_points() + torch.tensor([0.7, -0.4])
    sim = build_similarity("features", mode=mode, distance="lncc", lncc_window=5)
    warped = sample_image(moving, grid, points)[None]
    maps = [sim.features(image).flatten(1, 2) for image in (fixed, warped)]  # every feature an image of its own
    expected = build_similarity("lncc", window=5)(*maps)
    torch.testing.assert_close(sim(fixed, warped), expected)
    assert 0.0 < float(expected) <= 1.0
    assert float(sim(fixed, fixed.clone())) == pytest.approx(0.0, abs=1e-3)  # the epsilon of flat windows
    assert float(sim.loss_at_points(fixed, moving, grid, points)) == pytest.approx(float(expected), abs=0.05)
    with pytest.raises(ConfigError, match="features distance must be 'cosine' or 'lncc'"):
        FeatureSimilarity(distance="l2")


def test_identical_images_give_zero_and_values_are_bounded():
    sim = FeatureSimilarity()
    fixed = _blobs()
    assert float(sim(fixed, fixed.clone())) == pytest.approx(0.0, abs=1e-5)
    value = float(sim(fixed, _blobs(shift=4.0)))
    assert 0.0 < value <= 2.0
    mask = torch.zeros_like(fixed)
    mask[..., 8:24, 4:20] = 1
    assert float(sim(fixed, _blobs(shift=4.0), mask)) != pytest.approx(value)


def test_channels_are_images_of_their_own():
    sim = FeatureSimilarity()
    a, b = _blobs(), _blobs(shift=3.0)
    both = sim(torch.cat((a, b), 1), torch.cat((b, a), 1))
    torch.testing.assert_close(both, (sim(a, b) + sim(b, a)) / 2)


def test_fixed_features_are_computed_once_per_level(monkeypatch):
    sim = FeatureSimilarity()
    calls = []
    original = sim.features
    monkeypatch.setattr(sim, "features", lambda images: calls.append(images) or original(images))
    fixed, warped = _blobs(), _blobs(shift=2.0)
    for _ in range(3):
        sim(fixed, warped)
    assert sum(c is fixed for c in calls) == 1 and len(calls) == 4
    sim(_blobs(), warped)  # a new level: a new fixed tensor
    assert len(calls) == 6


def test_moving_features_are_computed_once_per_level_in_warp_features_mode(monkeypatch):
    sim = FeatureSimilarity("warp_features")
    calls = []
    original = sim.features
    monkeypatch.setattr(sim, "features", lambda images: calls.append(images) or original(images))
    grid = Grid.create((32, 32))
    fixed, moving = _blobs(), _blobs(shift=2.0)[0]
    for shift in (0.0, 1.0, 2.0):
        sim.loss_at_points(fixed, moving, grid, grid.world_points() + shift)
    assert len(calls) == 2


def test_modes_agree_at_the_identity_and_give_gradients():
    grid = Grid.create((32, 32), (1.5, 1.5), (3.0, -2.0))
    fixed, moving = _blobs(), _blobs(shift=2.0)[0]
    points = grid.world_points().requires_grad_(True)
    exact = FeatureSimilarity("warp_image").loss_at_points(fixed, moving, grid, points)
    fast_sim = FeatureSimilarity("warp_features")
    fast = fast_sim.loss_at_points(fixed, moving, grid, points)
    torch.testing.assert_close(fast, exact, atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(fast, points)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    shifted = grid.world_points() + torch.tensor([1.5, 0.0])
    assert float(fast_sim.loss_at_points(fixed, moving, grid, shifted)) != pytest.approx(float(fast))


@pytest.mark.parametrize("mode", ["warp_image", "warp_features"])
def test_a_registration_with_features_runs(mode, monkeypatch):
    """A registration runs in either mode, and in ``warp_features`` mode the engine lets the similarity warp the
    moving features (extracted once for the level, not once per iteration)."""
    extracted = []
    original = FeatureSimilarity.features
    monkeypatch.setattr(
        FeatureSimilarity, "features", lambda self, images: extracted.append(1) or original(self, images)
    )
    cfg = load_config(
        "quick-2d",
        {
            "stages": [
                {
                    "type": "cpab",
                    "similarity": {"name": "features", "mode": mode},
                    "pyramid": [{"shrink": 1, "smoothing": 0.0}],
                    "optimizer": {"iterations": 4},
                    "tessellation": [4],
                    "steps": 10,
                }
            ]
        },
    )
    grid = Grid.create((32, 32))
    result = register(Image(_blobs()[0, 0], grid), Image(_blobs(shift=2.0)[0, 0], grid), cfg)
    levels = result.stages[0].levels
    assert levels[0].iterations == 4 and 0.0 <= levels[0].similarity < 2.0
    if mode == "warp_features":  # the fixed and the moving features, once each
        assert len(extracted) == 2
    else:  # the fixed features once, the warped moving image's at every evaluation
        assert len(extracted) > 4


def _itk_pair() -> tuple[torch.Tensor, torch.Tensor, Grid]:
    """The ITK T1 and proton-density slices (aligned, 1 mm), halved: the engine's normalised intensities."""
    images = [read_image(itk_example(f"Brain{name}Slice.png")) for name in ("T1", "ProtonDensity")]
    halves = [build_pyramid(image.data.float()[None, None], image.grid, [(2, 1.0)])[0] for image in images]
    return rescale_intensities(halves[0][0]), rescale_intensities(halves[1][0]), halves[0][1]


def test_minimal_at_the_true_alignment_of_a_multimodal_pair():
    """T1 against proton density: the true alignment scores best among shifts of 2 and 4 mm along each axis."""
    fixed, moving, grid = _itk_pair()
    sim = FeatureSimilarity("warp_features")
    points = grid.world_points()

    def loss(dx: float, dy: float) -> float:
        with torch.no_grad():
            return float(sim.loss_at_points(fixed, moving[0], grid, points + torch.tensor([dx, dy])))

    aligned = loss(0.0, 0.0)
    for d in (2.0, 4.0):
        for dx, dy in ((d, 0.0), (-d, 0.0), (0.0, d), (0.0, -d)):
            assert aligned < loss(dx, dy), (dx, dy)
    warped = sample_image(moving[0], grid, points + torch.tensor([4.0, 0.0]))[None]
    assert float(FeatureSimilarity()(fixed, warped)) > aligned
