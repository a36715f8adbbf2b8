"""One optimizer iteration of a registration (zero the gradients, evaluate the objective, backpropagate, step), eager or
replayed from a CUDA graph.

On a GPU a registration iteration is a few hundred small launches whose GPU work is about a millisecond, so the host
bounds it (Python, autograd, kernel launches: ~20 ms per iteration measured on an H200). A CUDA graph replays the
whole iteration in one launch. :class:`GraphedSteps` runs the first iterations of a pyramid level eagerly (they compile
the kernels and fill the caches a capture needs), captures the next one and replays it from then on. What a capture
requires of the objective: no host synchronisation and no host-to-device copy (constants go through
``regkit._backend.device_constant`` or are cached per device), the same tensors at every call. If a capture fails, the
level goes on eagerly, with the same result.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch

__all__ = ["WARMUP", "Adam", "GraphedSteps", "Objective", "Optimizer", "eager_step"]

Objective = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # () -> (loss, similarity)


class Adam:
    """Adam (Kingma and Ba, 2015) with ``torch.optim.Adam``'s update in its ``capturable`` form (no weight decay, no
    AMSGrad): ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``, ``p <- p - lr / (1 - b1^t) m / (sqrt(v) /
    sqrt(1 - b2^t) + eps)``, with the step count ``t`` a tensor on the parameters' device, so that an iteration makes
    no host synchronisation and can be captured in a CUDA graph.

    regkit's own because ``torch.optim``'s optimizers import ``torch._dynamo`` when the first one is built, which takes
    2-3 s on a CPU: a quarter of a 2 mm brain registration there. The interface is the part of ``torch.optim`` the
    engine uses: ``zero_grad``, ``step(closure=None)``.
    """

    def __init__(
        self, params: Iterable[torch.Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        self.params = list(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.t = torch.zeros((), dtype=torch.float64, device=self.params[0].device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        beta1, beta2 = self.betas
        self.t += 1
        step_size = self.lr / (1 - beta1**self.t)
        bias2_sqrt = (1 - beta2**self.t).sqrt()
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq, strict=True):
            if p.grad is None:
                continue
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            p.sub_(step_size.to(p.dtype) * m / (v.sqrt() / bias2_sqrt.to(p.dtype) + self.eps))
        return loss


Optimizer = Adam | torch.optim.LBFGS

#: Eager iterations before the capture (the first compiles kernels; the others settle caches and allocations).
WARMUP = 3


def eager_step(optimizer: Optimizer, objective: Objective, scale: float) -> tuple[float, float]:
    """One iteration, eagerly: ``optimizer.step`` with a closure that evaluates ``objective`` and backpropagates
    ``scale * loss``; returns (loss, similarity) as floats (L-BFGS may evaluate the closure several times: the
    last evaluation's values)."""
    last: list[float] = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss, sim = objective()
        (scale * loss).backward()
        last[:] = [float(loss.detach()), float(sim.detach())]
        return scale * loss.detach()

    optimizer.step(closure)
    return last[0], last[1]


class GraphedSteps:
    """Iterations of one level on CUDA: :data:`WARMUP` eager ones, then one CUDA-graph capture, then replays.

    Args:
        optimizer: :class:`Adam` (capture-safe) with its parameters on one CUDA device.
        objective: ``() -> (loss, similarity)``, capture-safe (module docstring).
        scale: the loss the optimizer sees is ``scale * loss``.

    Call the object for one iteration; it returns (loss, similarity) as floats, the values before the step, as the
    eager iteration does. :attr:`captured` says whether the graph replaced the eager iterations.
    """

    def __init__(self, optimizer: Adam, objective: Objective, scale: float = 1.0) -> None:
        self.optimizer, self.objective, self.scale = optimizer, objective, scale
        self.done = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.failed = False
        self.stream = torch.cuda.Stream()

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _iterate(self) -> tuple[torch.Tensor, torch.Tensor]:
        loss, sim = self.objective()
        (self.scale * loss).backward()
        self.optimizer.step()
        return loss.detach(), sim.detach()

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)  # the graph allocates the gradients, and overwrites them
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                self.outputs = self._iterate()
        except RuntimeError as exc:
            self.failed, self.outputs = True, None
            torch.cuda.synchronize()
            warnings.warn(f"CUDA graph capture failed, iterations run eagerly: {exc}", RuntimeWarning, stacklevel=3)
            return
        self.graph = graph

    def __call__(self) -> tuple[float, float]:
        if self.graph is None and not self.failed and self.done == WARMUP:
            self._capture()
        if self.graph is not None and self.outputs is not None:
            self.graph.replay()
            loss, sim = self.outputs
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.optimizer.zero_grad(set_to_none=True)
                loss, sim = self._iterate()
            torch.cuda.current_stream().wait_stream(self.stream)
        self.done += 1
        return float(loss), float(sim)
