"""Running the draft head inside the engine: extending its KV with accepted tokens, and drafting a tree.

Alignment (the same as training's `train/ttt.py`): draft position p reads the target's state at
position p and the token at position p + 1. After a verification the target has cached positions
0..n-1 and holds the bonus token (the next root) for position n; the draft has then been extended to
position n-1, and its output there gives the root's candidate children. A frontier node at depth d
(its token at target position n + d) runs at draft position n - 1 + d, attending to the draft's prefix
and the drafted ancestors of this step's tree.

Shapes: B requests, k = topk, H = draft hidden, Vd = draft vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from eyas.common.head_checkpoint import DraftHead
from eyas.common.target import TargetModel, TargetOutput

from .attention.paged import PagedAttention, slots_of
from .cuda_graphs import GraphCache
from .kv_cache import KVPool
from .rope import RopeTable
from .tree import DraftKernels, DraftTree, TreeBuilder, gather_rows


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2 tree settings: `num_steps` draft passes (tree depth), `topk` branching, `num_draft_tokens`
    nodes verified (root included). topk = 1 gives a chain of at most num_steps + 1 nodes."""

    num_steps: int = 5
    topk: int = 4
    num_draft_tokens: int = 8

    def __post_init__(self):
        if min(self.num_steps, self.topk) < 1 or self.num_draft_tokens < 2:
            raise ValueError(f"tree needs num_steps, topk >= 1 and num_draft_tokens >= 2, got {self}")
        most = 1 + self.topk + (self.num_steps - 1) * self.topk**2
        if self.num_draft_tokens > most:
            raise ValueError(f"num_draft_tokens {self.num_draft_tokens} exceeds the {most} candidates of {self}")

    @property
    def scratch(self) -> int:
        """Draft KV slots a step needs beyond the prefix: one per drafted frontier node."""
        return self.topk * (self.num_steps - 1)


@dataclass
class DraftState:
    """Per request, after an extension: the draft's output at the last position."""

    hidden: Tensor  # [H] the next step's hidden input for the root's children
    logits: Tensor  # [Vd] draft logits of the root's children


def draft_states(hidden: Tensor, logits: Tensor) -> list[DraftState]:
    """hidden [B, H], logits [B, Vd] -> one state per row (views)."""
    return [DraftState(h, x) for h, x in zip(hidden.unbind(), logits.unbind(), strict=True)]


