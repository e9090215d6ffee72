"""EAGLE-2 dynamic draft trees: which candidates to draft, and the tree the target verifies.

Per request, with `topk` = k and `num_steps` draft passes:
  pass 0 runs the draft on the root (the last token in the sequence): its top-k tokens are the depth-1
      candidates, scored by their draft log-probability, and form the first frontier;
  pass d (1 .. num_steps-1) runs the draft on the k frontier nodes: each proposes its top-k children,
      scored by cumulative log-probability (parent score + log q(child)); the best k of those k·k
      become the next frontier. Every scored node stays a candidate.
Finally the best `num_draft_tokens - 1` candidates by score are kept. A child's score never exceeds
its parent's (log q ≤ 0), and ties are broken by creation order (parents are created first), so the
kept set is closed under taking parents: it is a tree. Nodes are then ordered by creation, so parents
precede children. With k = 1 the tree is a chain.

Worked example, k = 2, num_steps = 2, num_draft_tokens = 4 (scores are log-probs):
  pass 0:  a -0.1, b -0.5                       frontier [a, b]
  pass 1:  a -> c -0.3, d -1.0;  b -> e -0.7, f -2.0
  best 3 of {a -0.1, b -0.5, c -0.4, d -1.1, e -1.2, f -2.5}: a, c, b
  verified tree: [root, a, b, c] with parents [-1, 0, 0, 1]

Shapes: B requests, k = topk, V = draft vocab; node 0 of the final tree is the root.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x [B, N, D], index [B, T] -> x[b, index[b, t]] [B, T, D]: each request's rows picked by its own indices."""
    return x.gather(1, index[:, :, None].expand(-1, -1, x.shape[-1]))


@dataclass
class DraftTree:
    """The tree the target verifies, B requests of N nodes each (node 0 = root)."""

    tokens: Tensor  # [B, N] token ids (draft-vocab indices until mapped by the caller), tokens[:, 0] = root
    parents: Tensor  # [B, N] parent node index, -1 for the root; parents precede children
    depth: Tensor  # [B, N] 0 for the root: a node's position is the root's position + depth
    mask: Tensor  # [B, N, N] bool: node i may attend node j iff j is i or one of its ancestors
    # [B, N] cumulative draft log-probability (+inf for the root): what `finalize` ranked by. Serving never
    # reads it, so the drafter's trees (graph outputs) and `root_only` leave it None.
    scores: Tensor | None = None


def top_log_probs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """logits [..., V] -> the k best draft log-probs [..., k] float32 (descending) and their indices [..., k].
    The reference; on CUDA the drafter uses the two-launch `eyas.serve.step_kernels.top_log_probs`."""
    return logits.float().log_softmax(-1).topk(k, dim=-1)


@dataclass
class Frontier:
    """The k nodes per request that the next draft pass runs on, in creation order. `ancestors` [B, k, P] is over
    the P = k·depth nodes drafted so far, in drafting order: each node's drafted ancestors and itself (the draft's
    own KV of this tree that the node attends to)."""

    nodes: Tensor  # [B, k] their candidate indices
    scores: Tensor  # [B, k] float32 their scores
    tokens: Tensor  # [B, k] their draft-vocabulary tokens
    rows: Tensor | None  # [B, k] the row of the previous frontier each one extends (None at depth 1)
    ancestors: Tensor  # [B, k, P] bool


def grow_frontier(frontier: Frontier, child_scores: Tensor, child_tokens: Tensor, start: int
                  ) -> tuple[Tensor, Tensor, Frontier]:
    """One draft pass's bookkeeping. Each frontier node's top-k children, log-probs and tokens [B, k, k], become
    candidates `start` .. `start + k·k - 1` (row by row) -> their scores and parents [B, k·k] (cumulative
    log-probs; candidate indices), and the next frontier: the k best of them, ties to the first created.
    The reference; on CUDA the drafter uses the one-launch `eyas.serve.step_kernels.grow_frontier`."""
    B, k = frontier.nodes.shape
    scores = (frontier.scores[:, :, None] + child_scores).flatten(1)  # [B, k·k]
    parents = frontier.nodes[:, :, None].expand(-1, -1, k).flatten(1)
    best = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k].sort(dim=-1).values  # creation order
    rows = best // k
    # A new frontier node's drafted ancestors: its parent's (parent included), then itself.
    ancestors = frontier.ancestors
    inherited = gather_rows(ancestors, rows)
    itself = torch.eye(k, dtype=torch.bool, device=best.device).expand(B, k, k)
    tokens = child_tokens.flatten(1).gather(1, best)
    return scores, parents, Frontier(start + best, scores.gather(1, best), tokens, rows,
                                     torch.cat([inherited, itself], dim=2))


