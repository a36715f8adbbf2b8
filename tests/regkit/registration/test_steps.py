"""regkit's Adam against torch.optim.Adam, and a registration that never imports torch._dynamo."""

import subprocess
import sys

import torch

from regkit.registration.steps import Adam, eager_step


def _quadratic(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    M = torch.randn(6, 6, generator=generator, dtype=dtype)
    return M @ M.T + torch.eye(6, dtype=dtype), torch.randn(6, generator=generator, dtype=dtype)


def test_adam_takes_torch_adams_steps():
    H, b = _quadratic(torch.float64)
    mine = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    theirs = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    ours, reference = Adam([mine], lr=0.1), torch.optim.Adam([theirs], lr=0.1)
    for _ in range(25):
        for p, opt in ((mine, ours), (theirs, reference)):
            opt.zero_grad(set_to_none=True)
            (0.5 * p @ H @ p - b @ p).backward()
            opt.step()
    torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_adam_with_a_closure_and_parameters_without_gradients():
    """``eager_step``'s closure form; a parameter the loss does not use keeps its value."""
    H, b = _quadratic(torch.float32)
    p = torch.zeros(6, requires_grad=True)
    unused = torch.ones(2, requires_grad=True)
    opt = Adam([p, unused], lr=0.05)

    def objective() -> tuple[torch.Tensor, torch.Tensor]:
        loss = 0.5 * p @ H @ p - b @ p
        return loss, loss

    losses = [eager_step(opt, objective, 1.0)[0] for _ in range(200)]
    assert losses[-1] < losses[0] - 0.1
    torch.testing.assert_close(p.detach(), torch.linalg.solve(H, b), rtol=0, atol=2e-3)
    assert torch.equal(unused, torch.ones(2))


def test_a_registration_never_imports_torch_dynamo():
    """``torch.optim``'s optimizers import ``torch._dynamo`` (seconds); the engine's Adam does not."""
    code = (
        "import sys, torch\n"
        "from regkit.config import load_config\n"
        "from regkit.registration import register\n"
        "from regkit.io import Image\n"
        "from regkit.spatial.grid import Grid\n"
        "y, x = torch.meshgrid(torch.arange(24.0), torch.arange(24.0), indexing='ij')\n"
        "fixed = Image(torch.exp(-((x - 12) ** 2 + (y - 11) ** 2) / 30), Grid.create((24, 24)))\n"
        "moving = Image(torch.exp(-((x - 13) ** 2 + (y - 12) ** 2) / 30), Grid.create((24, 24)))\n"
        "register(fixed, moving, load_config('quick-2d'), device='cpu')\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
