"""regkit: image registration with fine-tessellation CPAB transformations.

Conventions used throughout the package:

* World coordinates are LPS millimetres, as in ITK (x grows to the patient's Left, y to Posterior, z to Superior).
* Image tensors are stored in ITK index order reversed, i.e. ``array[z, y, x]`` (numpy/SimpleITK convention), while
  index and world *points* are given in (x, y, z) order.
"""

from importlib.metadata import PackageNotFoundError, version

from regkit.errors import (
    ConfigError,
    GeometryError,
    ImageDimensionError,
    ImageReadError,
    ImageValueError,
    ImageWriteError,
    RegkitError,
)

try:
    __version__ = version("regkit")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "ConfigError",
    "GeometryError",
    "ImageDimensionError",
    "ImageReadError",
    "ImageValueError",
    "ImageWriteError",
    "RegkitError",
    "__version__",
]
