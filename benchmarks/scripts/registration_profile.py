"""Where one GPU registration spends its time: torch.profiler over register() on the 2 mm and 1 mm demo pairs.

Run on a CUDA machine from the repository root:
``PYTHONPATH=.:kernels:apps python benchmarks/scripts/registration_profile.py 2mm 1mm`` (``CONFIG`` names the
configuration, default ``demo``; 1mm reads nilearn's 1 mm
template, from ``$MNI_DATA`` if set: the folder that ``bash benchmarks/scripts/h200.sh prepare`` fills). Prints the
stage times and two profiler tables (by host and by GPU time).
"""

import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.registration import brain_pair
from regkit.config import load_config
from regkit.registration import register

mni_data = Path(os.environ["MNI_DATA"]) if os.environ.get("MNI_DATA") else None
for size in sys.argv[1:] or ["2mm", "1mm"]:
    pair = brain_pair(size, mni_data)
    cfg = load_config(os.environ.get("CONFIG", "demo"))
    register(pair.fixed, pair.moving, cfg, device="cuda")  # warm-up (compiles)
    torch.cuda.synchronize()
    t = time.perf_counter()
    result = register(pair.fixed, pair.moving, cfg, device="cuda")
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    iters = [(s.kind, round(s.seconds, 3), [lv.iterations for lv in s.levels]) for s in result.stages]
    print(f"== {size}: register {wall:.3f} s; stages {iters}", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        register(pair.fixed, pair.moving, cfg, device="cuda")
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=60)
    print(table, flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
