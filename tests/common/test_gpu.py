"""On CUDA: the shared model code in bf16 agrees with the fp32 CPU reference, and paged generation matches."""

import pytest
import torch

from eyas.common.attention import CausalAttention
from eyas.common.target import TargetModel
from eyas.serve.generate import greedy_tokens
from tests.conftest import FAMILIES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_cuda_matches_fp32_cpu(family, hf_checkpoint):
    path, _ = hf_checkpoint(family)
    ref_model = TargetModel.from_pretrained(path)
    gpu_model = TargetModel.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, ref_model.config.vocab_size, (4, 300))
    pos = torch.arange(300).expand(4, -1)
    with torch.no_grad():
        ref = ref_model.logits(ref_model(ids, pos, CausalAttention()).hidden)
        out = gpu_model.logits(gpu_model(ids.cuda(), pos.cuda(), CausalAttention()).hidden).float().cpu()
    rel = (out - ref).norm() / ref.norm()
    assert rel < 2e-2, f"relative error {rel:.2e}"


def test_fp32_cuda_generation_equals_cpu(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    cpu = list(greedy_tokens(TargetModel.from_pretrained(path), [3, 1, 4, 1, 5], 48))
    cuda = list(greedy_tokens(TargetModel.from_pretrained(path, device="cuda"), [3, 1, 4, 1, 5], 48))
    assert cpu == cuda
