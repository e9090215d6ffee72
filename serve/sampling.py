"""Per-request sampling parameters and the target distribution they define.

`target_probs` is the distribution the target samples from on its own; speculative verification
(`verify.py`) must reproduce it exactly, so both paths use this one function.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

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
    seed: int | None = None  # the request's draws (`position_uniforms`); None: one drawn from torch's generator

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be an int64 or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


# splitmix64's constants (Steele et al., "Fast splittable pseudorandom number generators", 2014), as int64.
_GAMMA, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def request_seed(params: SamplingParams) -> int:
    """A sampled request's seed: its own, or one drawn from torch's generator (torch.manual_seed makes a run repeat);
    0 for a greedy one, which draws nothing."""
    if params.greedy:
        return 0
    return params.seed if params.seed is not None else int(torch.randint(-(2**63), 2**63 - 1, ()))


def for_prompt(params: SamplingParams, prompt: object) -> SamplingParams:
    """A run's `params` for one of its prompts (a conversation or token ids: whatever JSON writes). With a run seed
    (the tools' --seed) the prompt gets a seed of its own, the first 8 bytes of SHA-256 over both: each prompt draws
    other numbers, and draws them again whenever the run is repeated, with speculation on or off, at any batch size or
    concurrency, in-process or through an endpoint (draws are keyed to the seed and position: `position_uniforms`).
    Without a seed, or greedy, `params` as they are."""
    if params.seed is None or params.greedy:
        return params
    digest = hashlib.sha256(json.dumps([params.seed, prompt], sort_keys=True).encode()).digest()
    return replace(params, seed=int.from_bytes(digest[:8], "little", signed=True))


def position_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """seeds [B] int64, positions [B, ...] int64 -> [B, ...] float64 uniforms in [0, 1), 53 bits each: splitmix64's
    output for the state seed + (position + 1) * gamma. Counter-based: a request's draw at a position is the same
    whatever was drawn before it, so its sampled tokens do not depend on the trees, batches or plain steps that
    produced them. int64 arithmetic wraps (as the generator's unsigned arithmetic does); `_shifted` keeps shifts
    logical. A few launches of [B, N] integers, so the engine keeps them in its graphs."""
    z = seeds.long().view(-1, *(1,) * (positions.dim() - 1)) + (positions.long() + 1) * _GAMMA
    z = (z ^ _shifted(z, 30)) * _MIX1
    z = (z ^ _shifted(z, 27)) * _MIX2
    z = z ^ _shifted(z, 31)
    return _shifted(z, 11).double() * 2.0**-53


def _shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z >> bits, filling with zeros (torch shifts int64 arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs [..., V] (non-negative, each row some mass, unnormalised), uniforms [...] in [0, 1)
    -> tokens [...], the first token whose cumulative mass exceeds uniform * the row's mass. In float64, with
    53-bit uniforms: a float32 sum over 128,256 softmax probabilities moves 7e-4 to 9e-4 of their mass between
    tokens (total variation against an exact sum, docs/perf.md forty-fourth entry)."""
    V = probs.shape[-1]
    cdf = probs.reshape(-1, V).double().cumsum(-1)  # [R, V]
    total = cdf[:, -1:].contiguous()
    tokens = torch.searchsorted(cdf, uniforms.reshape(-1, 1).double() * total, right=True)
    # Rounding can put uniform * mass at the total: then the first token where the cdf reaches it, one with mass (the
    # cdf rises there), never a zeroed one.
    return torch.minimum(tokens, torch.searchsorted(cdf, total)).view(uniforms.shape)


@dataclass(frozen=True)
class SamplingRows:
    """Each batch row's sampling parameters on the device, as `target_probs` and the CUDA graphs take them.

    values [4, B] float32: temperature, greedy (1 or 0), top-k (the vocabulary's size when off) and top-p; one copy
    to the device, queued, not waited for. float32 holds each exactly: top-k is at most the vocabulary (< 2**24),
    and greedy is decided on the host, where a temperature like 1e-6 is still itself.
    any_top_k / any_top_p / any_greedy: whether some row keeps fewer than all tokens by top-k, by top-p, or is
    greedy; known on the host, so each one's work is queued only when a row needs it (and CUDA graphs are captured
    per combination). Most requests set top-p alone; their floor then skips top-k's search."""

    values: torch.Tensor
    any_top_k: bool
    any_top_p: bool
    any_greedy: bool

    def narrow(self, start: int, length: int) -> SamplingRows:
        """Rows start .. start + length - 1 (fewer past the end); the flags stay the whole batch's (a filter no row
        of these asks for keeps every token)."""
        return SamplingRows(self.values[:, start : start + length], self.any_top_k, self.any_top_p, self.any_greedy)

    @classmethod
    def of(cls, params: SamplingParams | Sequence[SamplingParams], rows: int, vocab: int,
           device: torch.device | str) -> SamplingRows:
        """`params`: one SamplingParams for all `rows`, or one per row."""
        plist = [params] * rows if isinstance(params, SamplingParams) else list(params)
        if len(plist) != rows:
            raise ValueError(f"got {len(plist)} SamplingParams for {rows} rows")
        top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in plist]  # any int: no overflow
        values = torch.tensor([[p.temperature for p in plist], [float(p.greedy) for p in plist], top_k,
                               [p.top_p for p in plist]], dtype=torch.float32)
        return cls(to_device(values, device), any(k < vocab for k in top_k), any(p.top_p < 1 for p in plist),
                   any(p.greedy for p in plist))


# The most logits `draw` turns into probabilities at once. Each takes about 30 bytes of temporaries there, by the
# code (float32 probabilities filtered and renormalised, the float64 CDF): a 48-node tree's verification at 64
# requests over a 128k vocabulary, drawn whole, ran an H100 out of memory while serve-eagle warmed up (docs/perf.md,
# sixtieth entry).
DRAW_ENTRIES = 1 << 25


def draw(logits: torch.Tensor, rows: SamplingRows, seeds: torch.Tensor, positions: torch.Tensor,
         kernels: ProbsKernels | None = None) -> torch.Tensor:
    """The target's token after each position: logits [B, ..., V] (any float dtype), seeds [B] int64, positions
    [B, ...] int64 (whose logits these are) -> tokens [B, ...], each drawn by inverse CDF from `target_probs` with the
    seed's uniform at that position (`position_uniforms`): what the engine emits there, whatever the tree or batch.
    Requests are drawn a group at a time, each group's logits within DRAW_ENTRIES (a request's own rows stay
    together): the same draws, in bounded memory."""
    uniforms = position_uniforms(seeds, positions)
    group = max(1, DRAW_ENTRIES // logits[0].numel())  # requests a group
    drawn = [sample(target_probs(logits[i : i + group], rows.narrow(i, group), kernels), uniforms[i : i + group])
             for i in range(0, len(logits), group)]
    return drawn[0] if len(drawn) == 1 else torch.cat(drawn)  # one group (a batch-1 step): no copy


class ProbsKernels(NamedTuple):
    """What `target_probs` computes with: the torch references below (`TORCH_PROBS`), or the Triton kernels that
    equal them (`eyas.serve.step_kernels.PROBS`, the engine's on CUDA)."""

    softmax: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    nucleus_floor: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
    row_sum: Callable[[torch.Tensor], torch.Tensor]


def target_probs(logits: torch.Tensor, rows: SamplingRows, kernels: ProbsKernels | None = None) -> torch.Tensor:
    """logits [B, ..., V] -> float32 probabilities [B, ..., V]: temperature, then top-k, then top-p,
    renormalised. Greedy rows (temperature below GREEDY_BELOW) become one-hot at the argmax.

    Each row's parameters (`rows`, B of them) broadcast as [B, 1, ..., 1]: mixed batches run in one vectorised
    pass, no loop over rows, and nothing is read on the host (the engine captures this in a CUDA graph).
    Both filters keep every token at least as likely as a floor (`nucleus_floor`): top-k the k most likely tokens,
    top-p then the most likely ones whose mass reaches top_p (always at least one token). A tie at the floor is
    kept whole, so top-k may keep more than k tokens.
    """
    kernels = kernels or TORCH_PROBS
    shape, V = logits.shape, logits.shape[-1]
    temp, greedy, top_k, top_p = rows.values.reshape(4, shape[0], *(1,) * (logits.dim() - 1))
    greedy = greedy > 0

    def per_row(v: torch.Tensor) -> torch.Tensor:  # [B, 1, ..., 1] -> [R]: one entry per row of V logits
        return v.expand(*shape[:-1], 1).reshape(-1)

    probs = kernels.softmax(logits.reshape(-1, V), per_row(torch.where(greedy, 1.0, temp))).view(shape)
    if rows.any_top_k or rows.any_top_p:
        least = kernels.nucleus_floor(probs.reshape(-1, V), per_row(top_k) if rows.any_top_k else None,
                                      per_row(top_p) if rows.any_top_p else None).view(*shape[:-1], 1)
        probs = torch.where(probs >= least, probs, 0.0)
        probs = probs / kernels.row_sum(probs.reshape(-1, V)).view(*shape[:-1], 1)
    if rows.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def softmax(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(x / temperature) over the last dim: x [R, V], temperature [R] float32 -> float32 [R, V]."""
    return (x.float() / temperature[:, None]).softmax(-1)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] float32 -> [R], each row's sum."""
    return x.sum(-1)


def nucleus_floor(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """The least probability each row keeps: probs [R, V] float32, top_k [R] (the vocabulary or more: off) and
    top_p [R] (1: off), both float32 (None: off in every row) -> [R] float32. The k-th largest probability (0 when
    top-k is off); then, with top-p on, the largest floor whose tokens (among those top-k keeps) hold at least
    top_p of their mass.

    Worked example: probs [0.5, 0.2, 0.2, 0.1], top_k 3: floor 0.2 (three tokens kept); with top_p 0.6 as well,
    the kept mass is 0.9, so 0.54 must stay: 0.5 alone holds less, 0.5 + both 0.2s more, so floor 0.2 again."""
    R, V = probs.shape
    top_k = torch.full((R,), V, device=probs.device) if top_k is None else top_k
    top_p = torch.ones(R, device=probs.device) if top_p is None else top_p
    ps = probs.sort(-1, descending=True).values  # [R, V]
    by_k = torch.where(top_k < V, ps.gather(-1, (top_k.clamp(1, V) - 1).long()[:, None])[:, 0], 0.0)
    mass = torch.where(ps >= by_k[:, None], ps, 0.0).cumsum(-1)  # [R, V]
    first = (mass < top_p[:, None] * mass[:, -1:]).sum(-1, keepdim=True).clamp(max=V - 1)  # first to reach the goal
    return torch.where(top_p < 1, ps.gather(-1, first)[:, 0], by_k)


TORCH_PROBS = ProbsKernels(softmax, nucleus_floor, row_sum)
