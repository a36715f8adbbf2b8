"""One case of `python -m benchmarks features --part 3d` alone, for the similarities given: the benchmark's own pair
generator and registration configuration (``benchmarks.features``), with the classical measures in the same process,
on any machine (a 3D features registration takes minutes to half an hour on a CPU). From the repository root::

    PYTHONPATH=. python benchmarks/scripts/features_case.py --kind synth --case 1 \
        --labels .h200/data/brain_labels.nii.gz --features "distance=lncc,lncc_weight=4" --threads 1

``--case`` is 0-based (the bench's second case is 1). Prints one Dice per similarity (mean over the AAL labels, as the
bench computes it) and its registration time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks import features as bench
from regkit.registration import register
from regkit.spatial.metrics import mean_dice


def _features_options(text: str) -> dict[str, object]:
    """``"distance=lncc,lncc_weight=4"`` -> the features similarity's extra options (numbers as floats)."""
    options: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        options[key] = value if key in ("distance", "mode") else float(value)
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("same", "inverted", "synth"), required=True)
    parser.add_argument("--case", type=int, required=True, help="0-based case index, as the bench's seeds")
    parser.add_argument("--labels", type=Path, default=None, help="brain label map, as the bench's --labels")
    parser.add_argument("--features", default="", help="features options, e.g. distance=lncc,lncc_weight=4")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = [p for p in bench.pairs_3d(args.case + 1, False, args.labels) if p[0] == args.kind]
    _, fixed, moving, fixed_labels, moving_labels = pairs[args.case]
    print(f"{args.kind} case {args.case}: before {mean_dice(fixed_labels.data, moving_labels.data):.3f}", flush=True)
    features = {**bench.similarity_spec("features", None, "warp_image"), **_features_options(args.features)}
    columns = [("mi", bench.similarity_spec("mi", None, "")), ("lncc", bench.similarity_spec("lncc", None, ""))]
    for name, similarity in [*columns, (f"features {args.features}".strip(), features)]:
        start = time.perf_counter()
        result = register(fixed, moving, bench.registration_config(3, similarity, False), device=args.device)
        dice = mean_dice(fixed_labels.data, result.warp(moving_labels, mode="nearest").data)
        print(f"{name}: Dice {dice:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
