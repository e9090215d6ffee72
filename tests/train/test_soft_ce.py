"""The TTT loss's Triton kernels (`train/soft_ce.py`) against `ttt.soft_cross_entropy`, its torch form: the loss, the
argmax (the first column of a tie, as torch's) and the gradient, on the CPU under Triton's interpreter (fp32 and
fp16; its bf16 casts truncate) and on a GPU in bf16 at a real draft vocabulary."""

import pytest
import torch

pytest.importorskip("triton")

from eyas.train.ttt import soft_cross_entropy  # noqa: E402


def check_soft_ce(device: str, dtype: torch.dtype, B: int, N: int, V: int):
    """Labels sliced from [B, N + 1, V] as the TTT loss slices them (step 1), a tie at a row's maximum, and the
    loss weighted per position (the gradient into the kernel is an expanded, strided [B, N])."""
    from eyas.train.soft_ce import BLOCK_MAX, soft_cross_entropy_kernel

    g = torch.Generator().manual_seed(V)
    logits = (3 * torch.randn(B, N, V, generator=g)).to(dtype)
    # A tie at row 0's maximum, in one lane of the kernel's loop where the row spans two loops: the first column wins.
    tie = (10, 10 + BLOCK_MAX if V > 10 + BLOCK_MAX else V - 1)
    logits[0, 0, tie[0]] = logits[0, 0, tie[1]] = logits[0, 0].max() + 1
    all_labels = (2 * torch.randn(B, N + 1, V, generator=g)).to(dtype)
    label_lse = all_labels.float().logsumexp(-1)
    weight = torch.rand(B, 1, generator=g).expand(B, N)
    args = [a.to(device) for a in (logits, all_labels[:, 1:], label_lse[:, 1:])]

    def run(fn, logits, labels, lse):
        logits = logits.clone().requires_grad_(True)
        loss, top = fn(logits, labels, lse)
        (grad,) = torch.autograd.grad((loss * weight.to(loss.device)).sum(), logits)
        return loss.float().cpu(), top.cpu(), grad.float().cpu()

    want = run(soft_cross_entropy, *(a.cpu().float() for a in args))
    got = run(soft_cross_entropy_kernel, *args)
    # Both sides read the same values and sum in fp32; the gradient is rounded to `dtype` once (fp16 2^-11, bf16 2^-8).
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    assert torch.equal(got[1], want[1]) and int(got[1][0, 0]) == tie[0]
    rtol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got[2], want[2], rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("B, N, V", [(2, 3, 300), (1, 2, 5000)], ids=str)  # under and over one loop of columns
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_soft_ce_interpreter(interpreter, dtype, B, N, V):
    interpreter(check_soft_ce, "cpu", dtype, B, N, V)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_soft_ce_on_cuda():
    check_soft_ce("cuda", torch.bfloat16, 2, 700, 32000)
