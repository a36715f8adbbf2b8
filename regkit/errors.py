"""Exception classes. Every error a user can cause is a `RegkitError` whose message is one line naming the culprit."""


class RegkitError(Exception):
    """Base class for errors caused by the user's input; the CLI prints ``str(err)`` on one line and exits 1."""


class ImageReadError(RegkitError):
    """A file or folder that cannot be read as an image (missing, unknown extension, corrupt, empty DICOM folder)."""


class ImageWriteError(RegkitError):
    """An image that cannot be written (unknown extension, missing folder, voxel type the format cannot store)."""


class ImageDimensionError(RegkitError):
    """An image with the wrong number of dimensions (e.g. 4D where 2D/3D is expected)."""


class ImageValueError(RegkitError):
    """Voxel values that cannot be used (NaN or Inf)."""


class GeometryError(RegkitError):
    """Invalid image geometry: non-positive spacing, singular or non-orthogonal direction matrix, mismatched sizes."""


class ConfigError(RegkitError):
    """An invalid configuration: YAML syntax, unknown key, wrong type or out-of-range value (names file, key, line)."""
