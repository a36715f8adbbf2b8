"""GPU check: the feature network's loss gradients with fused WTConv kernels vs reference layers, fp32 and bf16.

Run on a CUDA machine from the repository root, with the label map that ``bash benchmarks/scripts/h200.sh prepare``
writes: ``PYTHONPATH=.:kernels:apps python benchmarks/scripts/features_netgrad.py``. Prints the losses of each backend
and precision, and the relative error and cosine of every parameter gradient against the reference layers in fp32
(fused fp32 agrees to about 1e-4, bf16 autocast to about 2e-2).
"""

import torch

from regkit.features.training.recipe import load_training_config
from regkit.features.training.synth import brain_label_volume
from regkit.features.training.train import Trainer

for dim in (2, 3):
    cfg = load_training_config(f"features-{dim}d")
    vol = brain_label_volume(cfg.synthesis.source_spacing, ".h200/data/brain_labels.nii.gz")
    grads = {}
    for backend in ("triton", "reference"):
        for amp in (False, True):
            tr = Trainer(cfg.model_copy(update={"mixed_precision": amp}), vol, device="cuda", backend=backend)
            pair, gen = tr.batch(3)
            tr.network.train()
            losses = tr.loss(pair, torch.Generator("cuda").manual_seed(0))
            sum(losses).backward()
            grads[(backend, amp)] = torch.cat([p.grad.flatten() for p in tr.network.parameters() if p.grad is not None])
            print(dim, backend, "bf16" if amp else "fp32", [round(float(v), 4) for v in losses], flush=True)
    ref = grads[("reference", False)]
    for key, g in grads.items():
        print(
            dim,
            key,
            "rel err vs reference fp32",
            float((g - ref).norm() / ref.norm()),
            "cos",
            float(torch.nn.functional.cosine_similarity(g, ref, dim=0)),
        )
