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

Both end in one walk, `follow_targets`, down the tokens the target emits after each node (its argmax, or its
draw). The walk loops over tree depth (at most N - 1 iterations), never over the vocabulary; each iteration is a
handful of batched ops. It has a fixed length and no host reads: the engine captures it in the target pass's CUDA
graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .sampling import ProbsKernels, SamplingParams, SamplingRows, draw

Follow = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # `follow_targets`' signature


def verify_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, node_valid: torch.Tensor,
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Longest root path whose every node is the target's argmax after its parent, plus the argmax
    after its last node: `follow_targets` of the argmaxes."""
    return follow_targets(tokens, parents, logits.argmax(-1), node_valid, max_depth)


def follow_targets(
    tokens: torch.Tensor, parents: torch.Tensor, targets: torch.Tensor, node_valid: torch.Tensor,
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Longest root path whose every node holds the token the target emits after its parent, targets [B, N] (its
    argmax, or its draw: `walk_sampling`), plus the target's token after its last node. Among siblings holding the
    same token, the first (best-ranked) is taken.

    The walk takes a fixed `max_depth` steps (the tree's depth; None: N - 1, which bounds any tree) and reads
    nothing on the host, so it can be captured in a CUDA graph with the target pass."""
    B, N = tokens.shape
    rows = torch.arange(B, device=tokens.device)
    # matches[b, j]: node j is exactly what the target emits after j's parent.
    matches = node_valid & (parents >= 0) & (tokens == targets.gather(1, parents.clamp(min=0)))
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
    return accepted, num_accepted, targets[rows, cur]


def verify_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    logits: torch.Tensor,
    node_valid: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`walk_sampling` by `params`: one SamplingParams or one per request."""
    sampling = SamplingRows.of(params, tokens.shape[0], logits.shape[-1], tokens.device)
    return walk_sampling(tokens, parents, logits, node_valid, sampling, seeds, positions, max_depth)


def walk_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    logits: torch.Tensor,
    node_valid: torch.Tensor,
    sampling: SamplingRows,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_depth: int | None = None,
    follow: Follow | None = None,
    probs_kernels: ProbsKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless tree speculative sampling for a deterministic draft (top-k children, no draft probs): at every node
    the target draws its next token (`sampling.draw`: by inverse CDF from its distribution p there, with the uniform
    of each request's seed, seeds [B] int64, at the node's position, positions [B, N], the sequence position of the
    node's own token); then the walk follows the drawn tokens down the tree (`follow_targets`), and the draw after
    the last accepted node is the bonus.

    Why the output is distributed exactly as the target's own sampling: the token emitted at each position is the
    target's inverse-CDF draw from p there, p given the tokens before it, with that position's uniform; uniforms at
    distinct positions are independent, so by the chain rule the emitted sequence is distributed as the target
    sampling token by token. A draft only decides how many of those draws one target pass makes: a node is accepted
    when its token is the draw after its parent, with probability p(token), so among distinct children the walk goes
    on with probability sum p(children), the most any verifier of unsampled drafts can reach.
    And because the uniform belongs to the position, a seeded request emits the same tokens with any tree, batch or
    no speculation at all, wherever the target's probabilities are the same (floating-point rounding of the
    target's logits, which differs with the pass's shape, can move a draw at a token boundary, as it can move a
    greedy argmax between near-equal logits).

    follow: `follow_targets`, or the fused kernel that equals it (the engine's on CUDA); probs_kernels:
    `target_probs`'s, likewise. Nothing is read on the host: the engine runs this in the target pass's CUDA graph.
    """
    targets = draw(logits, sampling, seeds, positions, probs_kernels)  # [B, N]
    return (follow or follow_targets)(tokens, parents, targets, node_valid, max_depth)


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """[..., N] bool -> [...] index of the first True, -1 where none (argmax returns the first max)."""
    return torch.where(mask.any(-1), mask.long().argmax(-1), -1)
