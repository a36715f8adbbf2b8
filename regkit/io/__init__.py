"""Images in physical space: reading, writing, geometry, and transformations in other tools' conventions.

Conventions (those of ITK): world points in LPS millimetres, ``world = origin + direction @ (spacing * index)`` with
index (i, j[, k]); image tensors in ``[z, y, x]`` (3D) or ``[y, x]`` (2D) layout; transformations pull back (they map
a fixed-space point to the moving-space point that is sampled).

Where each part lives:

* :mod:`regkit.io.image`: :class:`Image`, a tensor with its :class:`~regkit.spatial.Grid`;
* :mod:`regkit.io.files`: :func:`read_image`, :func:`read_image_nibabel`, :func:`write_image` (NIfTI, MetaImage, NRRD,
  PNG, DICOM series; what each format keeps);
* :mod:`regkit.io.preflight`: the checks made before a native reader opens a file (name, kind of file, voxel files
  named by headers, declared size against memory);
* :mod:`regkit.io.orientation`: header geometry (NIfTI sform/qform by ITK's rules), :func:`orientation_code`,
  :func:`reorient`;
* :mod:`regkit.io.describe`: :func:`describe_image`;
* :mod:`regkit.io.inputs`: :func:`read_registration_inputs`, :func:`as_label_map`;
* :mod:`regkit.io.transforms`: ITK/ANTs displacement fields and transform files, Learn2Reg displacements.
"""

from regkit.io.describe import describe_image
from regkit.io.files import SUPPORTED_EXTENSIONS, format_of, read_image, read_image_nibabel, write_image
from regkit.io.image import Image
from regkit.io.inputs import RegistrationInputs, as_label_map, read_registration_inputs
from regkit.io.orientation import orientation_code, reorient
from regkit.io.transforms import (
    apply_itk_transform,
    learn2reg_displacement,
    write_displacement,
    write_learn2reg,
    write_transform_h5,
)

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "Image",
    "RegistrationInputs",
    "apply_itk_transform",
    "as_label_map",
    "describe_image",
    "format_of",
    "learn2reg_displacement",
    "orientation_code",
    "read_image",
    "read_image_nibabel",
    "read_registration_inputs",
    "reorient",
    "write_displacement",
    "write_image",
    "write_learn2reg",
    "write_transform_h5",
]