class Drafter:
    """The head inside the engine. With `graphs` enabled, `draft_tree` replays CUDA graphs and the engine
    captures `extend` in its accept phase's graph; their inputs are then padded to fixed shapes by the engine."""

    def __init__(self, head: DraftHead, target: TargetModel, pool: KVPool, attention: type[PagedAttention],
                 graphs: GraphCache, kernels: DraftKernels, rope: RopeTable):
        self.head, self.target, self.pool, self.attention = head, target, pool, attention
        self.graphs = graphs
        self.rope = rope  # the head's rotary tables, looked up in the decode step's graphs
        self.kernels = kernels  # the torch references of `tree`, or the fused kernels
        self.hot = head.hot_vocab.to(target.embed_tokens.weight.device)
        # The target's embedding rows of the draft vocabulary [Vd, H], gathered once (262 MB more for Llama-3.1-8B
        # with 32k draft tokens), so a pass embeds its drafted tokens in one lookup, not two; the table itself where
        # the draft vocabulary is the target's, in order.
        embeddings, hot_ids = target.embed_tokens.weight, self.hot.hot_ids
        identity = torch.equal(hot_ids, torch.arange(len(embeddings), device=hot_ids.device))
        self.draft_embeddings = embeddings if identity else embeddings[hot_ids]

    def extend(self, target_out: TargetOutput, next_tokens: Tensor, start: Tensor, last: Tensor, table: Tensor,
               rope: tuple[Tensor, Tensor], new_slots: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Feeds the draft the target's states at positions start .. start+T-1 of each request; a pure tensor
        function (no host reads), so decode steps capture it with the rest of their accept phase.

        target_out: hidden / aux [B, T, ·] at those positions (columns past `last` are padding, their KV lands in
        the request's reserved positions); next_tokens [B, T]: the token at position p + 1 for each p; start [B];
        last [B] each request's last extended index (its length - 1); table [B, M] the requests' blocks; rope, the
        head's rotary tables (cos, sin) [B, T, D] of those positions; new_slots [B, T] their cache slots; mask [T, T]
        causal. Returns the draft's output hidden [B, H] and logits [B, Vd] at each request's last extended position
        (`draft_states` makes them per-request states).
        """
        B, T = next_tokens.shape
        attn = self.attention(self.pool, table, start, mask.expand(B, T, T), new_slots=new_slots)
        embeds = self.target.embed_tokens(next_tokens)
        features = self.head.project_target(target_out)
        out = self.head.step(embeds, features, rope, attn)  # [B, T, H]
        hidden = gather_rows(out, last[:, None])[:, 0]  # [B, H]
        return hidden, self.head.logits(hidden)  # [B, H], [B, Vd]

    def draft_tree(self, shape: TreeShape, roots: Tensor, hidden: Tensor, logits: Tensor, lengths: Tensor,
                   table: Tensor) -> DraftTree:
        """roots [B'] target ids at positions `lengths` (n); table [B', M] blocks covering n + scratch; hidden [B, H]
        and logits [B, Vd] the draft's states after its extension (`extend`), B <= B' (the rest are padding rows).
        Returns the tree to verify, tokens as target ids."""
        if len(hidden) < len(roots):  # padding rows draft from zeros; their trees are ignored
            pad = len(roots) - len(hidden)
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
            logits = torch.cat([logits, logits.new_zeros(pad, logits.shape[1])])
        draft = functools.partial(self._draft_chain if shape.topk == 1 else self._draft_tree, shape)
        return DraftTree(*self.graphs(f"draft {shape}", draft, roots, hidden, logits, lengths, table))

    def _draft_tree(self, shape: TreeShape, roots: Tensor, hidden: Tensor, logits: Tensor, lengths: Tensor,
                    table: Tensor):
        k = shape.topk
        B = len(roots)
        top_log_probs = self.kernels.top_log_probs
        builder = TreeBuilder(roots, k, self.kernels)
        tokens = builder.first(*top_log_probs(logits, k))  # [B, k] draft indices
        outputs, rows = hidden[:, None], None  # the frontier's parents' outputs: [B, R, H] and each node's row
        # Drafted node j (in drafting order) keeps its KV at position n + j; pass d drafts nodes k(d-1) .. kd-1, at
        # draft position n - 1 + d. Looked up once for all passes: slots [B, scratch], rotary tables [B, num_steps - 1,
        # D] of pass d at column d - 1.
        prefix = lengths.to(torch.int32)
        slots = slots_of(table, lengths[:, None] + _offsets(shape.scratch, roots.device), self.pool.block_size)
        cos, sin = self.rope(lengths[:, None] + _offsets(shape.num_steps - 1, roots.device))
        for depth in range(1, shape.num_steps):
            # The window is the nodes drafted so far; the frontier (the last k) sees its drafted ancestors.
            rope = tuple(x[:, depth - 1, None].expand(B, k, -1) for x in (cos, sin))  # the frontier's position
            outputs = self._pass(table, prefix, builder.frontier.ancestors, slots[:, k * (depth - 1) : k * depth], rope,
                                 tokens, outputs, rows)
            tokens = builder.extend(*top_log_probs(self.head.logits(outputs), k))
            rows = builder.frontier.rows
        tree = builder.finalize(shape.num_draft_tokens)
        return self._as_target(roots, tree.tokens[:, 1:]), tree.parents, tree.depth, tree.mask

    def _draft_chain(self, shape: TreeShape, roots: Tensor, hidden: Tensor, logits: Tensor, lengths: Tensor,
                     table: Tensor):
        """`_draft_tree` at topk 1: each pass drafts its frontier's best token. A child's score never exceeds its
        parent's, so the selection keeps the chain's first num_draft_tokens - 1 nodes (ties go to the first created):
        the tree's shape is fixed, and the pool's scores, its growth and the selection are left out (ten launches a
        (7, 1, 8) step, by the code), as are passes past the last kept node."""
        B, device = len(roots), roots.device
        nodes = min(shape.num_steps, shape.num_draft_tokens - 1)  # drafted nodes kept
        prefix = lengths.to(torch.int32)
        # Node j (1-based) keeps its KV at position n + j - 1, and pass j (j = 1 .. nodes - 1) runs on it there.
        positions = lengths[:, None] + _offsets(nodes - 1, device)  # [B, nodes - 1]
        slots = slots_of(table, positions, self.pool.block_size)
        cos, sin = self.rope(positions)
        tokens = [self.kernels.top_log_probs(logits, 1)[1]]  # [B, 1] each: the drafted nodes' tokens
        outputs = hidden[:, None]  # [B, 1, H] the last node's parent's output
        for depth in range(1, nodes):
            outputs = self._pass(table, prefix, _sees_all(B, depth, device), slots[:, depth - 1 : depth],
                                 (cos[:, depth - 1, None], sin[:, depth - 1, None]), tokens[-1], outputs, None)
            tokens.append(self.kernels.top_log_probs(self.head.logits(outputs), 1)[1][:, 0])
        return self._as_target(roots, torch.cat(tokens, dim=1)), *_chain(B, nodes + 1, device)

    def _pass(self, table: Tensor, prefix: Tensor, ancestors: Tensor, slots: Tensor, rope: tuple[Tensor, Tensor],
              tokens: Tensor, outputs: Tensor, rows: Tensor | None) -> Tensor:
        """One draft pass over a frontier of k nodes a request: their tokens [B, k] (draft indices) and their parents'
        outputs (`frontier_inputs` of outputs [B, R, H] at rows [B, k], or None: row 0), attending to the prefix and
        the drafted nodes `ancestors` [B, k, P] marks, their KV written at slots [B, k], at rotary tables rope
        [B, k, D] -> their outputs [B, k, H]."""
        attn = self.attention(self.pool, table, prefix, ancestors, new_slots=slots)
        embeds, hidden = self.kernels.frontier_inputs(tokens, self.draft_embeddings, outputs, rows)
        return self.head.step(embeds, hidden, rope, attn)

    def _as_target(self, roots: Tensor, drafted: Tensor) -> Tensor:
        """The tree's tokens as target ids: roots [B], then the drafted nodes [B, N - 1] (draft indices)."""
        return torch.cat([roots[:, None], self.hot.to_target(drafted)], dim=1)


@functools.cache
def _offsets(n: int, device: torch.device) -> Tensor:
    """torch.arange(n) on `device`: the same every draft, so made once (a launch less each). Nothing writes it."""
    return torch.arange(n, device=device)


@functools.cache
def _sees_all(B: int, depth: int, device: torch.device) -> Tensor:
    """A chain's frontier node at `depth` attends to every node drafted so far, itself included: [B, 1, depth] True.
    Made once a shape; nothing writes it."""
    return torch.ones(B, 1, depth, dtype=torch.bool, device=device)


@functools.cache
def _chain(B: int, n: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The chain of n nodes' parents [B, n] (-1, 0, 1, ...), depths [B, n] and ancestor mask [B, n, n] (lower
    triangular): the same every chain step, so made once. Nothing writes them."""
    index = torch.arange(n, device=device)
    mask = index[:, None] >= index[None, :]
    return (index.sub(1).expand(B, n).contiguous(), index.expand(B, n).contiguous(),
            mask.expand(B, n, n).contiguous())
