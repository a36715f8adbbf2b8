"""Self-supervised training of the feature network (``regkit train-features CONFIG.yaml``).

Every step synthesises a batch of view pairs with known voxel correspondence (:mod:`regkit.features.training.synth`),
computes the features of both views and minimises a symmetric InfoNCE loss over ``loss.points`` sampled voxels per
sample. The anchors are voxels ``p`` of view B inside the head whose correspondence ``c = corr(p)`` lies inside view A;
the positive of ``p`` is view A's features at ``c`` (linear interpolation, re-normalised). ``loss.negatives`` picks
the negatives:

* ``local`` (the shipped recipes): the anchors are drawn where view B has edges (its standard deviation over a
  window of 5 voxels per axis above ``loss.edge``; anywhere valid in a view without edges); the negatives of ``p``
  are view A's features at ``corr(p + d)`` for the offsets ``d`` of :func:`local_offsets` (``loss.radii``), where
  ``p + d`` is a valid voxel. This asks exactly what a registration loss needs: the true match must beat its
  neighbourhood (the chance level is ``log(1 + offsets)``; flat regions, where no features can tell neighbours
  apart, are not anchors);
* ``global``: view A's features at the other anchors' matches and at the anchors' own positions ``p``, of this sample
  and of every other sample of the batch, except those of this sample closer than ``loss.exclusion`` voxels to ``c``.
  The negatives at ``p`` and those of other samples punish features that encode the position in the crop, or
  anything else common to all images, rather than the anatomy. (This trains features that tell regions apart over the
  whole head but are smooth within a few voxels: poor registration losses, ``benchmarks/results/features-cpu.md``.)

Either way ``loss = CE(S / T, target)`` with ``S`` the cosine similarities and ``T`` the temperature, averaged with the
same the other way (view A's features at ``c`` as the queries, view B's at ``p`` and its neighbours as keys); the
full-resolution features' loss plus ``loss.half_weight`` times the half-resolution one (voxel ``p`` at half
resolution sits at ``(p - 1/2) / 2``).

Optimiser: AdamW, linear warm-up over ``warmup`` steps, then cosine decay to a tenth of the peak learning rate; bfloat16
autocast on CUDA with ``mixed_precision``. The random draws of step ``k`` come from generators seeded with
``(seed, k)`` alone, so a run resumed from a checkpoint continues exactly as it would have (on the CPU bit for bit; on
CUDA up to the non-deterministic atomics of some backward kernels).

The output folder holds ``config.yaml`` (the configuration), ``log.csv`` (one row per step), ``checkpoint.pt``
(network, optimiser and step, every ``checkpoint_every`` steps and at the end) and ``features-{dim}d.pt`` (the weights,
written with every checkpoint; :func:`regkit.features.network.load_feature_network` reads them).
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import Tensor

from regkit import _atomic
from regkit.errors import RegkitError
from regkit.features.network import FeatureMaps, FeatureNetwork, NetworkSpec, save_feature_network
from regkit.features.training.recipe import FeatureTrainingConfig, LossConfig
from regkit.features.training.synth import LabelVolume, ViewPair, brain_label_volume, crop_flow, synthesise_pair
from regkit.registration import resolve_device
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image

__all__ = [
    "CHECKPOINT_FORMAT",
    "StepReport",
    "Trainer",
    "TrainingResult",
    "check_output",
    "excluded_keys",
    "info_nce",
    "local_contrast",
    "local_offsets",
    "pair_loss",
    "train_features",
]

CHECKPOINT_FORMAT = "regkit-features-checkpoint/1"
_LOG_FIELDS = ("step", "loss", "loss_full", "loss_half", "learning_rate", "samples_per_second", "seconds")
_FINAL_LR = 0.1  # the cosine schedule ends at this fraction of the peak learning rate


@dataclass(frozen=True)
class StepReport:
    """One optimiser step, reported to the ``progress`` callback of :func:`train_features`."""

    step: int  # 1-based: steps done so far
    steps: int  # steps of the whole run
    loss: float
    loss_full: float
    loss_half: float
    learning_rate: float
    samples_per_second: float  # batch size over this step's wall time (synthesis included)
    seconds: float  # train_features: of the whole run so far (resumed runs included); Trainer.step: of this step


@dataclass(frozen=True)
class TrainingResult:
    """What :func:`train_features` produced."""

    weights: Path
    checkpoint: Path
    steps_done: int
    seconds: float
    final_loss: float


# ---- the loss ------------------------------------------------------------------------------------------------------


def info_nce(query: Tensor, keys: Tensor, excluded: Tensor, temperature: float) -> Tensor:
    """InfoNCE of unit vectors: ``query`` ``(N, C)`` against ``keys`` ``(M, C)``, ``M >= N``, where ``keys[i]`` is
    the positive of ``query[i]`` and the other keys are negatives, except where ``excluded`` ``(N, M)`` is True:
    the mean over the queries of ``-log softmax(query . keys / temperature)[i]``."""
    logits = (query @ keys.T / temperature).masked_fill(excluded, float("-inf"))
    return torch.nn.functional.cross_entropy(logits, torch.arange(query.shape[0], device=query.device))


def excluded_keys(sample: Tensor, positive: Tensor, key_sample: Tensor, key_positions: Tensor, radius: float) -> Tensor:
    """``(N, M)``: True where key ``j`` is of the same sample as query ``i`` (``sample``, ``key_sample``) and lies
    within ``radius`` of the positive's position (``positive`` ``(N, n)``, ``key_positions`` ``(M, n)``), except
    the positive itself (key ``i``)."""
    near = (sample[:, None] == key_sample[None, :]) & (torch.cdist(positive, key_positions) < radius)
    near[:, : positive.shape[0]].fill_diagonal_(False)
    return near


def _sample_features(features: Tensor, index: Tensor) -> Tensor:
    """Unit features ``(C, *S)`` interpolated at continuous voxel indices ``index`` ``(N, n)``: ``(N, C)``."""
    grid = Grid.create(tuple(reversed(features.shape[1:])))
    values = sample_image(features, grid, index.to(features.dtype)).T
    return torch.nn.functional.normalize(values, dim=1, eps=1e-6)


def _nce_both_ways(
    a: Tensor, b: Tensor, anchors: list[tuple[int, Tensor, Tensor]], scale: float, cfg: LossConfig
) -> Tensor:
    """The InfoNCE of one resolution over the batch, both ways (module docstring): the features ``b`` (view B,
    ``(B, C, *S)``) at the anchors ``p`` against ``a`` (view A) at their matches ``c``, and back, for the anchors
    ``(sample, p, c)`` of each sample (full-resolution indices; ``scale`` 1, or 2 for the half-resolution maps).
    Negatives: every key of the batch but the ones excluded by :func:`excluded_keys`."""

    def at(maps: Tensor, index: Tensor) -> Tensor:
        return _sample_features(maps, (index - (scale - 1) / 2) / scale)

    parts: dict[str, list[Tensor]] = {"b_p": [], "a_c": [], "a_p": [], "b_c": [], "id": [], "p": [], "c": []}
    for k, p, c in anchors:
        for name, value in (("b_p", at(b[k], p)), ("a_c", at(a[k], c)), ("a_p", at(a[k], p)), ("b_c", at(b[k], c))):
            parts[name].append(value)
        parts["id"].append(torch.full((p.shape[0],), k, device=p.device))
        parts["p"].append(p)
        parts["c"].append(c)
    t = {name: torch.cat(values) for name, values in parts.items()}
    ids, twice = t["id"], torch.cat((t["id"], t["id"]))
    to_a = info_nce(
        t["b_p"],
        torch.cat((t["a_c"], t["a_p"])),
        excluded_keys(ids, t["c"], twice, torch.cat((t["c"], t["p"])), cfg.exclusion),
        cfg.temperature,
    )
    to_b = info_nce(
        t["a_c"],
        torch.cat((t["b_p"], t["b_c"])),
        excluded_keys(ids, t["p"], twice, torch.cat((t["p"], t["c"])), cfg.exclusion),
        cfg.temperature,
    )
    return 0.5 * (to_a + to_b)


def local_offsets(ndim: int, radii: tuple[float, ...]) -> Tensor:
    """The offsets (voxels, (i, j[, k]) order) of the local negatives: every radius times every direction of
    ``{-1, 0, 1}^ndim`` (unit length), rounded; without duplicates and without 0. ``(K, ndim)`` float32."""
    directions = torch.tensor([d for d in itertools.product((-1, 0, 1), repeat=ndim) if any(d)], dtype=torch.float64)
    directions = directions / directions.norm(dim=1, keepdim=True)
    offsets = torch.unique(torch.cat([torch.round(r * directions) for r in radii]), dim=0)
    return offsets[offsets.abs().sum(dim=1) > 0].float()


def local_contrast(images: Tensor, radius: int = 2) -> Tensor:
    """The standard deviation of ``images`` ``(B, 1, *S)`` over a window of ``2 radius + 1`` voxels per axis (voxels
    inside the image only): ``(B, *S)``."""
    pool = (F.avg_pool2d, F.avg_pool3d)[images.dim() - 4]
    window = 2 * radius + 1

    def mean(x: Tensor) -> Tensor:
        return pool(x, window, stride=1, padding=radius, count_include_pad=False)

    m = mean(images)
    return (mean(images * images) - m * m).clamp_min(0).sqrt()[:, 0]


def _local_both_ways(
    a: Tensor, b: Tensor, anchors: list[tuple[int, Tensor, Tensor]], scale: float, pair: ViewPair, cfg: LossConfig
) -> Tensor:
    """The local InfoNCE of one resolution (module docstring), both ways: ``a``, ``b`` the features of views A and B
    ``(B, C, *S)``; ``anchors`` ``(sample, p, c)`` (full-resolution indices); ``scale`` 1, or 2 for the half maps."""
    ndim = pair.a.dim() - 2
    offsets = local_offsets(ndim, cfg.radii).to(pair.corr.device)
    size = torch.tensor(pair.a.shape[2:][::-1], device=pair.corr.device)  # (x, y[, z]) voxels
    strides = torch.cumprod(torch.cat((size.new_ones(1), size[:-1])), 0)  # of (i, j[, k]) in the flat [z, y, x] order

    def at(maps: Tensor, index: Tensor) -> Tensor:
        values = _sample_features(maps, (index.reshape(-1, ndim) - (scale - 1) / 2) / scale)
        return values.reshape(*index.shape[:-1], -1)

    logits_to_a: list[Tensor] = []
    logits_to_b: list[Tensor] = []
    for k, p, c in anchors:
        near = p[:, None, :] + offsets  # (N, K, n)
        inside = ((near >= 0) & (near <= size - 1)).all(dim=-1)
        flat = (near.clamp(min=torch.zeros_like(size), max=size - 1).long() * strides).sum(dim=-1)
        usable = torch.cat((torch.ones_like(inside[:, :1]), inside & pair.valid[k].flatten()[flat]), dim=1)
        keys_a = at(a[k], torch.cat((c[:, None], pair.corr[k].reshape(-1, ndim)[flat]), dim=1))  # (N, 1 + K, C)
        keys_b = at(b[k], torch.cat((p[:, None], near), dim=1))
        for logits, query, keys in ((logits_to_a, keys_b[:, 0], keys_a), (logits_to_b, keys_a[:, 0], keys_b)):
            cosine = torch.einsum("nc,nkc->nk", query, keys)
            logits.append((cosine / cfg.temperature).masked_fill(~usable, float("-inf")))
    to_a, to_b = torch.cat(logits_to_a), torch.cat(logits_to_b)
    target = torch.zeros(to_a.shape[0], dtype=torch.long, device=to_a.device)
    return 0.5 * (F.cross_entropy(to_a, target) + F.cross_entropy(to_b, target))


def pair_loss(
    maps_a: FeatureMaps, maps_b: FeatureMaps, pair: ViewPair, cfg: LossConfig, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """The InfoNCE losses (full resolution, half resolution) of a batch (module docstring); anchors are drawn with
    ``generator`` (on the features' device)."""
    ndim = pair.a.dim() - 2
    size = pair.a.shape[2:]
    candidates = pair.valid
    if cfg.negatives == "local":  # edges of view B; all valid voxels of a sample that has none
        edges = candidates & (local_contrast(pair.b) > cfg.edge)
        some = edges.flatten(1).any(dim=1).view(-1, *(1,) * ndim)
        candidates = torch.where(some, edges, candidates)
    anchors = []
    for k in range(pair.a.shape[0]):
        valid = candidates[k].flatten()
        count = int(valid.sum())
        if count == 0:
            continue
        chosen = torch.multinomial(valid.float(), cfg.points, replacement=count < cfg.points, generator=generator)
        p = torch.stack(torch.unravel_index(chosen, size), dim=-1).flip(-1).float()  # (i, j[, k])
        anchors.append((k, p, pair.corr[k].reshape(-1, ndim)[chosen]))
    if not anchors:
        raise RegkitError("no sample of the batch had a valid voxel pair: the crops miss the head; check synthesis")
    if cfg.negatives == "local":
        full = _local_both_ways(maps_a.full, maps_b.full, anchors, 1.0, pair, cfg)
        return full, _local_both_ways(maps_a.half, maps_b.half, anchors, 2.0, pair, cfg)
    full = _nce_both_ways(maps_a.full, maps_b.full, anchors, 1.0, cfg)
    return full, _nce_both_ways(maps_a.half, maps_b.half, anchors, 2.0, cfg)


# ---- the trainer ---------------------------------------------------------------------------------------------------


def _step_seed(seed: int, step: int) -> int:
    """The seed of step ``step``'s generators: a function of ``(seed, step)`` alone."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1, dtype=np.uint64)[0])


def _network_spec(cfg: FeatureTrainingConfig) -> NetworkSpec:
    return NetworkSpec(ndim=cfg.dim, **cfg.network.model_dump())


class Trainer:
    """The network, optimiser and data of a training run; :meth:`step` runs one optimiser step.

    Args:
        config: the training configuration.
        volume: the label volume to synthesise from (on any device; moved to the run's device).
        device: overrides ``config.device``.
        backend: WTConv backend of the network (``"auto"``: fused kernels on CUDA).
    """

    def __init__(
        self,
        config: FeatureTrainingConfig,
        volume: LabelVolume,
        *,
        device: str | torch.device | None = None,
        backend: str = "auto",
    ) -> None:
        self.config = config
        self.device = resolve_device(str(device) if device is not None else config.device)
        self.volume = volume.to(self.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.network = FeatureNetwork(_network_spec(config), backend=backend).to(self.device)
        self.optimizer = torch.optim.AdamW(
            self.network.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
        )
        self.flow = crop_flow(config.dim, config.synthesis.crop, config.synthesis.cells, config.batch_size)
        self.flow = self.flow.to(self.device)
        self.step_done = 0
        self.amp = config.mixed_precision and self.device.type == "cuda"

    def learning_rate(self, step: int) -> float:
        """The learning rate of 0-based step ``step``: linear warm-up, then cosine decay to a tenth of the peak."""
        cfg = self.config
        if step < cfg.warmup:
            return cfg.learning_rate * (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.learning_rate * (_FINAL_LR + (1 - _FINAL_LR) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def batch(self, step: int) -> tuple[ViewPair, torch.Generator]:
        """The view pairs of 0-based step ``step`` and the device generator that then draws its anchors."""
        seed = _step_seed(self.config.seed, step)
        generator = torch.Generator().manual_seed(seed)
        noise = torch.Generator(self.device).manual_seed(seed ^ 1)
        with torch.no_grad():
            pair = synthesise_pair(self.volume, self.config.synthesis, self.flow, generator, noise)
        return pair, noise

    def loss(self, pair: ViewPair, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """The (full, half) resolution losses of ``pair`` (under bfloat16 autocast when enabled)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            maps_a, maps_b = self.network(pair.a), self.network(pair.b)
        return pair_loss(maps_a, maps_b, pair, self.config.loss, generator)

    def step(self) -> StepReport:
        """Run the next optimiser step (synthesis included); ``seconds`` in the report is this step's wall time."""
        start = time.perf_counter()
        k = self.step_done
        lr = self.learning_rate(k)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        pair, generator = self.batch(k)
        self.network.train()
        loss_full, loss_half = self.loss(pair, generator)
        loss = loss_full + self.config.loss.half_weight * loss_half
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        values = [float(v) for v in (loss.detach(), loss_full.detach(), loss_half.detach())]  # synchronises
        seconds = time.perf_counter() - start
        self.step_done = k + 1
        return StepReport(
            step=k + 1,
            steps=self.config.steps,
            loss=values[0],
            loss_full=values[1],
            loss_half=values[2],
            learning_rate=lr,
            samples_per_second=self.config.batch_size / seconds,
            seconds=seconds,
        )

    def state(self, seconds: float) -> dict[str, Any]:
        """A checkpoint: format, step, configuration, network and optimiser states, seconds spent."""
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self.step_done,
            "seconds": seconds,
            "config": self.config.model_dump(mode="json"),
            "network": self.network.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state(self, state: dict[str, Any], path: Path) -> float:
        """Continue from a checkpoint :meth:`state` wrote (:func:`read_checkpoint` of ``path``); returns its seconds
        spent."""
        if state.get("config") != self.config.model_dump(mode="json"):
            raise RegkitError(f"{path}: the checkpoint was made with another configuration than {path.parent}")
        try:
            self.network.load_state_dict(state["network"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step_done = int(state["step"])
            return float(state["seconds"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise RegkitError(f"{path}: a damaged feature-training checkpoint ({type(err).__name__}: {err})") from None


# ---- the run -------------------------------------------------------------------------------------------------------


def _write_atomic(payload: Any, path: Path) -> None:
    with _atomic.replacing(path) as tmp:
        torch.save(payload, tmp)


def _read_log(path: Path, upto: int) -> list[dict[str, str]]:
    """Rows of ``log.csv`` up to step ``upto`` (later ones belong to steps a resumed run redoes)."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [row for row in csv.DictReader(f) if int(row["step"]) <= upto]


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The training checkpoint at ``path``, loaded on the CPU with ``weights_only`` (tensors and plain data only, so
    a hostile file cannot run code); RegkitError naming the file if it is not one :meth:`Trainer.state` wrote."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises pickle, zip, EOF and runtime errors for files it cannot read
        reason = str(err).split(".")[0].strip() or type(err).__name__
        raise RegkitError(f"{path}: not a regkit feature-training checkpoint ({reason})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise RegkitError(f"{path}: not a regkit feature-training checkpoint")
    return state


def check_output(output: Path, resume: bool, dim: int) -> Path:
    """The checkpoint path of a ``dim``-D run in ``output``; RegkitError unless it exists (``resume``), or else unless
    ``output`` holds none of the files a run writes (module docstring), which a new run would replace."""
    checkpoint = output / "checkpoint.pt"
    if resume and not checkpoint.is_file():
        raise RegkitError(f"{checkpoint}: no checkpoint to resume from")
    if not resume and checkpoint.exists():
        raise RegkitError(f"{output} already holds a training run: resume it (--resume) or choose another folder")
    present = [name for name in ("config.yaml", "log.csv", f"features-{dim}d.pt") if (output / name).exists()]
    if not resume and present:
        raise RegkitError(
            f"{output} holds {', '.join(present)}, which a training run would replace; choose another folder"
        )
    return checkpoint


def train_features(
    config: FeatureTrainingConfig,
    output: str | Path,
    *,
    resume: bool = False,
    volume: LabelVolume | None = None,
    device: str | None = None,
    backend: str = "auto",
    stop_after: int | None = None,
    time_limit: float | None = None,
    progress: Callable[[StepReport], None] | None = None,
) -> TrainingResult:
    """Train the feature network with ``config`` into the folder ``output`` (module docstring for its files).

    Args:
        config: the training configuration (:func:`regkit.features.training.recipe.load_training_config`).
        output: the output folder; it must not hold a checkpoint unless ``resume``.
        resume: continue from ``output/checkpoint.pt`` (made with the same configuration).
        volume: the label volume to synthesise from; default
            :func:`regkit.features.training.synth.brain_label_volume` at ``config.synthesis.source_spacing`` (built from
            AAL and nilearn's MNI152 maps).
        device: overrides ``config.device``; backend: the WTConv backend (``"auto"``: fused kernels on CUDA).
        stop_after: stop (with a checkpoint) once this many steps are done, to continue later with ``resume``.
        time_limit: stop (with a checkpoint) after the step during which this many seconds of this call passed.
        progress: called after every step with a :class:`StepReport`.
    """
    out = Path(output)
    checkpoint, log_path = check_output(out, resume, config.dim), out / "log.csv"
    state = read_checkpoint(checkpoint) if resume else None  # before the slow set-up: a bad file fails at once
    if volume is None:
        volume = brain_label_volume(config.synthesis.source_spacing)
    trainer = Trainer(config, volume, device=device, backend=backend)
    spent = 0.0
    if state is not None:
        spent = trainer.load_state(state, checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    _atomic.write_text(out / "config.yaml", yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    rows = _read_log(log_path, trainer.step_done)
    weights = out / f"features-{config.dim}d.pt"
    last = stop_after if stop_after is not None else config.steps
    start = time.perf_counter()
    final_loss = float(rows[-1]["loss"]) if rows else math.nan

    def save() -> None:
        seconds = spent + time.perf_counter() - start
        _write_atomic(trainer.state(seconds), checkpoint)
        meta = {
            "steps": trainer.step_done,
            "seconds": round(seconds, 1),
            "final_loss": final_loss,
            "device": str(trainer.device),
            "torch": str(torch.__version__),
            "config": config.model_dump(mode="json"),
        }
        save_feature_network(trainer.network, weights, meta)
        log = io.StringIO(newline="")
        writer = csv.DictWriter(log, fieldnames=_LOG_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
        _atomic.write_text(log_path, log.getvalue())

    saved = trainer.step_done if resume else -1
    while trainer.step_done < min(last, config.steps):
        report = replace(trainer.step(), seconds=spent + time.perf_counter() - start)
        final_loss = report.loss
        rows.append({key: f"{getattr(report, key):.6g}" for key in _LOG_FIELDS})
        if progress is not None:
            progress(report)
        out_of_time = time_limit is not None and time.perf_counter() - start >= time_limit
        if trainer.step_done % config.checkpoint_every == 0 or out_of_time:
            save()
            saved = trainer.step_done
        if out_of_time:
            break
    if saved != trainer.step_done:
        save()
    return TrainingResult(weights, checkpoint, trainer.step_done, spent + time.perf_counter() - start, final_loss)
