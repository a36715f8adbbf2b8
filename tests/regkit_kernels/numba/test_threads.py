"""The numba kernels' threads: they follow torch's thread count and leave it as the user set it."""

import subprocess
import sys


def test_a_sampling_kernel_leaves_torch_threads_as_set():
    """Starting numba's OpenMP pool resets the OpenMP thread count that torch reads; the first ``prange`` kernel must
    not change what the user chose with ``torch.set_num_threads`` (a fresh process: the test session's pool already
    runs)."""
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from regkit_kernels.numba import sampling\n"
        "values = torch.rand(1, 6, 7, 8, dtype=torch.float64)\n"
        "index = torch.rand(50, 3, dtype=torch.float64) * 5\n"
        "sampling.linear(values, index)\n"
        "assert torch.get_num_threads() == 1, torch.get_num_threads()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
