"""Runners of ``python -m benchmarks accuracy``: one registration tool on one pair, inside the tool's own environment.

This file is run as a script by each tool's interpreter (``python accuracy_runners.py SPEC.json``, or ``python
accuracy_runners.py --probe TOOL``), so at module level it imports the standard library only; each runner imports
numpy, SimpleITK and its tool inside. It never imports regkit except in the regkit runner, which runs in regkit's
environment.

The spec (JSON) names the tool, the pair's files (``fixed``, ``moving``, ``moving_labels``: MetaImage, LPS geometry),
the output folder ``out``, ``modality`` (``mono`` / ``multi``), ``threads``, ``device``, ``seed``, ``warmup`` and, for
regkit, ``config``. Every runner writes into ``out``:

* ``displacement.mha``: the tool's transformation as an ITK displacement field on the FIXED grid: vector image,
  components (x, y[, z]) in LPS millimetres, pull-back ``x_moving = x_fixed + u(x_fixed)`` (what ITK's
  ``TransformToDisplacementField``, elastix's ``transformix`` deformation field, ANTs' warp files and regkit's
  ``displacement.nii.gz`` hold);
* ``warped_labels.mha``: the moving labels resampled by the tool itself (nearest neighbour), a cross-check of the field;
* ``result.json``: ``seconds`` (the registration call alone), ``gpu_peak_bytes`` (torch tools on CUDA, else null),
  ``peak_rss_bytes`` (the process's peak resident set, ``VmHWM``, read at the end), ``version`` and ``settings`` (the
  pipeline in words). ``VmHWM`` belongs to the memory map that ``exec`` created, so it counts this program alone;
  the parent's ``ru_maxrss`` of a child would not: Linux starts it at the parent's resident set at ``fork``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

# tool -> (module to import for the probe, distribution whose version is reported)
TOOLS: dict[str, tuple[str, str]] = {
    "regkit": ("regkit", "regkit"),
    "regkit-lncc": ("regkit", "regkit"),
    "regkit-mi": ("regkit", "regkit"),
    "regkit-features": ("regkit", "regkit"),
    "ants": ("ants", "antspyx"),
    "elastix": ("itk", "itk-elastix"),
    "sitk": ("SimpleITK", "SimpleITK"),
    "fireants": ("fireants", "fireants"),
}


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def probe(tool: str) -> dict[str, str]:
    """Import the tool (and check what it needs); ``{"version"}``. Raises ImportError / RuntimeError if unusable."""
    module, distribution = TOOLS[tool]
    __import__(module)
    if tool == "elastix":
        import itk

        itk.ParameterObject.New()  # the elastix module loads lazily: fail here, not mid-run
    if tool == "regkit-features":
        from regkit.similarity import SIMILARITIES

        if "features" not in SIMILARITIES:
            raise RuntimeError("regkit.similarity has no 'features' measure yet")
    return {"version": _version(distribution)}


# ---- SimpleITK helpers (every environment here has SimpleITK) -----------------------------------------------------


def _sitk_read(path: str, float_pixels: bool = True) -> Any:
    import SimpleITK as sitk

    return sitk.ReadImage(path, sitk.sitkFloat32) if float_pixels else sitk.ReadImage(path)


def _field_of(transform: Any, fixed: Any) -> Any:
    """The displacement field of an ITK/SimpleITK transform (pull-back, LPS mm) on the grid of the image ``fixed``."""
    import SimpleITK as sitk

    to_field = sitk.TransformToDisplacementFieldFilter()
    to_field.SetReferenceImage(fixed)
    to_field.SetOutputPixelType(sitk.sitkVectorFloat64)
    return to_field.Execute(transform)


def _voxel_world(image: Any) -> Any:
    """LPS world points of every voxel centre of a SimpleITK image: ``(*array shape, n)`` float64, (x, y[, z])."""
    import numpy as np

    n = image.GetDimension()
    axes = [np.arange(size, dtype=np.float64) for size in reversed(image.GetSize())]
    index = np.stack(np.meshgrid(*axes, indexing="ij")[::-1], axis=-1)  # (i, j[, k]) per voxel
    matrix = np.asarray(image.GetDirection()).reshape(n, n) * np.asarray(image.GetSpacing())
    return index @ matrix.T + np.asarray(image.GetOrigin())


def _write_field(field: Any, out: Path) -> None:
    import SimpleITK as sitk

    sitk.WriteImage(sitk.Cast(field, sitk.sitkVectorFloat32), str(out / "displacement.mha"), True)


def _resample_labels(labels: Any, fixed: Any, transform: Any) -> Any:
    import SimpleITK as sitk

    return sitk.Resample(labels, fixed, transform, sitk.sitkNearestNeighbor, 0, labels.GetPixelID())


# ---- the tools -----------------------------------------------------------------------------------------------------


def _run_ants(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """ANTsPy ``registration(type_of_transform="SyN")`` with every default (affine + SyN, Mattes MI both)."""
    import ants
    import SimpleITK as sitk

    fixed = ants.image_read(spec["fixed"])
    moving = ants.image_read(spec["moving"])
    start = time.perf_counter()
    reg = ants.registration(
        fixed, moving, type_of_transform="SyN", outprefix=str(out / "ants_"), write_composite_transform=True
    )
    seconds = time.perf_counter() - start
    composite = reg["fwdtransforms"]  # one file: <prefix>Composite.h5 (fixed -> moving, as ITK evaluates it)
    _write_field(_field_of(sitk.ReadTransform(composite), _sitk_read(spec["fixed"])), out)
    labels = ants.apply_transforms(
        fixed, ants.image_read(spec["moving_labels"]), composite, interpolator="nearestNeighbor"
    )
    ants.image_write(labels, str(out / "warped_labels.mha"))
    return {"seconds": seconds, "settings": "ants.registration(type_of_transform='SyN'), all defaults"}


def _run_elastix(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """ITK-elastix with its default rigid, affine and B-spline parameter maps, run in that order."""
    import itk
    import numpy as np
    import SimpleITK as sitk

    fixed = itk.imread(spec["fixed"], itk.F)
    moving = itk.imread(spec["moving"], itk.F)
    parameters = itk.ParameterObject.New()
    for name in ("rigid", "affine", "bspline"):
        parameters.AddParameterMap(parameters.GetDefaultParameterMap(name))
    # Threads come from ITK_GLOBAL_DEFAULT_NUMBER_OF_THREADS: number_of_threads > 1 crashes the B-spline map's
    # multi-metric registration (ITKElastix issue 160).
    start = time.perf_counter()
    _, result = itk.elastix_registration_method(fixed, moving, parameter_object=parameters, log_to_console=False)
    seconds = time.perf_counter() - start
    field = itk.transformix_deformation_field(moving, result)  # T(x) - x on the fixed grid, LPS mm
    image = sitk.GetImageFromArray(np.asarray(itk.array_from_image(field), dtype=np.float64), isVector=True)
    image.CopyInformation(_sitk_read(spec["fixed"]))
    # elastix's own resampling of the labels: nearest neighbour (B-spline order 0) in every map
    for index in range(result.GetNumberOfParameterMaps()):
        result.SetParameter(index, "FinalBSplineInterpolationOrder", "0")
        result.SetParameter(index, "ResultImagePixelType", "float")
    labels = itk.imread(spec["moving_labels"], itk.F)
    warped = itk.transformix_filter(labels, result)
    _write_field(image, out)
    itk.imwrite(warped.astype(itk.SS), str(out / "warped_labels.mha"))
    return {"seconds": seconds, "settings": "elastix default parameter maps: rigid, affine, bspline"}


def _run_sitk(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """SimpleITK: moments-initialised affine (Mattes MI, 25 % random samples, regular-step gradient descent; the
    notebooks' estimated-learning-rate descent moved an identity pair by 5 mm), then the multi-resolution B-spline
    of SimpleITK's example ImageRegistrationMethodBSpline3 (mesh 2 per axis refined x1, x2, x5; joint-histogram MI;
    line-search gradient descent, 100 iterations; shrink 4, 2, 1; smoothing 4, 2, 1 mm; 5 % random samples)."""
    import SimpleITK as sitk

    fixed = _sitk_read(spec["fixed"])
    moving = _sitk_read(spec["moving"])
    dim = fixed.GetDimension()
    sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(spec["threads"])
    start = time.perf_counter()

    initial = sitk.CenteredTransformInitializer(
        fixed, moving, sitk.AffineTransform(dim), sitk.CenteredTransformInitializerFilter.MOMENTS
    )
    linear = sitk.ImageRegistrationMethod()
    linear.SetMetricAsMattesMutualInformation(50)
    linear.SetMetricSamplingStrategy(linear.RANDOM)
    linear.SetMetricSamplingPercentage(0.25, spec["seed"])
    linear.SetInterpolator(sitk.sitkLinear)
    linear.SetOptimizerAsRegularStepGradientDescent(1.0, 1e-3, 200, relaxationFactor=0.5)
    linear.SetOptimizerScalesFromPhysicalShift()
    linear.SetShrinkFactorsPerLevel([4, 2, 1])
    linear.SetSmoothingSigmasPerLevel([2, 1, 0])
    linear.SetInitialTransform(initial, inPlace=True)
    linear.Execute(fixed, moving)

    bspline = sitk.BSplineTransformInitializer(fixed, [2] * dim)
    deformable = sitk.ImageRegistrationMethod()
    deformable.SetMetricAsJointHistogramMutualInformation()
    deformable.SetMetricSamplingStrategy(deformable.RANDOM)  # all voxels: over 10 minutes for one 2 mm pair
    deformable.SetMetricSamplingPercentage(0.05, spec["seed"])
    deformable.SetOptimizerAsGradientDescentLineSearch(5.0, 100, convergenceMinimumValue=1e-4, convergenceWindowSize=5)
    deformable.SetInterpolator(sitk.sitkLinear)
    deformable.SetMovingInitialTransform(initial)
    deformable.SetInitialTransformAsBSpline(bspline, inPlace=True, scaleFactors=[1, 2, 5])
    deformable.SetShrinkFactorsPerLevel([4, 2, 1])
    deformable.SetSmoothingSigmasPerLevel([4, 2, 1])
    deformable.Execute(fixed, moving)
    seconds = time.perf_counter() - start

    transform = sitk.CompositeTransform([initial, bspline])  # ITK applies the last one first: affine(bspline(x))
    _write_field(_field_of(transform, fixed), out)
    labels = _sitk_read(spec["moving_labels"], float_pixels=False)
    sitk.WriteImage(_resample_labels(labels, fixed, transform), str(out / "warped_labels.mha"), True)
    return {"seconds": seconds, "settings": "moments + affine (Mattes MI), then B-spline (SimpleITK BSpline3 example)"}


def _run_fireants(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """FireANTs with the settings of its brain-MRI evaluation scripts: affine (scales 8, 4, 2, 1; 100, 50, 25, 20
    iterations; Adam, lr 3e-4) then greedy compositive (scales 4, 2, 1; 200, 100, 25 iterations; Adam, lr 0.5;
    gradient smoothing 1); local CC (kernel 5) for same-contrast pairs, MI otherwise."""
    import SimpleITK as sitk
    import torch
    from fireants.io import BatchedImages, Image
    from fireants.registration.affine import AffineRegistration
    from fireants.registration.greedy import GreedyRegistration

    device = spec["device"]
    torch.set_num_threads(spec["threads"])
    loss = "cc" if spec["modality"] == "mono" else "mi"

    fixed = BatchedImages([Image.load_file(spec["fixed"], device=device)])
    moving = BatchedImages([Image.load_file(spec["moving"], device=device)])

    def register() -> Any:
        affine = AffineRegistration(
            [8, 4, 2, 1], [100, 50, 25, 20], fixed, moving, loss_type=loss, optimizer="Adam", optimizer_lr=3e-4,
            cc_kernel_size=5,
        )  # fmt: skip
        affine.optimize()
        greedy = GreedyRegistration(
            scales=[4, 2, 1], iterations=[200, 100, 25], fixed_images=fixed, moving_images=moving, loss_type=loss,
            cc_kernel_size=5, deformation_type="compositive", smooth_grad_sigma=1, optimizer="adam",
            optimizer_lr=0.5, init_affine=affine.get_affine_matrix().detach(),
        )  # fmt: skip
        greedy.optimize()
        return greedy

    cuda = device.startswith("cuda")
    if spec.get("warmup") and cuda:
        register()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    greedy = register()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else None
    # FireANTs' own export (save_as_ants_transforms) writes 2D fields as 3D scalar images; the field is taken from
    # its sampling coordinates instead: normalised moving-grid coordinates (x first) -> moving world points.
    with torch.no_grad():
        coords = greedy.get_warped_coordinates(fixed, moving)[0].double()
        to_world = moving.get_torch2phy()[0].double()
        n = coords.shape[-1]
        mapped = (coords @ to_world[:n, :n].T + to_world[:n, n]).cpu().numpy()
    reference = _sitk_read(spec["fixed"])
    field = sitk.GetImageFromArray(mapped - _voxel_world(reference), isVector=True)
    field.CopyInformation(reference)
    _write_field(field, out)
    transform = sitk.DisplacementFieldTransform(sitk.Image(field))
    labels = _sitk_read(spec["moving_labels"], float_pixels=False)
    sitk.WriteImage(_resample_labels(labels, reference, transform), str(out / "warped_labels.mha"), True)
    return {"seconds": seconds, "gpu_peak_bytes": peak, "settings": f"affine + greedy, {loss} (brain script settings)"}


def _import_cpu_kernels() -> list[str]:
    """Import regkit's compiled CPU kernels, the numba modules of ``regkit_kernels`` (none where numba or the kernels
    are missing), and return their names. The first call of each kernel still loads or compiles it."""
    import importlib
    import pkgutil

    try:
        import regkit_kernels
    except ImportError:
        return []
    names = []  # the modules of the package regkit_kernels.numba, or modules named *_numba
    for module in pkgutil.iter_modules(regkit_kernels.__path__):
        if module.name == "numba" and module.ispkg:
            folder = [str(Path(regkit_kernels.__path__[0]) / "numba")]
            names += [f"numba.{m.name}" for m in pkgutil.iter_modules(folder) if not m.name.startswith("_")]
        elif module.name.endswith("_numba") and not module.name.startswith("_"):
            names.append(module.name)
    imported = []
    for name in names:
        try:
            importlib.import_module(f"regkit_kernels.{name}")
        except ImportError:
            continue
        imported.append(name)
    return imported


def _run_regkit(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """regkit ``register`` with the configuration ``spec["config"]`` (a preset name or a YAML file; None: the default
    configuration, as ``regkit.register`` chooses it), in a process set up as the ``regkit`` command sets up its
    own."""
    from regkit.process import configure_process

    configure_process()
    import torch

    from regkit.config import load_config
    from regkit.io import read_image, write_displacement, write_image
    from regkit.registration import register

    torch.set_num_threads(spec["threads"])
    _import_cpu_kernels()  # module imports before the timer, as `import ants` comes before ANTs' (first calls: inside)
    fixed = read_image(spec["fixed"])
    moving = read_image(spec["moving"])
    config = load_config(spec["config"]) if spec["config"] is not None else None
    cuda = spec["device"].startswith("cuda")
    if spec.get("warmup") and cuda:
        register(fixed, moving, config, device=spec["device"])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = register(fixed, moving, config, device=spec["device"])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    write_displacement(result.transform.displacement(device=result.device).cpu(), fixed.grid, out / "displacement.mha")
    write_image(result.warp(read_image(spec["moving_labels"]), mode="nearest"), out / "warped_labels.mha")
    det = result.transform.jacobian_determinant(device=result.device)
    return {
        "seconds": seconds,
        "gpu_peak_bytes": result.peak_memory_bytes,
        "settings": f"config {spec['config'] or 'default'}",
        "analytic_min_jacobian": float(det.min()),
    }


RUNNERS = {
    "regkit": _run_regkit,
    "regkit-lncc": _run_regkit,
    "regkit-mi": _run_regkit,
    "regkit-features": _run_regkit,
    "ants": _run_ants,
    "elastix": _run_elastix,
    "sitk": _run_sitk,
    "fireants": _run_fireants,
}


def _peak_rss_bytes() -> int | None:
    """``VmHWM`` of this process (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec["tool"]`` on the spec's pair; writes the outputs (module docstring) and returns ``result.json``."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    result = {"gpu_peak_bytes": None, **RUNNERS[spec["tool"]](spec, out), **probe(spec["tool"])}
    result["peak_rss_bytes"] = _peak_rss_bytes()
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str]) -> int:
    """``--probe TOOL``: print ``{"version"}`` as JSON (exit 1 with the reason if unusable); ``SPEC.json``: run."""
    if len(argv) == 2 and argv[0] == "--probe":
        try:
            print(json.dumps(probe(argv[1])))
        except Exception as err:  # any import or set-up failure means "not installed" to the caller
            print(f"{type(err).__name__}: {err}", file=sys.stderr)
            return 1
        return 0
    if len(argv) != 1:
        print("usage: accuracy_runners.py SPEC.json | --probe TOOL", file=sys.stderr)
        return 2
    run(json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
