"""The Triton paged-attention backend matches the torch reference on random pools.

One body (`check`), two places: on CUDA with the engine's real shapes (`gpu` marker), and on CPU under
Triton's interpreter with small ones. The interpreter is chosen when the kernels are defined (module import,
TRITON_INTERPRET=1), and another test module may already have imported the backend in this process, so the
CPU cases run in one fresh spawned process with the flag set (tests/triton_interpreter.py).

Tolerance, against the reference computed in fp32 from the same inputs: |err| <= tol + tol |ref| with tol 1e-2
for bf16 (the kernel rounds the softmax weights to bf16 for the PV product and the output once: a few bf16 ulps,
2^-8 relative each), 2e-3 for fp16 (interpreter), 1e-4 for fp32. Cache slots no query may read hold poison
(large keys, values 1000), so reading one key too many cannot hide under the tolerance.
"""

import copy
from dataclasses import dataclass, replace

import pytest
import torch

from eyas.serve.attention.paged import slots_of
from eyas.serve.attention.torch_sdpa import TorchPagedAttention
from eyas.serve.kv_cache import KVPool
from tests import triton_interpreter

pytest.importorskip("triton", reason="triton is not installed (the Triton backend is optional)")
from eyas.serve.attention import triton_paged  # noqa: E402

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}  # atol = rtol
LAYER = 1  # of 2: the backend must index the pool by layer


@dataclass(frozen=True)
class Case:
    """kind: 'tree' (query t is window key W - T + t, sees itself and random earlier window keys; decode is
    T = W = 1, a draft pass W > T) or 'causal' (prefill: sees every earlier window key)."""

    kind: str
    B: int
    T: int
    W: int
    max_prefix: int
    Hkv: int = 8
    group: int = 4
    D: int = 128
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    padding: int = 0  # last rows: no prefix, all-False window (output must be exactly 0)
    num_splits: int | None = None  # None: the backend's choice
    seed: int = 0