def select_tree(tokens: Tensor, scores: Tensor, parents: Tensor, num_draft_tokens: int, max_depth: int
                ) -> DraftTree:
    """The candidates [B, C] (tokens, scores, parent candidate indices; candidate 0 the root, parents created
    first) -> the tree of the root and the best `num_draft_tokens - 1` others by score, ties to the first created,
    in creation order. `max_depth`: no candidate is deeper (bounds the ancestor walk without a host sync).
    The reference; on CUDA the drafter uses the one-launch `eyas.serve.step_kernels.select_tree`."""
    B, C = tokens.shape
    n = min(num_draft_tokens, C)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :n]
    keep = order.sort(dim=-1).values  # [B, n] candidate indices; keep[:, 0] = 0 (the root)
    new_index = torch.full((B, C), -1, dtype=torch.long, device=tokens.device)
    new_index.scatter_(1, keep, torch.arange(n, device=tokens.device).expand(B, n))
    kept_parents = parents.gather(1, keep)
    # Closed under parents (see the module docstring), so every kept parent has a new index.
    tree_parents = torch.where(kept_parents < 0, kept_parents, new_index.gather(1, kept_parents.clamp(min=0)))
    mask = ancestor_mask(tree_parents, max_depth)
    return DraftTree(tokens=tokens.gather(1, keep), parents=tree_parents, depth=mask.sum(-1) - 1, mask=mask,
                     scores=scores.gather(1, keep))


def frontier_inputs(tokens: Tensor, embeddings: Tensor, outputs: Tensor, rows: Tensor | None
                    ) -> tuple[Tensor, Tensor]:
    """A draft pass's inputs for its frontier: the tokens [B, k] (draft indices) -> their embeddings [B, k, H], rows
    of `embeddings` [Vd, H], and each node's parent output [B, k, H], outputs[b, rows[b, j]] of outputs [B, R, H]
    (the last pass's outputs; rows None: every node's is outputs[b, 0], the extension's output before the first
    pass). The reference; on CUDA the drafter uses the one-launch `eyas.serve.step_kernels.frontier_inputs`."""
    B, k = tokens.shape
    parents = outputs[:, :1].expand(B, k, -1) if rows is None else gather_rows(outputs, rows)
    return F.embedding(tokens, embeddings), parents


@dataclass(frozen=True)
class DraftKernels:
    """What drafting a tree computes besides the head: torch references here, fused kernels on CUDA
    (`eyas.serve.step_kernels.DRAFT`)."""

    top_log_probs: Callable[[Tensor, int], tuple[Tensor, Tensor]] = top_log_probs
    grow_frontier: Callable[[Frontier, Tensor, Tensor, int], tuple[Tensor, Tensor, Frontier]] = grow_frontier
    select_tree: Callable[[Tensor, Tensor, Tensor, int, int], DraftTree] = select_tree
    frontier_inputs: Callable[[Tensor, Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor]] = frontier_inputs


