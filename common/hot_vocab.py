"""The hot vocabulary: the target token ids a draft head can emit, one abstraction for EAGLE-3's
`d2t`/`t2d` and FR-Spec's token maps.

Everything derives from `hot_ids [draft_vocab]`, the target id of each draft index (the row order of
the draft's lm_head). Worked example, target vocab 8, hot ids [1, 2, 5]:

    hot_ids = [1, 2, 5]                  draft index i emits target id hot_ids[i]
    d2t     = [1, 1, 3]                  EAGLE-3 offset layout: target id = i + d2t[i]
    t2d     = [F, T, T, F, F, T, F, F]   True where a target id is in the draft vocab

Orders (the order is part of the trained head: it fixes which lm_head row means which token):
- EAGLE-3 orders by ascending target id, so `d2t` is non-decreasing. SpecForge builds it so
  (specforge/data/preprocessing.py, `process_token_dict_to_mappings`: top-N by count, then sorted) and
  its loss restricts target logits with the boolean mask, `target[..., t2d]` (specforge/core/eagle3.py),
  which yields columns in ascending id order; a head trained otherwise would be misread by any tool
  that rebuilds the order from `t2d`.
- FR-Spec token maps are most frequent first (thunlp/FR-Spec `fr/fr.py` saves `ids[:r]` of the count-
  sorted ids, with EOS swapped in last when it is not among them), so a prefix of a map is a smaller map.
Consumers accept any order: SGLang reads `hot_token_id = d2t + arange` (python/sglang/srt/models/
llama_eagle3.py) and vLLM scatters draft logits to `arange + d2t` (vllm/model_executor/models/
llama_eagle3.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from .checkpoint import CheckpointError, load_weights_only


class HotVocabError(ValueError):
    """A hot vocabulary is malformed; the message names the source (tensor or file) and the problem."""


def _as_id_tensor(ids: Tensor, source: str) -> Tensor:
    """Checks that `ids` is a non-empty 1-D integer tensor; returns it as int64."""
    if ids.dim() != 1 or ids.numel() == 0:
        raise HotVocabError(
            f"{source}: expected a non-empty 1-D tensor of token ids, got shape {tuple(ids.shape)}"
        )
    # Floats are refused, not rounded: an index map cast with the weights (bf16 holds integers
    # exactly only up to 256) would silently point at other tokens.
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise HotVocabError(f"{source}: token ids must be an integer tensor, got dtype {ids.dtype}")
    return ids.to(torch.int64)


class HotVocab:
    """`hot_ids [draft_vocab]` (int64 target ids, in draft-index order) of a target vocab of `vocab_size`."""

    def __init__(self, hot_ids: Tensor, vocab_size: int, *, source: str = "hot_ids"):
        # `source` only names where the ids came from in error messages (a file, "d2t", ...).
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise HotVocabError(f"{source}: vocab_size must be a positive int, got {vocab_size!r}")
        hot_ids = _as_id_tensor(hot_ids, source)
        bad = ((hot_ids < 0) | (hot_ids >= vocab_size)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise HotVocabError(
                f"{source}: {bad.numel()} id(s) outside the target vocab [0, {vocab_size}), "
                f"first at draft index {i}: target id {int(hot_ids[i])}"
            )
        ids, counts = hot_ids.unique(return_counts=True)
        if (counts > 1).any():
            dup = ids[counts > 1]
            where = (hot_ids == dup[0]).nonzero().flatten().tolist()
            raise HotVocabError(
                f"{source}: {dup.numel()} duplicated target id(s), e.g. {dup[:5].tolist()}; "
                f"target id {int(dup[0])} is at draft indices {where}"
            )
        self.hot_ids = hot_ids
        self.vocab_size = vocab_size

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_d2t(cls, d2t: Tensor, vocab_size: int) -> HotVocab:
        """From an EAGLE-3 `d2t [draft_vocab]` offset tensor: target id = i + d2t[i]."""
        d2t = _as_id_tensor(d2t, "d2t")
        return cls(d2t + torch.arange(d2t.numel(), device=d2t.device), vocab_size, source="d2t")

    @classmethod
    def from_token_map(
        cls, token_map: Sequence[int] | Tensor, vocab_size: int, *, source: str = "token map"
    ) -> HotVocab:
        """From an FR-Spec token map: target ids, most frequent first (a list or a 1-D tensor)."""
        if not isinstance(token_map, Tensor):
            try:  # no dtype given: a list of floats must fail the integer check, not be truncated
                token_map = torch.tensor(list(token_map))
            except (TypeError, ValueError, RuntimeError) as e:
                raise HotVocabError(f"{source}: not a flat list of token ids ({e})") from None
        return cls(token_map, vocab_size, source=source)

    @classmethod
    def from_counts(
        cls, counts: Tensor, size: int, order: Literal["by_id", "by_frequency"] = "by_id"
    ) -> HotVocab:
        """The `size` most frequent ids of `counts [vocab]`; ties go to the lower id, so the result is
        deterministic (zero-count ids fill up from the lowest id when fewer than `size` ids were seen).

        order="by_id" (default): ascending target id, the EAGLE-3 convention a head is trained in.
        order="by_frequency": most frequent first, the FR-Spec token map convention.

        Example: counts [5, 0, 9, 5, 1], size 3 -> top ids 2 (9), 0 (5), 3 (5; ties with 0, loses to it)
        -> by_id [0, 2, 3], by_frequency [2, 0, 3].
        """
        if counts.dim() != 1 or counts.dtype == torch.bool or counts.dtype.is_complex:
            raise HotVocabError(
                f"counts: expected a 1-D real tensor [vocab], "
                f"got dtype {counts.dtype} shape {tuple(counts.shape)}"
            )
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= counts.numel():
            raise HotVocabError(f"counts: size must be an int in [1, {counts.numel()}], got {size!r}")
        if order not in ("by_id", "by_frequency"):
            raise HotVocabError(f"counts: order must be 'by_id' or 'by_frequency', got {order!r}")
        # A stable descending sort keeps equal counts in ascending id order: the lower id wins a tie.
        top = torch.sort(counts, descending=True, stable=True).indices[:size]  # [size]
        if order == "by_id":
            top = top.sort().values
        return cls(top, counts.numel(), source="counts")

    # ---- files --------------------------------------------------------------------------------

    def save_token_map(self, path: str | Path) -> None:
        """Writes an FR-Spec `freq_N.pt`: a `torch.save`d Python list of target ids in draft-index order
        (most frequent first when built with order="by_frequency"). A list, as FR-Spec's fr/fr.py writes;
        SGLang's `load_token_map` reads it with `torch.load(weights_only=True)` and `torch.tensor`."""
        torch.save(self.hot_ids.tolist(), path)

    @classmethod
    def load_token_map(cls, path: str | Path, vocab_size: int) -> HotVocab:
        """Reads an FR-Spec token map file, a list of ids or a 1-D integer tensor."""
        try:
            token_map = load_weights_only(path)
        except CheckpointError as e:  # JSON, numpy, a truncated file...
            raise HotVocabError(f"token map {path}: not a torch.save'd list of token ids ({e})") from e
        if not isinstance(token_map, (list, tuple, Tensor)):
            raise HotVocabError(
                f"token map {path}: expected a list or 1-D tensor of token ids, "
                f"got {type(token_map).__name__}"
            )
        return cls.from_token_map(token_map, vocab_size, source=f"token map {path}")

    # ---- derived views ------------------------------------------------------------------------

    @property
    def draft_vocab_size(self) -> int:
        return self.hot_ids.numel()

    @property
    def d2t(self) -> Tensor:
        """int64 `[draft_vocab]` offsets, target id = i + d2t[i] (the SGLang/vLLM/SpecForge layout)."""
        return self.hot_ids - torch.arange(self.draft_vocab_size, device=self.hot_ids.device)

    @cached_property
    def t2d(self) -> Tensor:
        """bool `[vocab]`, True where a target id is in the draft vocab (built once: training reads it every step)."""
        in_draft = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.hot_ids.device)
        in_draft[self.hot_ids] = True
        return in_draft

    # ---- mapping ------------------------------------------------------------------------------

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft indices (any shape, in [0, draft_vocab)) -> target ids, same shape."""
        return self.hot_ids[draft_ids]

    def restrict_logits(self, target_logits: Tensor) -> Tensor:
        """`[..., vocab]` target logits -> `[..., draft_vocab]`, column i being target id hot_ids[i]
        (the soft-label distribution that lines up with the draft's lm_head rows)."""
        if target_logits.shape[-1] != self.vocab_size:
            raise HotVocabError(
                f"restrict_logits: last dim is {target_logits.shape[-1]}, "
                f"expected the target vocab {self.vocab_size}"
            )
        return target_logits.index_select(-1, self.hot_ids)

    def to(self, device: torch.device | str) -> HotVocab:
        """A copy on `device` (the inverse index is rebuilt there on first use)."""
        return HotVocab(self.hot_ids.to(device), self.vocab_size)

    def __repr__(self) -> str:
        device = self.hot_ids.device
        return f"HotVocab(draft_vocab={self.draft_vocab_size}, vocab={self.vocab_size}, device={device})"
