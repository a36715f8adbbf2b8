"""regkit: image registration with fine-tessellation CPAB transformations.

Conventions used throughout the package:

* World coordinates are LPS millimetres, as in ITK (x grows to the patient's Left, y to Posterior, z to Superior).
* Image tensors are stored in ITK index order reversed, i.e. ``array[z, y, x]`` (numpy/SimpleITK convention), while
  index and world *points* are given in (x, y, z) order.
* Transformations map a fixed-space world point to the moving-space point where the moving image is sampled
  (pull-back, as ITK's registration transforms).

The main entry points are available at the top level and imported on first use, so that ``import regkit`` (and the
CLI's ``--help``) stays light::

    import regkit
    fixed, moving = regkit.read_image("fixed.nii.gz"), regkit.read_image("moving.nii.gz")
    result = regkit.register(fixed, moving, regkit.load_config("brain-mri-3d"))
    regkit.write_outputs(result, "out/")

Importing regkit sets ``OMP_WAIT_POLICY=PASSIVE`` (if torch is not imported yet) and the folder of numba's kernel
cache, where the user has not set them; ``register`` tunes the allocator on its first call. ``regkit.process`` says
why and how to opt out (``REGKIT_PROCESS_SETTINGS=0``).
"""

import importlib
from importlib.metadata import PackageNotFoundError, version

from regkit import process
from regkit.errors import (
    ConfigError,
    GeometryError,
    ImageDimensionError,
    ImageReadError,
    ImageValueError,
    ImageWriteError,
    RegkitError,
)

process.set_wait_policy()
process.configure_caches()

# Top-level name -> the module that defines it (imported lazily by __getattr__).
_LAZY = {
    "register": "regkit.registration.engine",
    "read_image": "regkit.io.files",
    "write_image": "regkit.io.files",
    "Image": "regkit.io.image",
    "load_config": "regkit.config",
    "write_outputs": "regkit.results.folder",
    "Transformation": "regkit.transform",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'regkit' has no attribute {name!r}")


try:
    __version__ = version("regkit")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "ConfigError",
    "GeometryError",
    "Image",
    "ImageDimensionError",
    "ImageReadError",
    "ImageValueError",
    "ImageWriteError",
    "RegkitError",
    "Transformation",
    "__version__",
    "load_config",
    "read_image",
    "register",
    "write_image",
    "write_outputs",
]
