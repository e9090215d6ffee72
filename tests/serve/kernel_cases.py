"""What the Triton kernels' tests share (`test_kernels.py`, `test_step_kernels.py`): the dtypes they run on CUDA,
seeded inputs, and parameter ids for dtypes."""

import torch

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def randn(*shape, dtype, device, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype=dtype, device=device)


def dtype_id(value):
    """A pytest id for a torch dtype ("bfloat16"); None (pytest's own) for anything else."""
    return str(value)[6:] if isinstance(value, torch.dtype) else None
