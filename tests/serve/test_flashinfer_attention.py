"""The FlashInfer backend matches the torch reference on the shared CUDA cases (`paged_views.GPU_CASES`, the bf16
ones: FlashInfer has no fp32 kernels): decode, verification trees, draft passes, prefill chunks, padding rows.
Needs CUDA and flashinfer-python (`gpu` marker)."""

import pytest
import torch

from tests.serve.paged_views import GPU_CASES, case_id, compare

pytest.importorskip("flashinfer", reason="flashinfer-python is not installed (the FlashInfer backend is optional)")
from eyas.serve.attention.flashinfer_paged import FlashInferPagedAttention  # noqa: E402

CASES = [c for c in GPU_CASES if c.dtype != torch.float32 and c.num_splits is None]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_torch_on_cuda(case):
    compare(case, "cuda", FlashInferPagedAttention)
