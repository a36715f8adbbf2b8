"""The similarity registry: names, build_similarity's errors, measures added at run time, and the configuration's
similarity union generated from it."""

import inspect
import typing

import pytest
import torch

from regkit.config import AnySimilarity, FeaturesSimilarity
from regkit.errors import ConfigError
from regkit.similarity import (
    FEATURE_DISTANCES,
    FEATURE_MODES,
    SIMILARITIES,
    Measure,
    MseSimilarity,
    build_similarity,
    register_similarity,
)
from regkit.similarity.base import Similarity
from tests.regkit.similarity.cases import NAMES, masked_brain_in_float64_and_float32


class L1(Similarity):
    """A measure added at run time (:func:`test_registry_is_open_for_new_measures`)."""

    def weighted_loss(self, fixed, warped, weights):
        return ((fixed - warped).abs() * weights).sum() / weights.sum() / fixed.shape[1]


def test_registry_names_and_errors():
    assert set(NAMES) <= set(SIMILARITIES)
    for name in NAMES:
        assert isinstance(build_similarity(name), SIMILARITIES[name].measure_class())
    with pytest.raises(ConfigError, match="did you mean 'lncc'"):
        build_similarity("lnc")
    with pytest.raises(ConfigError, match="did you mean 'window'"):
        build_similarity("lncc", windw=5)
    with pytest.raises(ConfigError, match="odd"):
        build_similarity("lncc", window=4)
    with pytest.raises(ConfigError, match="bins"):
        build_similarity("mi", bins=2)
    with pytest.raises(ConfigError, match="percentiles"):
        build_similarity("mi", percentiles=(90, 10))
    assert build_similarity("lncc", window=[3, 5, 7]).window == [3, 5, 7]
    assert build_similarity("mi", bins=16).bins == 16


def test_registry_is_open_for_new_measures():
    register_similarity("test_l1", Measure(MseSimilarity, __name__, "L1"))
    try:
        sim = build_similarity("test_l1")
        assert type(sim) is L1
        assert float(sim(torch.zeros(1, 1, 3, 3), torch.ones(1, 1, 3, 3))) == pytest.approx(1.0)
        with pytest.raises(ValueError, match="already registered"):
            register_similarity("test_l1", SIMILARITIES["test_l1"])
    finally:
        del SIMILARITIES["test_l1"]


def test_the_configuration_union_is_generated_from_the_registry():
    """The configuration's similarity union is the registry's options models, in its order; every option is a
    parameter of the measure class (what the engine builds from a stage); the features options declare the modes and
    distances the similarity takes."""
    members = typing.get_args(typing.get_args(AnySimilarity)[0])
    assert members == tuple(measure.options for measure in SIMILARITIES.values())
    assert [model.model_fields["name"].default for model in members] == list(SIMILARITIES)
    for measure in SIMILARITIES.values():
        parameters = inspect.signature(measure.measure_class().__init__).parameters
        assert set(measure.options.model_fields) - {"name"} <= set(parameters), measure.class_name
    fields = FeaturesSimilarity.model_fields
    assert typing.get_args(fields["mode"].annotation) == FEATURE_MODES
    assert typing.get_args(fields["distance"].annotation) == FEATURE_DISTANCES


@pytest.mark.parametrize("name", sorted(SIMILARITIES))
def test_every_measure_takes_a_brain_mask_in_float32(name):
    """An axial slice of the bundled MNI152 brain under its own brain mask: every registered measure gives a finite
    loss and gradient in float32 that agree with float64."""
    (loss64, grad64), (loss32, grad32) = masked_brain_in_float64_and_float32(build_similarity(name), 2)
    assert torch.isfinite(loss32) and torch.isfinite(grad32).all()
    assert abs(float(loss32 - loss64)) < 1e-4 * max(1.0, abs(float(loss64)))
    assert (grad32 - grad64).abs().max() < 1e-3 * grad64.abs().max()
