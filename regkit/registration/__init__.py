"""Registration: :func:`register` runs a configuration's stages on a fixed and a moving image.

Conventions: world points in LPS millimetres, image tensors ``[z, y, x]``, and the result's transformation pulls back
(it maps a fixed world point to the moving world point that is sampled).

Where each part lives:

* :mod:`regkit.registration.engine`: :func:`register` (the loop over the stages), :func:`check_image_size`,
  :func:`resolve_device`;
* :mod:`regkit.registration.stages`: the rigid/affine and CPAB stages (:func:`run_linear`, :func:`run_cpab`), the CPAB
  stage's whitened parameters (:class:`Unwhiten`, :func:`coherence`);
* :mod:`regkit.registration.levels`: a stage's pyramid levels (:class:`Level`), what one run shares
  (:class:`RunContext`) and the optimizer loop of one level (:func:`optimize_level`);
* :mod:`regkit.registration.steps`: one optimizer iteration, eager or replayed from a CUDA graph (:class:`Adam`,
  :class:`GraphedSteps`, :func:`eager_step`);
* :mod:`regkit.registration.progress`: what a running registration reports (:class:`Progress`) and raises when asked
  to stop (:class:`Cancelled`);
* :mod:`regkit.registration.result`: :class:`RegistrationResult`, :class:`StageReport`, :class:`LevelReport` (the
  records of ``metrics.json``'s ``runtime.stages``).
"""

from regkit.registration.engine import check_image_size, register, resolve_device
from regkit.registration.progress import Cancelled, Progress
from regkit.registration.result import LevelReport, RegistrationResult, StageReport

__all__ = [
    "Cancelled",
    "LevelReport",
    "Progress",
    "RegistrationResult",
    "StageReport",
    "check_image_size",
    "register",
    "resolve_device",
]
