"""Fused Triton kernels for a decode step's work around the model's layers (the layers' own are `kernels.py`'s): the
draft's top-k log-probs and the draft tree's bookkeeping (each pass's next frontier and its inputs, the final tree),
verification's walks down the tree, greedy and sampled, and for the sampled one the target's probabilities and their
sums (`softmax`, `row_sum`: a row over many programs) and the least probability a top-k / top-p request keeps
(`nucleus_floor`, a search in place of a sort); after verification, the draft's inputs along each accepted path and
the move of its KV (`path_inputs`, `move_path`).

On CUDA the drafter takes `DRAFT` (top-k, frontier, tree, a pass's inputs), the target pass's graph `verify_greedy`,
`follow_targets` (the walk down a tree) and `PROBS` (softmax, floor, row sums), and its accept phase `ACCEPT`, in
place of their torch references (`serve.tree`, `serve.verify`, `serve.sampling`, `serve.accept`), which they equal,
each in one or two launches where the reference takes a chain of small kernels. Launches read sizes from tensor
shapes only and never sync the host, so CUDA graphs capture them; they launch as `kernels.launch_options` says.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from eyas.common.target import TargetOutput

from . import accept, tree
from .kernels import as_rows, follow, jit, launch_options
from .kv_cache import KVPool
from .sampling import ProbsKernels

TOP_CHUNK = 2048  # vocabulary entries per program of `top_log_probs`' first kernel
TOP_MAX_K = 32  # larger k: the torch reference


def top_log_probs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`eyas.serve.tree.top_log_probs` (the k best of logits.float().log_softmax(-1), descending, and their
    indices) in two launches where torch takes about fifteen (cast, log-softmax, a multi-pass radix top-k).

    First, one program per (row, chunk of TOP_CHUNK entries) keeps its chunk's k best and its log-sum-exp terms
    [rows, chunks, ·]; then one program per row merges them. Among equal logits the lower index ranks first. Each
    best is one reduction, giving the maximum and its first index: a max and an argmax apart took 7.2 against 6.4 µs
    for 8 rows of 8,192 logits and 32.3 against 27.4 for 64 of 49,152 (k = 8, one H100: docs/perf.md, sixty-fourth
    entry). A chunk's programs run 8 warps for a draft's k best, 2 for verification's argmax (k = 1) past one row,
    whose three reductions a chunk cost less on fewer warps: 64 rows of 49,152 logits 6.6 against 7.6 µs, 48 of
    128,256 9.5 against 11.9, 512 of 49,152 23.1 against 35.3; but one row (a plain step) took 2.95 against 2.88, so
    it keeps 8 (one H100: docs/perf.md, sixty-fifth entry)."""
    V = logits.shape[-1]
    assert 1 <= k <= V, f"top {k} of {V} entries"
    if k > TOP_MAX_K:
        return tree.top_log_probs(logits, k)
    x = as_rows(logits)
    rows, chunks = x.shape[0], triton.cdiv(V, TOP_CHUNK)
    k_pow2, device = triton.next_power_of_2(k), logits.device
    best = torch.empty(rows, chunks, k_pow2, dtype=torch.float32, device=device)  # each chunk's k best logits
    where = torch.empty(rows, chunks, k_pow2, dtype=torch.int64, device=device)  # and their vocabulary indices
    maxima, sums = (torch.empty(rows, chunks, dtype=torch.float32, device=device) for _ in range(2))
    warps = 2 if k == 1 and rows > 1 else 8
    _chunk_top_kernel[(rows, chunks)](x, best, where, maxima, sums, x.stride(0), V, K=k, K_POW2=k_pow2,
                                      BLOCK=TOP_CHUNK, num_warps=warps, **launch_options(x.device))
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=device)
    _merge_top_kernel[(rows,)](best, where, maxima, sums, values, indices, chunks, K=k, K_POW2=k_pow2,
                               CHUNKS_POW2=triton.next_power_of_2(chunks), **launch_options(values.device))
    shape = logits.shape[:-1] + (k,)
    return values.view(shape), indices.view(shape)


