"""The frozen target's forward as the trainer runs it on CUDA (compiled) against the eager one."""

import pytest
import torch

from eyas.common.architectures import random_target
from eyas.train.target import _forward, target_forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_forward_equals_eager_on_cuda():
    """Two batches of other shapes through the one dynamic graph: aux and logits as the eager forward's, up to the
    fused kernels' bf16 roundings."""
    target = random_target("tiny", torch.bfloat16, torch.device("cuda")).requires_grad_(False).eval()
    aux_layers = (0, 1, len(target.model.layers) - 1)
    g = torch.Generator().manual_seed(0)
    for B, T in [(2, 300), (3, 517)]:
        input_ids = torch.randint(0, target.config.vocab_size, (B, T), generator=g).cuda()
        got = target_forward(target, {"input_ids": input_ids}, aux_layers)
        with torch.no_grad():
            want = _forward(target, input_ids, aux_layers)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())
