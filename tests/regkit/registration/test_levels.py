"""regkit.registration.levels: what one run shares (``RunContext``): the pyramids of the stages."""

from __future__ import annotations

import torch

from regkit.io import Image
from tests.regkit.registration.cases import cpab_stage, cpu_config, linear_stage


def test_stages_with_one_pyramid_share_its_levels(brain2d: Image) -> None:
    from regkit.registration.levels import RunContext

    config = cpu_config(linear_stage("affine", [2, 2]), cpab_stage(2, [2, 2]), dim=2)
    ctx = RunContext(brain2d, brain2d, config, None, None, torch.device("cpu"), None, None, None)
    assert ctx.levels(config.stages[0]) is ctx.levels(config.stages[1])
