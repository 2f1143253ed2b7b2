"""torch._grouped_mm, the GPU benchmarks' peer, in the same process as JAX."""

from __future__ import annotations

import os

# JAX takes 75% of the GPU when its backend starts; half leaves room for torch in this process.
XLA_MEM_FRACTION = "0.5"


def share_gpu_with_torch() -> None:
    """Caps JAX's share of GPU memory at XLA_MEM_FRACTION. Call it in main(), before JAX first
    touches the GPU (jax.devices(), an array): JAX reads the setting when its backend starts."""
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = XLA_MEM_FRACTION


def load_torch():
    """(torch, "") when it imports, sees a GPU and has _grouped_mm; else (None, why not)."""
    try:
        import torch
    except (ImportError, OSError) as error:
        return None, f"torch does not import: {error}"
    if not torch.cuda.is_available():
        return None, "torch sees no GPU"
    if not hasattr(torch, "_grouped_mm"):
        return None, f"torch {torch.__version__} has no _grouped_mm"
    return torch, ""


def torch_grouped_mm_steps(torch, dims) -> dict:
    """{pass: step(offs)} of torch._grouped_mm, lhs [M, K] and rhs [G, K, N] bf16, offs the
    cumulative group sizes. Its tensors live as long as the steps; the caller empties torch's
    cache afterwards."""
    rows, k, n, groups = dims
    options = dict(dtype=torch.bfloat16, device="cuda")
    lhs = torch.randn(rows, k, **options, requires_grad=True)
    rhs = torch.randn(groups, k, n, **options, requires_grad=True)
    grad_out = torch.randn(rows, n, **options)

    @torch.no_grad()
    def forward(offs):
        return torch._grouped_mm(lhs, rhs, offs=offs)

    def forward_backward(offs):
        out = torch._grouped_mm(lhs, rhs, offs=offs)
        return out, torch.autograd.grad(out, (lhs, rhs), grad_outputs=grad_out)

    return {"forward": forward, "forward+backward": forward_backward}


def torch_sync(torch):
    """sync(result) for torch's steps: waits for the whole device."""
    return lambda _: torch.cuda.synchronize()
