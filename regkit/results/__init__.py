"""What a registration leaves behind: the output folder, its metrics and QC picture, and resampling through a result.

Conventions: LPS millimetres, ``[z, y, x]`` tensors, pull-back transformations (``out(x) = image(T(x))``).

Where each part lives:

* :mod:`regkit.results.folder`: :data:`OUTPUT_FILES` (the one naming scheme), :func:`check_output_dir`
  and :func:`check_output_file` (what may be written: never an input, never what regkit did not write),
  :func:`write_outputs` (staged and swapped in atomically), :func:`read_moving_grid`;
* :mod:`regkit.results.metrics`: the contents of ``metrics.json`` (similarity, Dice/HD95, Jacobian, runtime, memory),
  :func:`field_of_view_overlap`;
* :mod:`regkit.results.qc`: the QC picture ``qc.png``, :func:`qc_picture`;
* :mod:`regkit.results.resampling`: :func:`resample`.

The exports in other tools' conventions (ITK, ANTs, Learn2Reg) are in :mod:`regkit.io.transforms`.
"""

from regkit.results.folder import (
    OUTPUT_FILES,
    OutputExistsError,
    check_output_dir,
    check_output_file,
    read_moving_grid,
    write_outputs,
)
from regkit.results.metrics import field_of_view_overlap
from regkit.results.qc import qc_picture
from regkit.results.resampling import resample

__all__ = [
    "OUTPUT_FILES",
    "OutputExistsError",
    "check_output_dir",
    "check_output_file",
    "field_of_view_overlap",
    "qc_picture",
    "read_moving_grid",
    "resample",
    "write_outputs",
]
