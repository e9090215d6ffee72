"""The Triton paged-attention backend matches the torch reference on random pools.

One body (`check`), two places: on CUDA with the engine's real shapes (`gpu` marker), and on CPU under
Triton's interpreter with small ones. The interpreter is chosen when the kernels are defined (module import,
TRITON_INTERPRET=1), and another test module may already have imported the backend in this process, so the
CPU cases run in one fresh spawned process with the flag set (tests/triton_interpreter.py).

Views, reference and tolerances: `paged_views.py` (bf16 1e-2: the kernel rounds the softmax weights to bf16 for
the PV product and the output once, a few bf16 ulps, 2^-8 relative each; fp16 2e-3, for the interpreter; fp32 1e-4).
"""

import copy
import functools
from dataclasses import replace

import pytest
import torch

from tests import triton_interpreter
from tests.serve.paged_views import GPU_CASES, LAYER, Case, case_id, compare, make_view, reference

pytest.importorskip("triton", reason="triton is not installed (the Triton backend is optional)")
from eyas.serve.attention import triton_paged  # noqa: E402


def check(case: Case, device: str) -> float:
    """The Triton backend against the reference on one random view (`paged_views.compare`)."""
    return compare(case, device, functools.partial(triton_paged.TritonPagedAttention, num_splits=case.num_splits))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_matches_torch_on_cuda(case):
    check(case, "cuda")


@pytest.mark.gpu
def test_cuda_graph_replays_new_lengths():
    """Captured once, replayed on new lengths, masks and block tables: nothing was fixed at capture time (row 2's
    prefix is random: the replays read other lengths than the capture's)."""
    case = Case("tree", B=4, T=8, W=16, max_prefix=3000, padding=1)
    pool, block_table, prefix_lens, window_mask, q, k, v = make_view(case, "cuda")
    args = (pool, block_table, prefix_lens, window_mask)
    triton_paged.TritonPagedAttention(*args).attend(LAYER, q, k, v)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_paged.TritonPagedAttention(*args).attend(LAYER, q, k, v)
    for seed in (1, 2):
        new = make_view(replace(case, seed=seed), "cuda")
        assert not torch.equal(new[2], prefix_lens) and new[2].min() == 0 and new[2].max() == 3000
        for static, fresh in zip((block_table, prefix_lens, window_mask, q, k, v), new[1:], strict=True):
            static.copy_(fresh)
        for cache, fresh in ((pool.k, new[0].k), (pool.v, new[0].v)):
            cache[LAYER].copy_(fresh[LAYER])
        graph.replay()
        ref, _ = reference(pool, block_table, prefix_lens, window_mask, q, k, v)
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


# --- CPU: Triton's interpreter, small shapes covering the same features ---
H = torch.float16  # the interpreter has no bf16 arithmetic (its tl.dot multiplies bf16 bit patterns): fp16 takes
# the same half-precision path (weights rounded for the PV product, output rounded once); bf16 runs on CUDA.
CPU_CASES = [
    Case("tree", B=4, T=1, W=1, max_prefix=70, Hkv=2, D=64, dtype=H, padding=1),
    Case("tree", B=4, T=1, W=1, max_prefix=130, Hkv=1, group=3, D=64, dtype=H, num_splits=3),
    Case("tree", B=3, T=6, W=6, max_prefix=40, Hkv=1, group=3, D=64, dtype=torch.float32, num_splits=2, padding=1),
    Case("tree", B=2, T=3, W=9, max_prefix=50, Hkv=2, group=1, dtype=H, block_size=32),  # draft pass
    Case("tree", B=3, T=4, W=12, max_prefix=20, Hkv=1, D=64, dtype=H, num_splits=5, padding=1),  # empty splits
    Case("causal", B=2, T=80, W=80, max_prefix=33, Hkv=1, group=1, D=64, dtype=H),  # 2 row tiles x 2 window tiles
    Case("causal", B=2, T=20, W=20, max_prefix=47, Hkv=1, group=4, D=64, dtype=torch.float32, num_splits=2),
    Case("tree", B=2, T=4, W=8, max_prefix=100, Hkv=1, group=2, D=64, dtype=H, num_splits=3, q_scale=16),  # sharp
    # Grouped heads over two window tiles, row 1's prefix ending on a block boundary (64 = 4 blocks of 16).
    Case("causal", B=2, T=70, W=70, max_prefix=64, Hkv=2, group=2, D=64, dtype=H),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=case_id)
def test_matches_torch_in_interpreter(interpreter, case):
    interpreter(check, case, "cpu")


def test_check_catches_a_wrong_kernel(interpreter):
    """The comparison can fail: a kernel given prefix_lens - 1 (it misses the last prefix key and reads the
    window one position early) is caught."""
    with pytest.raises(AssertionError, match="elements off"):
        interpreter(_check_short_prefix, CPU_CASES[0])


def check_rotary_fused(case: Case, device: str, rotary=None):
    """With the fused rotary installed, `attend_rotary` rotates and stores in one kernel: its output and cache equal
    those of the torch rotary followed by `attend` (`rotary`: the kernel to compare, default the fused one)."""
    from eyas.common.layers import Kernels
    from eyas.serve import kernels

    pool, block_table, prefix_lens, window_mask, q, k, v = make_view(case, device)
    B, T, _, D = q.shape
    angles = torch.rand(B, T, D, generator=torch.Generator().manual_seed(7)).to(device) * 6.3
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    results = []
    for impl in (Kernels().rotary, rotary or kernels.rotary):
        view = triton_paged.TritonPagedAttention(copy.deepcopy(pool), block_table, prefix_lens, window_mask,
                                                 num_splits=case.num_splits)
        results.append((view.attend_rotary(LAYER, q, k, v, cos, sin, impl), view.pool))
    (ref, ref_pool), (out, out_pool) = results
    tol = 1e-4 if q.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out_pool.k[LAYER], ref_pool.k[LAYER], atol=tol, rtol=tol)
    assert torch.equal(out_pool.v[LAYER], ref_pool.v[LAYER])


@pytest.mark.parametrize("case", CPU_CASES[:4], ids=case_id)
def test_rotary_fused_with_store_in_interpreter(interpreter, case):
    interpreter(check_rotary_fused, case, "cpu")


def test_rotary_check_catches_a_wrong_kernel(interpreter):
    """The comparison can fail: a rotary turning the wrong way is caught."""
    triton_interpreter.raises_in_comparison(interpreter, check_rotary_fused, CPU_CASES[0], "cpu", _rotated_backwards)


def _rotated_backwards(q, k, cos, sin):
    from eyas.serve import kernels

    return kernels.rotary(q, k, cos, -sin)


def _check_short_prefix(case: Case):
    real = triton_paged.paged_attention

    def short(q, k_cache, v_cache, block_table, prefix_lens, *args):
        return real(q, k_cache, v_cache, block_table, (prefix_lens - 1).clamp(min=0), *args)

    triton_paged.paged_attention = short
    try:
        check(case, "cpu")
    finally:
        triton_paged.paged_attention = real


def test_launch_config_fills_the_gpu():
    """Split-KV only where B * Hkv * row tiles leaves SMs idle (132 SMs, as on an H200)."""
    def splits(B, rows, max_keys=8192):
        return triton_paged.launch_config(B, rows, 8, max_keys, num_sms=132)[2]

    assert splits(1, 4) == 33 and splits(8, 4) == 4 and splits(64, 4) == 1  # decode, Hkv 8 x group 4
    assert splits(1, 4, max_keys=128) == 2  # never more splits than key tiles
    assert splits(1, 8192) == 1  # prefill: 64 row tiles x 8 kv heads
