"""Verification of a draft tree against one target pass: which drafted nodes to accept, plus the
bonus token the target emits after the last accepted one.

Tree layout (shared with `tree.py`), per request, N nodes padded across the batch:
  tokens     [B, N] long  node 0 = the root (the last token already in the sequence), 1.. = drafts
  parents    [B, N] long  parents[:, 0] = -1; a parent's index is below its child's; siblings best first
  logits     [B, N, V]    row j = the target's next-token logits after the path root -> ... -> j
  node_valid [B, N] bool  False for padding; padded nodes are never accepted

Both verifiers return (accepted, num_accepted, bonus):
  accepted     [B, N] long  node indices of the accepted path, ROOT INCLUDED at column 0, then the
                            accepted drafts in depth order, padded with -1; accepted[b, :num_accepted[b] + 1]
                            is the path whose KV entries the engine keeps.
  num_accepted [B]    long  accepted DRAFT nodes (root excluded): the step emits num_accepted + 1 tokens,
                            tokens[b, accepted[b, 1:num_accepted[b] + 1]] followed by bonus[b].
  bonus        [B]    long  the target's token after the last accepted node; it is the next step's root.

Worked example (greedy): tokens [5, 2, 7, 1], parents [-1, 0, 1, 2], argmax per node [2, 7, 3, 0]:
the root predicts 2 = node 1, node 1 predicts 7 = node 2, node 2 predicts 3 but its child holds 1, so
accepted [0, 1, 2, -1], num_accepted 2, bonus 3; the step emits 2, 7, 3.

The loops below run over tree depth / sibling tests (at most N - 1 iterations), never over the
vocabulary; each iteration is a handful of batched ops. Both walks have a fixed length and no host reads: the
engine captures either in the target pass's CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .sampling import TORCH_PROBS, ProbsKernels, SamplingParams, SamplingRows, target_probs

Generators = torch.Generator | Sequence[torch.Generator | None] | None
Walk = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # `descend`'s signature


def verify_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, node_valid: torch.Tensor,
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Longest root path whose every node is the target's argmax after its parent, plus the argmax
    after its last node. Among siblings holding the same token, the first (best-ranked) is taken.

    The walk takes a fixed `max_depth` steps (the tree's depth; None: N - 1, which bounds any tree) and reads
    nothing on the host, so it can be captured in a CUDA graph with the target pass."""
    B, N = tokens.shape
    rows = torch.arange(B, device=tokens.device)
    target = logits.argmax(-1)  # [B, N]: the target's token after each node
    # matches[b, j]: node j is exactly what the target emits after j's parent.
    matches = node_valid & (parents >= 0) & (tokens == target.gather(1, parents.clamp(min=0)))
    accepted = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
    accepted[:, 0] = 0
    cur = torch.zeros(B, dtype=torch.long, device=tokens.device)  # [B] last accepted node
    num_accepted = torch.zeros_like(cur)
    steps = N - 1 if max_depth is None else min(max_depth, N - 1)  # a node at depth d has index >= d
    for depth in range(1, steps + 1):
        nxt = _first_true(matches & (parents == cur[:, None]))  # [B], -1 where no child matches
        found = nxt >= 0
        accepted[:, depth] = nxt  # rows that stopped earlier keep finding nothing: -1
        cur = torch.where(found, nxt, cur)
        num_accepted += found
    return accepted, num_accepted, target[rows, cur]


