#!/bin/bash
# Session 5, lead's device call: accuracy 1 mm / 2 mm (new presets), features 3D with the lncc term, registration bench
# at 2 mm (its 1 mm case needs nilearn, which the device lacks: it failed there in the session's run).
# Runs the committed tree (.s5/tree.tar = git archive HEAD), not the working copy (helpers' edits in progress).
S=$(date +%s); el() { echo "[$(( $(date +%s) - S )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wmin/*.whl >/dev/null 2>&1 || exit 1
mkdir -p /tmp/tree && tar -xf .s5/tree.tar -C /tmp/tree && ln -s $PWD/.bench_data $PWD/.features /tmp/tree/
cd /tmp/tree
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels:$PWD/apps PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader
el accuracy
timeout 270 python3 -m regkit_cli.main bench accuracy --pairs 1mm,2mm --deformations 1 \
    --tools regkit-lncc,regkit-mi,fireants --device cuda --threads 8 --fireants-python python3 \
    --mni-data .bench_data --timeout 200 --out /tmp/accuracy > $OUT/accuracy.log 2>&1
for ext in md csv; do cp /tmp/accuracy/accuracy.$ext $OUT/ 2>/dev/null; done
tail -5 $OUT/accuracy.log
el features
timeout 250 python3 -m regkit_cli.main bench features --device cuda --part 3d --cases 2 --features-lncc 0.5 \
    --features-lncc 1 --labels .features/brain_labels.nii.gz --itk-data .features -o $OUT/features.md > $OUT/features.log 2>&1
tail -12 $OUT/features.log
el registration
timeout $(( 570 - ($(date +%s) - S) )) python3 -m regkit_cli.main bench registration --device cuda --sizes 2mm \
    -o $OUT/registration.md > $OUT/registration.log 2>&1
tail -6 $OUT/registration.log
el done