class TreeBuilder:
    """Grows the candidate pool pass by pass; the engine runs the draft between the calls. Each pass hands it
    its top-k children per node (`top_log_probs` of the draft's logits): log-probs and tokens.

        builder = TreeBuilder(root_tokens, topk)
        tokens = builder.first(*top_log_probs(logits0, topk))   # [B, k] depth-1 frontier
        for _ in range(num_steps - 1):
            rows = builder.frontier.rows                   # [B, k]: which previous frontier row each one extends
            mask = builder.frontier.ancestors              # [B, k, P]: frontier vs the P drafted nodes so far
            logits = <draft pass on tokens, at depth builder.depth, hidden of rows, attending by mask>
            tokens = builder.extend(*top_log_probs(logits, topk))   # [B, k, k] each -> next frontier [B, k]
        tree = builder.finalize(num_draft_tokens)
    """

    def __init__(self, root_tokens: Tensor, topk: int, kernels: DraftKernels = DraftKernels()):
        B, device = root_tokens.shape[0], root_tokens.device
        self.k, self.kernels = topk, kernels
        self._constants = _pool_constants(B, topk, device)
        # Candidate pool, in creation order; candidate 0 is the root (never dropped, score +inf).
        self.tokens = [root_tokens[:, None]]  # list of [B, n]
        self.scores = [self._constants.root_score]
        self.parents = [self._constants.root_parent]
        self.frontier: Frontier | None = None
        self.depth = 0

    def _add(self, tokens: Tensor, scores: Tensor, parents: Tensor) -> None:
        """Appends candidates [B, m]."""
        self.tokens.append(tokens)
        self.scores.append(scores)
        self.parents.append(parents)

    @property
    def size(self) -> int:
        """Candidates so far (the next one's index)."""
        return sum(t.shape[1] for t in self.tokens)

    def first(self, scores: Tensor, tokens: Tensor) -> Tensor:
        """The root's top-k children, their log-probs and tokens [B, k] -> the depth-1 frontier tokens [B, k]."""
        assert tokens.shape[1] == self.k and self.size == 1, "first() takes the root's k children, once"
        self.depth = 1
        constants = self._constants
        self._add(tokens, scores, constants.first_parents)
        self.frontier = Frontier(constants.first_nodes, scores, tokens, None, constants.first_ancestors)
        return tokens

    def extend(self, child_scores: Tensor, child_tokens: Tensor) -> Tensor:
        """Each frontier node's top-k children, log-probs and tokens [B, k, k] -> the next frontier tokens [B, k]."""
        self.depth += 1
        scores, parents, self.frontier = self.kernels.grow_frontier(self.frontier, child_scores, child_tokens,
                                                                    self.size)
        self._add(child_tokens.flatten(1), scores, parents)
        return self.frontier.tokens

    def finalize(self, num_draft_tokens: int) -> DraftTree:
        """Keeps the root and the best `num_draft_tokens - 1` candidates; re-indexes parents."""
        return self.kernels.select_tree(torch.cat(self.tokens, 1), torch.cat(self.scores, 1),
                                        torch.cat(self.parents, 1), num_draft_tokens, self.depth)


class PoolConstants(NamedTuple):
    """What every draft's candidate pool starts from: the root's score (+inf) and parent (-1) [B, 1]; the first
    frontier's candidate indices 1 .. k and parents (the root) [B, k], and its ancestor mask, each node itself
    [B, k, k]."""

    root_score: Tensor
    root_parent: Tensor
    first_nodes: Tensor
    first_parents: Tensor
    first_ancestors: Tensor


@functools.cache
def _pool_constants(B: int, k: int, device: torch.device) -> PoolConstants:
    """The same every draft, so made once (five launches less a draft). Nothing writes them."""
    return PoolConstants(torch.full((B, 1), float("inf"), device=device),
                         torch.full((B, 1), -1, dtype=torch.long, device=device),
                         torch.arange(1, k + 1, device=device).expand(B, k),
                         torch.zeros(B, k, dtype=torch.long, device=device),
                         torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k))


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """parents [B, n] (-1 = root) -> [B, n, n] bool, [i, j] iff j is i or an ancestor of i.

    Each round extends every row by its parent's row: after `max_depth` rounds all paths are complete.
    """
    B, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(B, n, n)
    has_parent = (parents >= 0)[:, :, None]
    index = parents.clamp(min=0)[:, :, None].expand(B, n, n)
    mask = eye
    for _ in range(max_depth):
        mask = eye | (mask.gather(1, index) & has_parent)
    return mask


def root_only(roots: Tensor) -> DraftTree:
    """roots [B] -> the one-node trees of plain decoding: verifying one samples the next token."""
    return DraftTree(roots[:, None], *_root_only_shape(roots.shape[0], roots.device))


@functools.cache
def _root_only_shape(rows: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The one-node trees' parents, depths and masks: the same every plain decode step, so made once (three
    launches less of host time a step, which bounds a small model's plain step). Nothing writes them."""
    return (torch.full((rows, 1), -1, dtype=torch.long, device=device), torch.zeros(rows, 1, dtype=torch.long,
            device=device), torch.ones(rows, 1, 1, dtype=torch.bool, device=device))