def verify_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    logits: torch.Tensor,
    node_valid: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    generator: Generators = None,
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`walk_sampling` by `params` (one SamplingParams or one per request), with coins from `generator` (one
    torch.Generator for the batch, or one per request, None entries using the default generator; it must live on
    the tensors' device). For per-request seeds, build each request's generator once with
    `sampling.make_generator` and keep it."""
    B, N = tokens.shape
    sampling = SamplingRows.of(params, B, logits.shape[-1], tokens.device)
    return walk_sampling(tokens, parents, logits, node_valid, sampling, draw_coins(B, N, generator, tokens.device),
                         max_depth)


def walk_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    logits: torch.Tensor,
    node_valid: torch.Tensor,
    sampling: SamplingRows,
    coins: torch.Tensor,
    max_depth: int | None = None,
    walk: Walk | None = None,
    probs_kernels: ProbsKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless tree speculative sampling for a deterministic draft (top-k children, no draft probs).

    At the current node with target distribution p (`target_probs`), try its children in rank order.
    q is what remains of p (rejected siblings zeroed, not renormalised). Child c is accepted with
    probability q(c) / sum(q); on acceptance move to c with q = p_c; on rejection set q(c) = 0 and try
    the next sibling. When no child is left, the bonus token is sampled from q / sum(q).

    Why the output is distributed exactly as the target's own sampling: at one node let the children
    hold distinct tokens c_1..c_k and R_i = 1 - sum_{j<i} p(c_j) the mass left before testing c_i (R_1 = 1).
    c_i is reached with probability prod_{j<i} (1 - p(c_j) / R_j) = prod_{j<i} R_{j+1} / R_j = R_i, so it is
    emitted with probability R_i * p(c_i) / R_i = p(c_i). A token x outside the children is emitted as the
    bonus with probability R_{k+1} * p(x) / R_{k+1} = p(x). So the next emitted token is exactly p-distributed
    (a sibling repeating an earlier token has q = 0 there and is never accepted, which keeps this true).
    If it is a child, the walk continues from that child, whose logits are the target's given the longer
    prefix, with fresh independent coins; if it is the bonus, the next step starts from it. By the chain
    rule the emitted sequence is distributed as the target sampling token by token. (Stopping at any node and
    sampling the bonus from its p is exact too: the walk's length bound never biases it.)

    All children of the current node are tested at once: child c_i is the one accepted when its coin passes with
    the mass R_i left by its rejected elder siblings and no elder's coin passed, which is what testing them one by
    one gives. So the walk takes one iteration per tree level, a fixed `max_depth` of them (the tree's depth;
    None: N - 1, which bounds any tree), and reads nothing on the host: the engine runs it in the target pass's
    CUDA graph.

    sampling: each request's parameters. coins [B, N + 1] uniforms in [0, 1) (`draw_coins`): one per node (each
    node is tested at most once, as a child), and the last for the bonus. walk: `descend`, or the fused kernel
    that equals it (the engine's on CUDA); probs_kernels: `target_probs`'s and the row sums', likewise.
    """
    B, N = tokens.shape
    dev = tokens.device
    probs_kernels = probs_kernels or TORCH_PROBS
    probs = target_probs(logits, sampling, probs_kernels)  # [B, N, V] float32
    V = probs.shape[-1]
    rows = torch.arange(B, device=dev)
    idx = torch.arange(N, device=dev)
    # repeat[b, k]: an elder valid sibling of k holds k's token, so k's q is zero when it is tested.
    same = (parents[:, :, None] == parents[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])  # [B, j, k]
    repeat = (same & node_valid[:, :, None] & (idx[:, None] < idx)).any(1)  # [B, N]

    # q[b, j]: node j's probability after its parent, the q it has when tested (0 for the root, padding and repeats).
    q = torch.where(node_valid & (parents >= 0) & ~repeat, probs[rows[:, None], parents.clamp(min=0), tokens], 0.0)
    steps = N - 1 if max_depth is None else min(max_depth, N - 1)  # a node at depth d has index >= d
    mass = probs_kernels.row_sum(probs.view(-1, V)).view(B, N)
    accepted, num_accepted, cur, walking = (walk or descend)(q, mass, parents, node_valid, coins, steps)
    # The bonus: from the last node's p, less the children a stopped row rejected there. Where those held all of p
    # (a last child's ratio, q / left, can round to just below 1), from p: never a token of probability zero.
    p = probs[rows, cur]
    rejected = node_valid & (parents == cur[:, None]) & ~walking[:, None]  # [B, N]
    rest = torch.cat([p, p.new_zeros(B, 1)], 1).scatter_(1, torch.where(rejected, tokens, V), 0.0)[:, :V]
    rest = torch.where(probs_kernels.row_sum(rest)[:, None] > 0, rest, p)
    return accepted, num_accepted, _sample(rest, coins[:, N])


def descend(q: torch.Tensor, mass: torch.Tensor, parents: torch.Tensor, node_valid: torch.Tensor, coins: torch.Tensor,
            steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`walk_sampling`'s walk down the trees, `steps` levels: q [B, N] each node's probability after its parent (0:
    never accepted), mass [B, N] the total of each node's distribution, coins [B, N + 1]. -> accepted [B, N],
    num_accepted [B], the last accepted node [B] and whether its level accepted a child [B] (False: the row stopped
    there, its children rejected)."""
    B, N = q.shape
    accepted = torch.full((B, N), -1, dtype=torch.long, device=q.device)
    accepted[:, 0] = 0
    num_accepted = torch.zeros(B, dtype=torch.long, device=q.device)
    cur = torch.zeros(B, dtype=torch.long, device=q.device)  # [B] last accepted node
    walking = torch.ones(B, dtype=torch.bool, device=q.device)
    for depth in range(1, steps + 1):
        children = node_valid & (parents == cur[:, None])  # [B, N], in rank order
        tested = torch.where(children, q, 0.0)
        left = mass.gather(1, cur[:, None]) - (tested.cumsum(1) - tested)  # mass left once elder siblings are rejected
        nxt = _first_true(walking[:, None] & children & (coins[:, :N] < tested / left))  # [B], -1: all rejected
        found = nxt >= 0
        accepted[:, depth] = nxt  # rows that stopped earlier keep finding nothing: -1
        num_accepted += found
        cur = torch.where(found, nxt, cur)
        walking = found
    return accepted, num_accepted, cur, walking


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """[..., N] bool -> [...] index of the first True, -1 where none (argmax returns the first max)."""
    return torch.where(mask.any(-1), mask.long().argmax(-1), -1)


def draw_coins(batch: int, nodes: int, generator: Generators, device: torch.device) -> torch.Tensor:
    """`walk_sampling`'s coins for `batch` trees of `nodes` nodes: [batch, nodes + 1] uniforms in [0, 1) from one
    shared generator or one per row."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(batch, nodes + 1, generator=generator, device=device)
    if len(generator) != batch:
        raise ValueError(f"got {len(generator)} generators for {batch} requests")
    return torch.stack([torch.rand(nodes + 1, generator=g, device=device) for g in generator])


def _sample(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from unnormalised q [B, V] (positive mass) with uniforms u [B] -> tokens [B]."""
    cdf = q.cumsum(-1)  # [B, V]
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # first cdf > u * mass
    # Rounding can put u * mass at the total; fall back to the first token where the cdf reaches it, one with mass
    # (the cdf rises there), never a zeroed one.
    return torch.minimum(tok, torch.searchsorted(cdf, cdf[:, -1:].contiguous())[:, 0])