@jit
def _chunk_top_kernel(x_ptr, best_ptr, where_ptr, max_ptr, sum_ptr, stride_x, V, K: tl.constexpr,
                      K_POW2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    chunks = tl.num_programs(1)
    m = tl.max(x, 0)
    tl.store(max_ptr + row * chunks + chunk, m)
    tl.store(sum_ptr + row * chunks + chunk, tl.sum(tl.exp(x - m), 0))
    slots = tl.arange(0, K_POW2)
    best = tl.full([K_POW2], float("-inf"), tl.float32)
    where = tl.zeros([K_POW2], tl.int64)
    for j in tl.static_range(K):  # the j-th best: the first maximum left, then taken out
        top, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        best = tl.where(slots == j, top, best)
        where = tl.where(slots == j, chunk * BLOCK + at, where)
        x = tl.where(tl.arange(0, BLOCK) == at, float("-inf"), x)
    out = (row * chunks + chunk) * K_POW2 + slots
    tl.store(best_ptr + out, best)
    tl.store(where_ptr + out, where)


@jit
def _merge_top_kernel(best_ptr, where_ptr, max_ptr, sum_ptr, values_ptr, indices_ptr, chunks, K: tl.constexpr,
                      K_POW2: tl.constexpr, CHUNKS_POW2: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_POW2)
    m = tl.load(max_ptr + row * chunks + c, mask=c < chunks, other=float("-inf"))
    s = tl.load(sum_ptr + row * chunks + c, mask=c < chunks, other=0.0)
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
    # Candidates [CHUNKS_POW2 * K_POW2] in chunk order, each chunk's best first: the first maximum is the lowest index.
    i = tl.arange(0, CHUNKS_POW2 * K_POW2)
    ok = (i // K_POW2 < chunks) & (i % K_POW2 < K)
    cand = tl.load(best_ptr + row * chunks * K_POW2 + i, mask=ok, other=float("-inf"))
    for j in tl.static_range(K):
        top, at = tl.max(cand, 0, return_indices=True, return_indices_tie_break_left=True)
        # At most 0, as a log-probability is: a child scoring above its parent (an approximate log) would break
        # `select_tree`'s rule that a kept node's parent is kept.
        tl.store(values_ptr + row * K + j, tl.minimum(top - lse, 0.0))
        tl.store(indices_ptr + row * K + j, tl.load(where_ptr + row * chunks * K_POW2 + at))
        cand = tl.where(i == at, float("-inf"), cand)


def verify_greedy(tokens: Tensor, parents: Tensor, logits: Tensor, node_valid: Tensor, max_depth: int | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """`eyas.serve.verify.verify_greedy`: the target's argmax [B, N] from `top_log_probs` (two launches, where
    torch's reduce over a 128k vocabulary takes 28 µs at one token; the first maximum wins, as in torch), then
    `follow_targets`."""
    return follow_targets(tokens, parents, top_log_probs(logits, 1)[1].squeeze(-1), node_valid, max_depth)


def follow_targets(tokens: Tensor, parents: Tensor, targets: Tensor, node_valid: Tensor, max_depth: int | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """`eyas.serve.verify.follow_targets` in one launch (torch takes about ten kernels a tree level), one program
    per row walking its tree."""
    B, N = tokens.shape
    steps = N - 1 if max_depth is None else min(max_depth, N - 1)
    accepted = torch.empty(B, N, dtype=torch.long, device=tokens.device)
    num_accepted, bonus = (torch.empty(B, dtype=torch.long, device=tokens.device) for _ in range(2))
    tokens, parents, targets, node_valid = (x.contiguous() for x in (tokens, parents, targets, node_valid))
    _follow_targets_kernel[(B,)](tokens, parents, node_valid, targets, accepted, num_accepted, bonus, N,
                                 STEPS=steps, BLOCK=triton.next_power_of_2(N), **launch_options(tokens.device))
    return accepted, num_accepted, bonus


@jit
def _follow_targets_kernel(tokens_ptr, parents_ptr, valid_ptr, target_ptr, accepted_ptr, num_ptr, bonus_ptr, N,
                           STEPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)  # node indices
    ok = j < N
    node = row * N + j
    parents = tl.load(parents_ptr + node, mask=ok, other=-1)
    after_parent = tl.load(target_ptr + row * N + tl.maximum(parents, 0), mask=ok, other=-1)
    valid = tl.load(valid_ptr + node, mask=ok, other=0) != 0
    # matches[j]: node j is exactly what the target emits after j's parent.
    matches = valid & (parents >= 0) & (tl.load(tokens_ptr + node, mask=ok, other=-1) == after_parent)
    accepted = tl.where(j == 0, 0, -1)
    cur = 0  # the last accepted node
    num = 0
    for depth in tl.static_range(1, STEPS + 1):
        child = tl.min(tl.where(matches & (parents == cur), j, BLOCK), 0)  # the first matching child (best ranked)
        found = child < BLOCK
        accepted = tl.where((j == depth) & found, child, accepted)
        cur = tl.where(found, child, cur)
        num += found.to(tl.int32)
    tl.store(accepted_ptr + node, accepted, mask=ok)
    tl.store(num_ptr + row, num)
    tl.store(bonus_ptr + row, tl.load(target_ptr + row * N + cur))


def softmax(x: Tensor, temperature: Tensor) -> Tensor:
    """`eyas.serve.sampling.softmax`, a row split over many programs: x [R, V], temperature [R] float32 -> float32
    [R, V]. torch's gives a row one block (34 µs for 9 rows of 128k entries on an H200, docs/perf.md). Two
    launches: each chunk's max and sum of exponentials, then each row's combined and its probabilities written."""
    rows = as_rows(x)
    R, V = rows.shape
    splits, chunk = _row_splits(R, V)
    stats = torch.empty(2, R, splits, dtype=torch.float32, device=x.device)  # each chunk's max, sum of exp(x - max)
    out = torch.empty(R, V, dtype=torch.float32, device=x.device)
    temperature = temperature.float().contiguous()
    for write in (False, True):
        _softmax_kernel[(R, splits)](rows, temperature, stats, out, V, rows.stride(0), chunk, splits, WRITE=write,
                                     SPLITS=triton.next_power_of_2(splits), BLOCK=ROW_BLOCK, num_warps=4,
                                     **launch_options(x.device))
    return out


ROW_PROGRAMS, ROW_CHUNK, ROW_BLOCK = 264, 2048, 512  # programs a pass over rows (2 an H200 SM), least a program


def _row_splits(R: int, V: int) -> tuple[int, int]:
    """(splits, chunk): a launch over R rows of V entries gives each row `splits` programs of `chunk` entries (a
    multiple of ROW_BLOCK), so that few rows still keep many SMs busy."""
    splits = max(1, min(triton.cdiv(ROW_PROGRAMS, R), triton.cdiv(V, ROW_CHUNK)))
    chunk = triton.cdiv(triton.cdiv(V, splits), ROW_BLOCK) * ROW_BLOCK
    return triton.cdiv(V, chunk), chunk


@jit
def _softmax_kernel(x_ptr, t_ptr, stats_ptr, out_ptr, V, stride, chunk, splits, WRITE: tl.constexpr,
                    SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One chunk of a row, on x / t: the first launch stores its max m and sum of exp(x / t - m) in stats [2, R,
    splits]; the second combines the row's into its max M and sum Z and writes exp(x / t - M) / Z. x / t is rounded
    as torch's (`div_rn`): with Triton's own division, which is approximate, the GPU test failed 4 of its 6 cases
    (low temperatures make |x / t| large, where an ulp of it is a visible change of exp) and passed with `div_rn`.
    A chunk all -inf counts for nothing (a row all -inf gives NaN, as torch's)."""
    follow(PDL)
    row, split, R = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    t = tl.load(t_ptr + row)
    x_ptr += row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK)
    begin, end = split * chunk, tl.minimum(split * chunk + chunk, V)
    if WRITE:
        s = tl.arange(0, SPLITS)
        m = tl.load(stats_ptr + row * splits + s, mask=s < splits, other=float("-inf"))
        z = tl.load(stats_ptr + (R + row) * splits + s, mask=s < splits, other=0.0)
        top = tl.max(m, 0)
        total = tl.sum(tl.where(m > float("-inf"), z * tl.exp(m - top), 0.0), 0)
        out_ptr += row.to(tl.int64) * V
        for start in range(begin, end, BLOCK):
            c = start + cols
            tl.store(out_ptr + c, tl.exp(_over_t(x_ptr, c, end, t) - top) / total, mask=c < end)
    else:
        top = tl.full((BLOCK,), float("-inf"), tl.float32)
        for start in range(begin, end, BLOCK):
            c = start + cols
            top = tl.maximum(top, _over_t(x_ptr, c, end, t))
        top = tl.max(top, 0)
        z = tl.zeros((BLOCK,), tl.float32)
        for start in range(begin, end, BLOCK):
            c = start + cols
            x = _over_t(x_ptr, c, end, t)
            z += tl.where(x > float("-inf"), tl.exp(x - top), 0.0)
        tl.store(stats_ptr + row * splits + split, top)
        tl.store(stats_ptr + (R + row) * splits + split, tl.sum(z, 0))


def row_sum(x: Tensor) -> Tensor:
    """`eyas.serve.sampling.row_sum`, a row split over many programs: x [R, V] float32 -> [R]. torch's reduction
    took 14 µs for 9 rows of 128k entries on an H200 (docs/perf.md). Each program sums its chunk; torch sums the
    R x splits chunk sums. Rows that get one program each are left to torch's reduction (at 392 rows of 128k the
    split read 1% slower, docs/perf.md)."""
    rows = as_rows(x)
    R, V = rows.shape
    splits, chunk = _row_splits(R, V)
    if splits == 1:
        return rows.sum(-1)
    sums = torch.empty(R, splits, dtype=torch.float32, device=x.device)
    _row_sum_kernel[(R, splits)](rows, sums, V, rows.stride(0), chunk, splits, BLOCK=ROW_BLOCK, num_warps=4,
                                 **launch_options(x.device))
    return sums.sum(-1)


@jit
def _row_sum_kernel(x_ptr, sums_ptr, V, stride, chunk, splits, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One chunk of a row: its sum into sums [R, splits]."""
    follow(PDL)
    row, split = tl.program_id(0), tl.program_id(1)
    x_ptr += row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK)
    end = tl.minimum(split * chunk + chunk, V)
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(split * chunk, end, BLOCK):
        acc += tl.load(x_ptr + start + cols, mask=start + cols < end, other=0.0).to(tl.float32)
    tl.store(sums_ptr + row * splits + split, tl.sum(acc, 0))


@jit
def _over_t(x_ptr, c, end, t):
    """x[c] / t in float32, rounded as torch's division; -inf past `end`."""
    return tl.math.div_rn(tl.load(x_ptr + c, mask=c < end, other=float("-inf")).to(tl.float32), t)


def nucleus_floor(probs: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """`eyas.serve.sampling.nucleus_floor` without a sort: probs [R, V] float32 probabilities, top_k and top_p [R]
    float32 (None: off in every row, and that search skipped) -> [R] float32. Sorting 49 rows of a 128k vocabulary
    took 1.2 ms (docs/perf.md). Here each floor is searched for among the probabilities' float32 bit patterns (for
    values >= 0 they order as the values): each pass weighs NUCLEUS_PROBES patterns at once over the row, split
    across programs so that one row keeps many SMs busy, and narrows the range to the gap after the highest pattern
    that holds the goal. A fixed number of launches (`_nucleus_search`) per search: top-k's (counts), then
    top-p's (masses of the tokens top-k kept).
    Masses are summed in the kernel's own order, so a floor whose mass lies within float32 rounding of the goal may
    differ from torch's: both keep an exact nucleus."""
    rows = as_rows(probs)
    R, V = rows.shape
    lo = torch.zeros(R, dtype=torch.int32, device=probs.device)
    if top_k is not None:
        lo = _nucleus_search(rows, lo, torch.where(top_k < V, ABOVE_ALL, 1), top_k, mass=False)  # 1: off, floor 0
    if top_p is not None:  # the goal, top_p of the mass top-k kept, is weighed by the search's first pass
        lo = _nucleus_search(rows, lo, torch.where(top_p < 1, ABOVE_ALL, lo + 1), top_p, mass=True)
    return lo.view(torch.float32)


NUCLEUS_PROBES = 8  # bit patterns weighed a pass (a power of 2): each narrows the search 9-fold
NUCLEUS_PASSES = 10  # 9**10 > 2**31: every non-negative float32 pattern
ABOVE_ALL = 0x7F800001  # the bit pattern after +inf's: no probability weighs anything from here up


def _nucleus_search(rows: Tensor, lo: Tensor, hi: Tensor, goal: Tensor, mass: bool) -> Tensor:
    """The highest bit pattern b in [lo, hi) per row whose tokens (p >= b) weigh at least `goal`: their count, or
    with `mass` their mass, goal then the fraction of lo's mass they must hold. Given that lo's tokens reach the
    goal and hi's do not (hi <= lo + 1: nothing to search). -> lo [R] int32.

    Each pass is one launch of R x splits programs: a program narrows its row's range from the previous pass's
    weights (every program of the row computes the same), then weighs its chunk of the row at the new probes (the
    first pass also weighs lo, for a mass goal). The range and the weights alternate between two buffers, so a pass
    reads what the one before wrote."""
    R, V = rows.shape
    splits, chunk = _row_splits(R, V)
    ranges = torch.stack([torch.stack([lo, hi.to(torch.int32)], -1)] * 2)  # [2, R, 2]: lo, hi
    weights = torch.empty(2, R, splits, NUCLEUS_PROBES, dtype=torch.float32, device=rows.device)
    base = torch.empty(R, splits, dtype=torch.float32, device=rows.device)  # mass: lo's, chunk by chunk
    goal = goal.float().contiguous()
    for i in range(NUCLEUS_PASSES + 1):
        last = i == NUCLEUS_PASSES
        _nucleus_pass_kernel[(R, 1 if last else splits)](
            rows, goal, ranges, weights, base, V, rows.stride(0), chunk, splits, (i + 1) % 2, i % 2, NARROW=i > 0,
            WEIGH=not last, MASS=mass, PROBES=NUCLEUS_PROBES, SPLITS=triton.next_power_of_2(splits),
            BLOCK=ROW_BLOCK, num_warps=4, **launch_options(rows.device))
    return ranges[NUCLEUS_PASSES % 2, :, 0]


@jit
def _nucleus_pass_kernel(p_ptr, goal_ptr, ranges_ptr, weights_ptr, base_ptr, V, stride, chunk, splits, prev, cur,
                         NARROW: tl.constexpr, WEIGH: tl.constexpr, MASS: tl.constexpr, PROBES: tl.constexpr,
                         SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    row, split, R = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    lo = tl.load(ranges_ptr + (prev * R + row) * 2)
    hi = tl.load(ranges_ptr + (prev * R + row) * 2 + 1)
    goal = tl.load(goal_ptr + row)
    j = tl.arange(0, PROBES) + 1
    if NARROW:  # the previous pass's probes and their weights, summed over the row's chunks
        s = tl.arange(0, SPLITS)
        weight = tl.sum(tl.load(weights_ptr + ((prev * R + row) * splits + s[:, None]) * PROBES + j[None, :] - 1,
                                mask=s[:, None] < splits, other=0.0), 0)
        if MASS:
            goal *= tl.sum(tl.load(base_ptr + row * splits + s, mask=s < splits, other=0.0), 0)
        probes = lo + j * ((hi - lo + PROBES) // (PROBES + 1))  # [PROBES]; the last ones may reach past hi
        passed = (weight >= goal) & (probes < hi)  # a prefix of the probes: weight falls as the pattern rises
        lo, hi = tl.max(tl.where(passed, probes, lo), 0), tl.min(tl.where(passed, hi, tl.minimum(probes, hi)), 0)
    if split == 0:
        tl.store(ranges_ptr + (cur * R + row) * 2, lo)
        tl.store(ranges_ptr + (cur * R + row) * 2 + 1, hi)
    if WEIGH:
        if hi - lo > 1:  # (a finished row leaves its weights unwritten: the next pass's probes all lie past hi)
            probes = lo + j * ((hi - lo + PROBES) // (PROBES + 1))
            cols = tl.arange(0, BLOCK)
            acc = tl.zeros((BLOCK, PROBES), tl.float32)
            at_lo = tl.zeros((BLOCK,), tl.float32)  # the first pass of a mass search: lo's mass
            p_ptr += row.to(tl.int64) * stride
            for start in range(split * chunk, tl.minimum(split * chunk + chunk, V), BLOCK):
                x = tl.load(p_ptr + start + cols, mask=start + cols < V, other=0.0)  # masked: pattern 0, never weighed
                bits = x.to(tl.int32, bitcast=True)
                w = x if MASS else tl.full((BLOCK,), 1.0, tl.float32)
                acc += tl.where(bits[:, None] >= probes[None, :], w[:, None], 0.0)
                if MASS and not NARROW:
                    at_lo += tl.where(bits >= lo, x, 0.0)
            tl.store(weights_ptr + ((cur * R + row) * splits + split) * PROBES + j - 1, tl.sum(acc, 0))
            if MASS and not NARROW:
                tl.store(base_ptr + row * splits + split, tl.sum(at_lo, 0))


FRONTIER_MAX_K = 16  # larger k: the torch reference (the kernel ranks k·k children against each other)
TREE_MAX_CANDIDATES, TREE_MAX_NODES = 2048, 256  # larger: the torch reference (tiles held in registers)


def grow_frontier(frontier: tree.Frontier, child_scores: Tensor, child_tokens: Tensor, start: int
                  ) -> tuple[Tensor, Tensor, tree.Frontier]:
    """`eyas.serve.tree.grow_frontier` in one launch (torch takes about a dozen kernels), one program per row:
    the k·k children's scores and parents, the k best by rank (ties to the first created), and the next
    frontier with its ancestors."""
    B, k = frontier.nodes.shape
    if k > FRONTIER_MAX_K:
        return tree.grow_frontier(frontier, child_scores, child_tokens, start)
    device, P = child_scores.device, frontier.ancestors.shape[2]
    child_scores, child_tokens = child_scores.contiguous(), child_tokens.contiguous()
    frontier_scores = frontier.scores.contiguous()
    scores = torch.empty(B, k * k, dtype=torch.float32, device=device)
    parents = torch.empty(B, k * k, dtype=torch.int64, device=device)
    nodes, tokens, rows = (torch.empty(B, k, dtype=torch.int64, device=device) for _ in range(3))
    best_scores = torch.empty(B, k, dtype=torch.float32, device=device)
    ancestors = torch.empty(B, k, P + k, dtype=torch.bool, device=device)
    _grow_frontier_kernel[(B,)](
        frontier.nodes, frontier_scores, frontier.ancestors, child_scores, child_tokens, scores, parents, nodes,
        best_scores, tokens, rows, ancestors, start, P, *frontier.nodes.stride(), *frontier.ancestors.stride(),
        K=k, K_POW2=triton.next_power_of_2(k), KK_POW2=triton.next_power_of_2(k * k), **launch_options(scores.device),
    )
    return scores, parents, tree.Frontier(nodes, best_scores, tokens, rows, ancestors)


@jit
def _grow_frontier_kernel(frontier_ptr, frontier_scores_ptr, ancestors_ptr, child_scores_ptr, child_tokens_ptr,
                          scores_ptr, parents_ptr, nodes_ptr, best_scores_ptr, tokens_ptr, rows_ptr,
                          new_ancestors_ptr, start, P, stride_fb, stride_fi, stride_ab, stride_ai, stride_ap,
                          K: tl.constexpr, K_POW2: tl.constexpr, KK_POW2: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, KK_POW2)  # child i: frontier row i // K, its (i % K)-th best child
    ok = i < K * K
    parent_row = i // K
    s = tl.load(frontier_scores_ptr + row * K + parent_row, mask=ok, other=0.0) + tl.load(
        child_scores_ptr + row * K * K + i, mask=ok, other=0.0)
    tl.store(scores_ptr + row * K * K + i, s, mask=ok)
    parent = tl.load(frontier_ptr + row * stride_fb + parent_row * stride_fi, mask=ok, other=0)
    tl.store(parents_ptr + row * K * K + i, parent, mask=ok)
    # rank[i]: children that come before i, by score and then creation; the k of rank < K are the frontier.
    s = tl.where(ok, s, float("-inf"))  # padding lanes come last: -inf, and past every child
    j = tl.arange(0, KK_POW2)
    before = (s[None, :] > s[:, None]) | ((s[None, :] == s[:, None]) & (j[None, :] < i[:, None]))
    chosen = ok & (tl.sum(before.to(tl.int32), 1) < K)
    at = tl.cumsum(chosen.to(tl.int32), 0) - 1  # [KK_POW2] a chosen child's place in the frontier
    out = row * K + at
    tl.store(nodes_ptr + out, start + i, mask=chosen)
    tl.store(best_scores_ptr + out, s, mask=chosen)
    tl.store(tokens_ptr + out, tl.load(child_tokens_ptr + row * K * K + i, mask=ok), mask=chosen)
    tl.store(rows_ptr + out, parent_row, mask=chosen)
    # Its drafted ancestors: its parent's row of the old mask [P] (K columns at a time: P is a multiple of K), then
    # itself among the new frontier [K].
    c = tl.arange(0, K_POW2)
    copy = chosen[:, None] & (c[None, :] < K)
    parent_mask = ancestors_ptr + row * stride_ab + parent_row[:, None] * stride_ai
    new_row = new_ancestors_ptr + out[:, None] * (P + K)
    for p0 in range(0, P, K):
        inherited = tl.load(parent_mask + (p0 + c[None, :]) * stride_ap, mask=copy, other=0)
        tl.store(new_row + p0 + c[None, :], inherited, mask=copy)
    tl.store(new_row + P + c[None, :], c[None, :] == at[:, None], mask=copy)


def frontier_inputs(tokens: Tensor, embeddings: Tensor, outputs: Tensor, rows: Tensor | None
                    ) -> tuple[Tensor, Tensor]:
    """`eyas.serve.tree.frontier_inputs` in one launch (torch's embedding lookup and gather are two, and its lookup
    of a few rows takes 3-5 µs on an H200): program (node, chunk) copies a chunk of the node's embedding row and
    of its parent's output row."""
    B, k = tokens.shape
    H = outputs.shape[-1]
    device = tokens.device
    embeds = torch.empty(B, k, H, dtype=embeddings.dtype, device=device)
    parents = torch.empty(B, k, H, dtype=outputs.dtype, device=device)
    tokens, embeddings = tokens.contiguous(), embeddings.contiguous()
    outputs = outputs if outputs.stride(-1) == 1 else outputs.contiguous()
    _frontier_inputs_kernel[(B * k, triton.cdiv(H, COPY_BLOCK))](
        tokens, embeddings, outputs, tokens if rows is None else rows.contiguous(), embeds, parents, k, H,
        *outputs.stride()[:2], HAS_ROWS=rows is not None, BLOCK=COPY_BLOCK, **launch_options(device),
    )
    return embeds, parents


@jit
def _frontier_inputs_kernel(tokens_ptr, embeddings_ptr, outputs_ptr, rows_ptr, embeds_ptr, parents_ptr, K, H,
                            stride_ob, stride_or, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    node = tl.program_id(0).to(tl.int64)  # b * K + j
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < H
    token = tl.load(tokens_ptr + node)
    tl.store(embeds_ptr + node * H + i, tl.load(embeddings_ptr + token * H + i, mask=ok), mask=ok)
    parent = outputs_ptr + (node // K) * stride_ob
    if HAS_ROWS:
        parent += tl.load(rows_ptr + node) * stride_or
    tl.store(parents_ptr + node * H + i, tl.load(parent + i, mask=ok), mask=ok)


def select_tree(tokens: Tensor, scores: Tensor, parents: Tensor, num_draft_tokens: int, max_depth: int
                ) -> tree.DraftTree:
    """`eyas.serve.tree.select_tree` in one launch (torch takes about forty kernels: two sorts, the re-indexing
    and a gather round per level of the ancestor mask), one program per row: each candidate's rank by score
    (ties to the first created), the kept ones' new indices, their parents re-indexed, and the ancestor walk."""
    B, C = tokens.shape
    n = min(num_draft_tokens, C)
    if C > TREE_MAX_CANDIDATES or n > TREE_MAX_NODES:
        return tree.select_tree(tokens, scores, parents, num_draft_tokens, max_depth)
    device = tokens.device
    tokens, scores, parents = (x.contiguous() for x in (tokens, scores, parents))
    new_index = torch.empty(B, C, dtype=torch.int64, device=device)  # scratch: a kept candidate's tree index
    out_tokens, out_parents, depth = (torch.empty(B, n, dtype=torch.int64, device=device) for _ in range(3))
    out_scores = torch.empty(B, n, dtype=scores.dtype, device=device)
    mask = torch.empty(B, n, n, dtype=torch.bool, device=device)
    _select_tree_kernel[(B,)](tokens, scores, parents, new_index, out_tokens, out_scores, out_parents, depth, mask,
                              C, n, max_depth, C_POW2=triton.next_power_of_2(C), N_POW2=triton.next_power_of_2(n),
                              **launch_options(tokens.device))
    return tree.DraftTree(tokens=out_tokens, parents=out_parents, depth=depth, mask=mask, scores=out_scores)


@jit
def _select_tree_kernel(tokens_ptr, scores_ptr, parents_ptr, new_index_ptr, out_tokens_ptr, out_scores_ptr,
                        out_parents_ptr, depth_ptr, mask_ptr, C, n, max_depth, C_POW2: tl.constexpr,
                        N_POW2: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_POW2)  # candidates
    ok = c < C
    s = tl.load(scores_ptr + row * C + c, mask=ok, other=float("-inf")) + 0.0  # -0.0 -> 0.0: they tie
    # The n best by score, then by creation (a stable descending sort's first n): distinct int64 keys, the score's
    # bits made order-preserving above the reversed index, sorted; the n-th largest key is the threshold.
    bits = s.to(tl.int32, bitcast=True)
    key = (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) << 32) | (C_POW2 - 1 - c)
    key = tl.where(ok, key, -(1 << 63))  # padding lanes last (below a score of -inf)
    threshold = tl.sum(tl.where(c == n - 1, tl.sort(key, descending=True), 0), 0)
    keep = ok & (key >= threshold)
    new = tl.cumsum(keep.to(tl.int32), 0) - 1  # the kept candidates in creation order
    tl.store(new_index_ptr + row * C + c, new, mask=keep)
    out = row * n + new
    tl.store(out_tokens_ptr + out, tl.load(tokens_ptr + row * C + c, mask=keep), mask=keep)
    tl.store(out_scores_ptr + out, s, mask=keep)
    tl.debug_barrier()  # the new indices are read back below, by other threads
    parent = tl.load(parents_ptr + row * C + c, mask=keep, other=-1)
    has_parent = keep & (parent >= 0)
    parent = tl.load(new_index_ptr + row * C + tl.maximum(parent, 0), mask=has_parent, other=-1)
    tl.store(out_parents_ptr + out, parent, mask=keep)
    tl.debug_barrier()
    # The ancestor mask [n, n]: walk every kept node up its parents, at most max_depth steps.
    r = tl.arange(0, N_POW2)
    r_ok = r < n
    up = r.to(tl.int64)  # each node's ancestor reached so far (-1: past the root)
    ancestors = r[None, :] == r[:, None]
    depth = tl.zeros([N_POW2], tl.int64)
    for _ in range(max_depth):
        up = tl.load(out_parents_ptr + row * n + tl.maximum(up, 0), mask=r_ok & (up >= 0), other=-1)
        ancestors = ancestors | (r[None, :] == up[:, None])
        depth += (up >= 0).to(tl.int64)
    tl.store(mask_ptr + row * n * n + r[:, None] * n + r[None, :], ancestors, mask=r_ok[:, None] & r_ok[None, :])
    tl.store(depth_ptr + row * n + r, depth, mask=r_ok)


COPY_BLOCK = 1024  # columns of a row a program of `path_inputs` or `frontier_inputs` copies


def path_inputs(path: Tensor, num_accepted: Tensor, bonus: Tensor, tokens: Tensor, hidden: Tensor,
                aux: Tensor | None, n: Tensor, table: Tensor, block_size: int, T: int) -> accept.PathInputs:
    """`eyas.serve.accept.path_inputs` in one launch: program (row, t, chunk) copies a chunk of the target's hidden ‖
    aux row at the row's path node t, and the chunk-0 programs write column t's next token, position and slot."""
    B, N, H = hidden.shape
    A = 0 if aux is None else aux.shape[-1]
    device = path.device
    next_tokens = torch.empty(B, T, dtype=tokens.dtype, device=device)
    positions, slots = (torch.empty(B, T, dtype=torch.long, device=device) for _ in range(2))
    hidden_rows = torch.empty(B, T, H, dtype=hidden.dtype, device=device)
    aux_rows = None if aux is None else torch.empty(B, T, A, dtype=aux.dtype, device=device)
    path, tokens, hidden = (x.contiguous() for x in (path, tokens, hidden))
    aux = hidden if aux is None else aux.contiguous()  # A = 0: never read
    _path_inputs_kernel[(B * T, triton.cdiv(H + A, COPY_BLOCK))](
        path, num_accepted, bonus, tokens, hidden, aux, n, table, next_tokens, positions, slots, hidden_rows,
        hidden_rows if aux_rows is None else aux_rows, N, T, H, A, table.stride(0), BLOCK_SIZE=block_size,
        BLOCK=COPY_BLOCK, **launch_options(device),
    )
    return accept.PathInputs(next_tokens, positions, slots, TargetOutput(hidden=hidden_rows, aux=aux_rows))


@jit
def _path_inputs_kernel(path_ptr, num_ptr, bonus_ptr, tokens_ptr, hidden_ptr, aux_ptr, n_ptr, table_ptr, next_ptr,
                        positions_ptr, slots_ptr, hidden_out_ptr, aux_out_ptr, N, T, H, A, stride_table,
                        BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    cell = tl.program_id(0).to(tl.int64)  # b * T + t
    b, t = cell // T, cell % T
    node = b * N + tl.maximum(tl.load(path_ptr + b * N + t), 0)  # past the path: node 0
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # columns of hidden ‖ aux
    in_hidden, in_aux = i < H, (i >= H) & (i < H + A)
    tl.store(hidden_out_ptr + cell * H + i, tl.load(hidden_ptr + node * H + i, mask=in_hidden), mask=in_hidden)
    tl.store(aux_out_ptr + cell * A + i - H, tl.load(aux_ptr + node * A + i - H, mask=in_aux), mask=in_aux)
    if tl.program_id(1) == 0:
        bonus = tl.load(bonus_ptr + b)
        last = (t == tl.load(num_ptr + b)) | (t == T - 1)
        after = tl.load(path_ptr + b * N + t + 1, mask=t < T - 1, other=0)  # the path's next node
        tl.store(next_ptr + cell, tl.where(last, bonus, tl.load(tokens_ptr + b * N + tl.maximum(after, 0))))
        position = tl.load(n_ptr + b) + t
        tl.store(positions_ptr + cell, position)
        tl.store(slots_ptr + cell, _slot(table_ptr + b * stride_table, position, BLOCK_SIZE))


def move_path(pool: KVPool, path: Tensor, num_accepted: Tensor, n: Tensor, table: Tensor, T: int) -> None:
    """`eyas.serve.accept.move_path` in one launch (torch's gather and scatter are two): program (row, plane) moves
    the row's nodes in one of the pool's 2·L planes (each layer's keys, then values), t = 1 .. T-1 in order. The
    path rises (path[t] >= t, strictly), so move t reads a slot no earlier move wrote, and writes one that only an
    earlier move read: in order, with a barrier between moves, every read comes before the write it must precede."""
    planes = pool.kv.view(-1, pool.kv.shape[2], pool.kv.shape[3] * pool.kv.shape[4])  # [2·L, slots, Hkv·D]
    B, N = path.shape
    W = planes.shape[2]
    _move_path_kernel[(B, planes.shape[0])](
        planes, path.contiguous(), num_accepted, n, table, N, table.stride(0), planes.stride(0), W, T=T,
        BLOCK_SIZE=pool.block_size, BLOCK_W=min(triton.next_power_of_2(W), 1024), **launch_options(path.device),
    )


@jit
def _move_path_kernel(planes_ptr, path_ptr, num_ptr, n_ptr, table_ptr, N, stride_table, stride_plane, W,
                      T: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    b = tl.program_id(0).to(tl.int64)
    plane = planes_ptr + tl.program_id(1).to(tl.int64) * stride_plane
    num_accepted, start = tl.load(num_ptr + b), tl.load(n_ptr + b)
    w = tl.arange(0, BLOCK_W)
    for t in tl.static_range(1, T):
        node = tl.load(path_ptr + b * N + t)
        width = tl.where((t <= num_accepted) & (node != t), W, 0)  # columns to copy: none when node t stays put
        source = _slot(table_ptr + b * stride_table, start + tl.maximum(node, 0), BLOCK_SIZE)
        dest = _slot(table_ptr + b * stride_table, start + t, BLOCK_SIZE)
        for c in range(0, W, BLOCK_W):
            ok = c + w < width
            tl.store(plane + dest * W + c + w, tl.load(plane + source * W + c + w, mask=ok), mask=ok)
        tl.debug_barrier()  # this move's reads and writes are done before the next move's


@jit
def _slot(table_row_ptr, position, BLOCK_SIZE: tl.constexpr):
    """`slots_of` for one position of a row whose block table starts at table_row_ptr."""
    return tl.load(table_row_ptr + position // BLOCK_SIZE).to(tl.int64) * BLOCK_SIZE + position % BLOCK_SIZE


ACCEPT = accept.AcceptKernels(path_inputs, move_path)
DRAFT = tree.DraftKernels(top_log_probs, grow_frontier, select_tree, frontier_inputs)
PROBS = ProbsKernels(softmax, nucleus_floor, row_sum)
