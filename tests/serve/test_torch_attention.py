"""The torch paged backend, the reference every other backend is compared with, against attention written out
densely from each row's cache slots (`paged_views.dense_attention`): block sizes that split a row's keys anywhere,
prefixes of 0 and at block edges, tree masks and causal prefills, grouped queries, padding rows."""

import pytest
import torch

from eyas.serve.attention.torch_sdpa import TorchPagedAttention
from tests.serve.paged_views import LAYER, Case, case_id, dense_attention, make_view

CASES = [
    Case("tree", B=3, T=1, W=1, max_prefix=16, Hkv=2, group=4, D=64, dtype=torch.float32, block_size=16,
         padding=1),  # decode; prefixes 0 and a block's length
    Case("tree", B=3, T=5, W=5, max_prefix=7, Hkv=2, group=1, D=64, dtype=torch.float32, block_size=3),
    Case("tree", B=2, T=3, W=7, max_prefix=13, Hkv=1, group=4, D=64, dtype=torch.float32, block_size=1),  # a draft
    Case("causal", B=2, T=9, W=9, max_prefix=17, Hkv=2, group=2, D=64, dtype=torch.float32, block_size=16),
    Case("tree", B=3, T=4, W=4, max_prefix=33, Hkv=2, group=4, D=64, dtype=torch.bfloat16, block_size=16,
         padding=1),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torch_backend_equals_dense_attention(case):
    pool, block_table, prefix_lens, window_mask, q, k, v = make_view(case, "cpu")
    want = dense_attention(pool, block_table, prefix_lens, window_mask, q, k, v)  # before attend writes the new k/v
    got = TorchPagedAttention(pool, block_table, prefix_lens, window_mask).attend(LAYER, q, k, v).double()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[case.dtype]
    err = (got - want).abs()
    assert (err <= tol + tol * want.abs()).all(), f"{case}: max abs error {err.max():.3g}"
    if case.padding:
        assert (got[-case.padding:] == 0).all()


def test_the_dense_check_catches_a_key_too_few():
    """A view one key short of each row's prefix (its window's cached keys then read a slot early) fails it."""
    case = CASES[1]
    pool, block_table, prefix_lens, window_mask, q, k, v = make_view(case, "cpu")
    want = dense_attention(pool, block_table, prefix_lens, window_mask, q, k, v)
    short = (prefix_lens - 1).clamp(min=0).int()
    got = TorchPagedAttention(pool, block_table, short, window_mask).attend(LAYER, q, k, v).double()
    assert (got - want).abs().max() > 1e-2


def test_backends_a_device_cannot_run_are_refused_by_name(monkeypatch):
    """`attention_backend` refuses triton on a CPU device even where a GPU is present (its kernels would fail at the
    first launch), unless Triton's interpreter runs them; flashinfer anywhere but CUDA; auto is torch on a CPU."""
    pytest.importorskip("triton")
    from eyas.serve import attention, kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, asked for its CPU
    cpu = torch.device("cpu")
    if not kernels.INTERPRETED:
        with pytest.raises(ValueError, match="triton attention backend needs a CUDA device"):
            attention.attention_backend("triton", cpu)
    with pytest.raises(ValueError, match="flashinfer attention backend needs a CUDA device"):
        attention.attention_backend("flashinfer", cpu)
    assert attention.attention_backend("auto", cpu) is TorchPagedAttention
