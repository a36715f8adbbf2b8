"""numba kernels for the CPU (they depend on torch and numba), one module per op:

- ``cpab``: the expm-step CPAB integration and its factorized adjoint (``cpab_integrate``)
- ``filters``: box sums and separable (Gaussian) filters (``box_sums``, ``separable``)
- ``lncc``: the squared local NCC map and its closed-form gradient (``local_cc2``, ``local_cc2_backward``)
- ``mi``: the Parzen joint histogram of mutual information and its adjoint (``joint_histogram``, ...)
- ``sampling``: linear interpolation at voxel indices (``linear``)

and two that they and regkit share:

- ``threads``: how the kernels run in parallel, with as many threads as torch uses (``parallel_for``)
- ``compiles``: the first-use notice of numba's compiles (``announce``)

This package imports nothing itself: regkit reaches each module through ``regkit._backend.load_kernels``, which
raises a clear error where numba is missing.
"""
