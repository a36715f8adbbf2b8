"""regkit.registration.modality and the CPAB stage's choice of similarity for multi-modal pairs."""

from __future__ import annotations

import torch

from regkit.io import Image
from regkit.registration import register
from regkit.registration.modality import linearity
from tests.regkit.registration.cases import cpab_stage, cpu_config


def _other_contrast(image: Image) -> Image:
    """A non-monotone remap of the intensities (dark tissue bright, bright tissue dark, background dark): another
    contrast, as T2 is to T1."""
    x = image.data / image.data.max()
    return Image(torch.where(x > 0.05, 1.0 - 0.9 * torch.sin(torch.pi * x) ** 2, x), image.grid)


def test_linearity_is_one_for_gain_and_offset_and_low_for_another_contrast(brain2d: Image) -> None:
    x = (brain2d.data / brain2d.data.max()).flatten()
    tissue = x > 0.05
    assert linearity(x, 0.5 * x + 0.2) > 0.99
    assert linearity(x, 1.0 - x) > 0.99  # an inverted contrast is still linear
    assert linearity(x[tissue], _other_contrast(brain2d).data.flatten()[tissue]) < 0.5
    assert linearity(x, torch.full_like(x, 0.3)) == 1.0


def test_cpab_stage_uses_its_multimodal_similarity_on_a_multimodal_pair(brain2d: Image) -> None:
    stage = {**cpab_stage(4, [2]), "similarity": {"name": "lncc"}, "multimodal": {"name": "mi"}}
    config = cpu_config(stage, dim=2)
    multi = register(brain2d, _other_contrast(brain2d), config)
    (report,) = multi.stages
    assert report.similarity == "mi" and report.note is not None
    assert report.note.startswith("multi-modal pair detected: r^2/eta^2 = ")
    assert report.note.endswith("the stage uses mi instead of lncc")
    assert report.to_dict()["note"] == report.note
    same = register(brain2d, Image(2.0 * brain2d.data + 1.0, brain2d.grid), config)
    assert same.stages[0].similarity == "lncc" and same.stages[0].note is not None
    assert same.stages[0].note.startswith("same-contrast pair: r^2/eta^2 = 1.00")
    plain = register(brain2d, brain2d, cpu_config(cpab_stage(4, [2]), dim=2))
    assert plain.stages[0].note is None and plain.stages[0].similarity == "ncc"