def make_view(case: Case, device: str):
    """A random pool and view -> (pool, block_table, prefix_lens, window_mask, q, k, v)."""
    c, gen = case, torch.Generator().manual_seed(case.seed)
    data = torch.Generator(device).manual_seed(case.seed)  # the bulk (pool contents) is drawn on the device
    real = torch.arange(c.B) < c.B - c.padding
    prefix = torch.randint(0, c.max_prefix + 1, (c.B,), generator=gen)
    prefix[0] = 0  # window only
    prefix[1 % c.B] = c.max_prefix
    prefix = torch.where(real, prefix, 0)

    t = torch.arange(c.T)[:, None] + (c.W - c.T)  # window key of query t
    w = torch.arange(c.W)[None, :]
    if c.kind == "causal":
        mask = (w <= t).expand(c.B, c.T, c.W)  # an expanded view (strides 0): no padding rows here
    else:
        mask = (w == t) | ((w < t) & (torch.rand(c.B, c.T, c.W, generator=gen) < 0.5))
        mask = mask & real[:, None, None]

    # Each row owns M random, non-contiguous blocks, one more than it needs (the table's tail is never read).
    M = -(-(c.max_prefix + c.W) // c.block_size) + 1
    num_blocks = c.B * M + 3
    block_table = torch.randperm(num_blocks, generator=gen)[: c.B * M].view(c.B, M).int()

    # Poison everywhere, then real keys at each row's positions [0, prefix + W - T): its prefix and the window
    # keys already in the cache; attend writes the last T.
    pool = KVPool(2, num_blocks, c.block_size, c.Hkv, c.D, c.dtype, device)
    pool.k[LAYER].copy_(10 * torch.randn(pool.k[LAYER].shape, generator=data, device=device))
    pool.v[LAYER].fill_(1000.0)
    positions = torch.arange(M * c.block_size).expand(c.B, -1)
    cached = slots_of(block_table, positions, c.block_size)[positions < (prefix + c.W - c.T)[:, None]].to(device)
    for cache in (pool.k, pool.v):
        cache[LAYER][cached] = torch.randn(len(cached), c.Hkv, c.D, generator=data, device=device).to(c.dtype)

    q = torch.randn(c.B, c.T, c.Hkv * c.group, c.D, generator=data, device=device)
    k, v = (torch.randn(c.B, c.T, c.Hkv, c.D, generator=data, device=device) for _ in range(2))
    q, k, v = (x.to(c.dtype) for x in (q, k, v))
    return pool, block_table.to(device), prefix.int().to(device), mask.to(device), q, k, v


def reference(pool: KVPool, block_table, prefix_lens, window_mask, q, k, v):
    """TorchPagedAttention in fp32 on an fp32 copy of the pool -> (output, that pool)."""
    ref_pool = copy.copy(pool)
    ref_pool.k, ref_pool.v = [x.float() for x in pool.k], [x.float() for x in pool.v]
    out = TorchPagedAttention(ref_pool, block_table, prefix_lens, window_mask).attend(
        LAYER, q.float(), k.float(), v.float())
    return out, ref_pool


def check(case: Case, device: str) -> float:
    """Runs the Triton backend and the reference on one random view; asserts they agree; -> max abs error."""
    pool, block_table, prefix_lens, window_mask, q, k, v = make_view(case, device)
    ref, ref_pool = reference(pool, block_table, prefix_lens, window_mask, q, k, v)
    backend = triton_paged.TritonPagedAttention(pool, block_table, prefix_lens, window_mask, case.num_splits)
    out = backend.attend(LAYER, q, k, v)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(pool.k[LAYER].float(), ref_pool.k[LAYER])  # both wrote the new k/v to the same slots
    if case.padding:
        assert (out[-case.padding:] == 0).all()
    tol = TOLERANCE[case.dtype]
    err = (out.float() - ref).abs()
    bad = err > tol + tol * ref.abs()
    assert not bad.any(), f"{case}: {int(bad.sum())} elements off, max abs error {err.max():.3g}"
    return float(err.max())


def _id(case: Case) -> str:
    splits = "" if case.num_splits is None else f"-s{case.num_splits}"
    return (f"{case.kind}-B{case.B}-T{case.T}-W{case.W}-P{case.max_prefix}-g{case.group}-D{case.D}-"
            f"{str(case.dtype)[6:]}-bs{case.block_size}{splits}")


# --- CUDA: the engine's shapes (Llama-3.1-8B: Hkv 8 x group 4, D 128; SmolLM2-135M: Hkv 3 x group 3, D 64) ---
GPU_CASES = [
    Case("tree", B=1, T=1, W=1, max_prefix=8192),  # batch-1 decode: split-KV
    Case("tree", B=4, T=1, W=1, max_prefix=8192, padding=1),
    Case("tree", B=64, T=1, W=1, max_prefix=2048, padding=5),  # enough programs: no split
    Case("tree", B=1, T=48, W=48, max_prefix=1024),  # verification
    Case("tree", B=8, T=64, W=64, max_prefix=4096, padding=2),
    Case("tree", B=16, T=8, W=40, max_prefix=2048, padding=3),  # draft pass over a tree frontier
    Case("tree", B=64, T=8, W=64, max_prefix=1024, block_size=32),
    Case("causal", B=1, T=2048, W=2048, max_prefix=0),  # prefill
    Case("causal", B=2, T=2048, W=2048, max_prefix=2048),  # extend
    Case("causal", B=4, T=300, W=300, max_prefix=700, block_size=64),
    Case("tree", B=32, T=1, W=1, max_prefix=4096, Hkv=3, group=3, D=64, padding=4),
    Case("tree", B=4, T=16, W=16, max_prefix=2000, Hkv=3, group=3, D=64),
    Case("causal", B=2, T=512, W=512, max_prefix=300, Hkv=3, group=3, D=64),
    Case("tree", B=4, T=32, W=32, max_prefix=1000, dtype=torch.float32, padding=1),
    Case("tree", B=3, T=5, W=20, max_prefix=3000, Hkv=4, group=1, dtype=torch.float32),
    Case("tree", B=2, T=4, W=4, max_prefix=5000, num_splits=7),
    Case("tree", B=64, T=1, W=1, max_prefix=100, num_splits=3, padding=7),  # many empty splits
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_id)
def test_matches_torch_on_cuda(case):
    check(case, "cuda")


@pytest.mark.gpu
def test_cuda_graph_replays_new_lengths():
    """Captured once, replayed on new lengths, masks and block tables: nothing was fixed at capture time."""
    case = Case("tree", B=2, T=8, W=16, max_prefix=3000, padding=1)
    pool, block_table, prefix_lens, window_mask, q, k, v = make_view(case, "cuda")
    args = (pool, block_table, prefix_lens, window_mask)
    triton_paged.TritonPagedAttention(*args).attend(LAYER, q, k, v)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_paged.TritonPagedAttention(*args).attend(LAYER, q, k, v)
    for seed in (1, 2):
        new = make_view(replace(case, seed=seed), "cuda")
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
]


@pytest.fixture(scope="module")
def interpreter():
    with triton_interpreter.worker() as run:
        yield run


@pytest.mark.parametrize("case", CPU_CASES, ids=_id)
def test_matches_torch_in_interpreter(interpreter, case):
    interpreter(check, case, "cpu")


def test_check_catches_a_wrong_kernel(interpreter):
    """The comparison can fail: a kernel given prefix_lens - 1 (it misses the last prefix key and reads the
    window one position early) is caught."""
    with pytest.raises(AssertionError, match="elements off"):
        interpreter(_check_short_prefix, CPU_CASES[0])


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
