"""Random paged-KV views and the torch reference every attention backend is compared with (fp32 reference on the
same inputs; tolerance |err| <= tol + tol |ref|). Cache slots no query may read hold poison (large keys, values
1000), so reading one key too many cannot hide under the tolerance."""

import copy
from dataclasses import dataclass

import torch

from eyas.serve.attention.paged import slots_of
from eyas.serve.attention.torch_sdpa import TorchPagedAttention
from eyas.serve.kv_cache import KVPool

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
    q_scale: float = 1.0  # sharp scores: past 11 or so, half-precision exp overflows without the running max


# The CUDA cases every backend is tested on: the engine's shapes (Llama-3.1-8B: Hkv 8 x group 4, D 128;
# SmolLM2-135M: Hkv 3 x group 3, D 64); num_splits is the Triton kernel's.
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
    Case("tree", B=1, T=1, W=1, max_prefix=8192, dtype=torch.float32),  # split-KV where one lost tile shows
    Case("tree", B=4, T=8, W=8, max_prefix=4096, dtype=torch.float16, num_splits=8, q_scale=16),
]


def make_view(case: Case, device: str):
    """A random pool and view -> (pool, block_table, prefix_lens, window_mask, q, k, v)."""
    c, gen = case, torch.Generator().manual_seed(case.seed)
    data = torch.Generator(device).manual_seed(case.seed)  # the bulk (pool contents) is drawn on the device
    real = torch.arange(c.B) < c.B - c.padding
    prefix = torch.randint(0, c.max_prefix + 1, (c.B,), generator=gen)
    prefix[0] = 0  # window only
    prefix[min(1, c.B - c.padding - 1)] = c.max_prefix  # a real row's (row 0's when it is the only one)
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

    q = torch.randn(c.B, c.T, c.Hkv * c.group, c.D, generator=data, device=device) * c.q_scale
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


def compare(case: Case, device: str, backend) -> float:
    """Runs `backend(pool, block_table, prefix_lens, window_mask)` (a PagedAttention) and the reference on one
    random view; asserts they agree; -> max abs error."""
    pool, block_table, prefix_lens, window_mask, q, k, v = make_view(case, device)
    ref, ref_pool = reference(pool, block_table, prefix_lens, window_mask, q, k, v)
    out = backend(pool, block_table, prefix_lens, window_mask).attend(LAYER, q, k, v)

    assert out.shape == q.shape and out.dtype == q.dtype
    for ours, theirs in ((pool.k, ref_pool.k), (pool.v, ref_pool.v)):  # both wrote the new k/v to the same slots
        assert torch.equal(ours[LAYER].float(), theirs[LAYER])
    if case.padding:
        assert (out[-case.padding:] == 0).all()
    tol = TOLERANCE[case.dtype]
    err = (out.float() - ref).abs()
    bad = err > tol + tol * ref.abs()
    assert not bad.any(), f"{case}: {int(bad.sum())} elements off, max abs error {err.max():.3g}"
    return float(err.max())


def case_id(case: Case) -> str:
    splits = "" if case.num_splits is None else f"-s{case.num_splits}"
    sharp = "" if case.q_scale == 1 else f"-q{case.q_scale:g}"
    return (f"{case.kind}-B{case.B}-T{case.T}-W{case.W}-P{case.max_prefix}-g{case.group}-D{case.D}-"
            f"{str(case.dtype)[6:]}-bs{case.block_size}{splits}{sharp}")


def dense_attention(pool: KVPool, block_table, prefix_lens, window_mask, q, k, v):
    """The attention `reference` computes, written independently of the backends: each row's keys gathered from its
    cache slots (prefix and the window's cached part) then the new k/v, a masked softmax in fp64 -> [B, T, Hq, D];
    a row that sees no key gives 0."""
    B, T, Hq, D = q.shape
    W, group, block_size = window_mask.shape[-1], Hq // k.shape[2], pool.block_size
    out = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        cached = int(prefix_lens[b]) + W - T
        slots = [int(block_table[b, p // block_size]) * block_size + p % block_size for p in range(cached)]
        keys, values = (torch.cat([cache[LAYER][slots], new[b]]).double().repeat_interleave(group, 1)
                        for cache, new in ((pool.k, k), (pool.v, v)))  # [S, Hq, D]
        seen = torch.cat([torch.ones(T, int(prefix_lens[b]), dtype=torch.bool), window_mask[b].cpu()], 1)  # [T, S]
        scores = torch.einsum("thd,shd->hts", q[b].double(), keys) / D**0.5
        out[b] = torch.einsum("hts,shd->thd", scores.masked_fill(~seen, -torch.inf).softmax(-1).nan_to_num(0.0),
                              values)
    return out
