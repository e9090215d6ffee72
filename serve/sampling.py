"""Per-request sampling parameters and the target distribution they define.

`target_probs` is the distribution the target samples from on its own; speculative verification
(`verify.py`) must reproduce it exactly, so both paths use this one function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .transfer import to_device

# A temperature below this is greedy: logits divided by it overflow float32 (inf, then NaN probabilities) long
# before the distribution would differ from one-hot (vLLM's threshold too).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    seed: int | None = None  # per-request generator seed (see `make_generator`); None = the shared one

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded from `params.seed`, or None (use the shared one). The engine keeps it for the
    request's whole life: re-seeding every step would reuse the same random numbers at each step."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def target_probs(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """logits [B, ..., V] -> float32 probabilities [B, ..., V]: temperature, then top-k, then top-p,
    renormalised. Greedy rows (temperature below GREEDY_BELOW) become one-hot at the argmax.

    `params` is one SamplingParams for every row, or a list of B (one per leading row). Per-row values
    become [B, 1, ..., 1] tensors, so mixed batches run in one vectorised pass, no loop over rows.
    Top-k keeps exactly k tokens (ties at the k-th logit broken by sort order); top-p then keeps the
    smallest prefix of the sorted distribution whose mass reaches top_p (always at least one token).
    """
    x = logits.float()
    V = x.shape[-1]
    if isinstance(params, SamplingParams):
        plist, shape = [params], ()
    else:
        plist, shape = list(params), (x.shape[0],) + (1,) * (x.dim() - 1)
        if len(plist) != x.shape[0]:
            raise ValueError(f"got {len(plist)} SamplingParams for {x.shape[0]} rows")

    def per_row(values, dtype):  # -> [] or [B, 1, ..., 1], broadcasting against x; queued, not waited for
        return to_device(torch.tensor(values, dtype=dtype), x.device).reshape(shape)

    temp = per_row([p.temperature for p in plist], torch.float32)
    greedy = per_row([p.greedy for p in plist], torch.bool)
    x = x / torch.where(greedy, 1.0, temp)
    top_k = per_row([min(p.top_k, V) if p.top_k > 0 else V for p in plist], torch.long)  # any int: no overflow
    top_p = per_row([p.top_p for p in plist], torch.float32)

    if any(0 < p.top_k < V or p.top_p < 1 for p in plist):
        # One sort serves both filters: temperature and top-k keep the logits' order.
        xs, order = x.sort(dim=-1, descending=True)  # [B, ..., V]
        rank = torch.arange(V, device=x.device)
        xs = xs.masked_fill(rank >= top_k, float("-inf"))
        ps = xs.softmax(-1)
        mass_before = ps.cumsum(-1) - ps  # mass of the strictly more likely tokens
        ps = ps.masked_fill((mass_before >= top_p) & (rank > 0), 0.0)
        probs = torch.zeros_like(ps).scatter_(-1, order, ps / ps.sum(-1, keepdim=True))
    else:
        probs = x.softmax(-1)
    if any(p.greedy for p in plist):  # known on the host: no device sync
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs
