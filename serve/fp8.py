"""The draft head's weights in FP8 (`--draft-fp8`): half the bytes of the weights a draft pass reads.

At batch 1 a draft pass is a few rows against every weight of the head, so its time is its weights' bytes: at
Llama-3.1-8B's shape about 750 MB a pass in bf16 (q/k/v, o, gate/up, down and a 32,000-row lm_head). Here each
weight of the head's own linear layers is stored as float8 e4m3 values with a power-of-two scale per output row,
and the engine's one-row kernel reads those, as does its few-rows kernel at up to 16 rows of large weights
(`kernels.fused_linear` with an `Fp8Weights` table; `kernels.reads_fp8_rows` says why only those).

The head keeps one set of values. Each weight is replaced by its float8 values times their scale in the weight's own
dtype: an e4m3 value has 4 significant bits and a power-of-two scale moves only its exponent, so that is exact in
bf16 and fp32 (in fp16 too, but for weights below its normal range, 2^-14). Every path then computes with the same
weights: the kernels reading the float8 copy, prefill's matmuls over many rows reading the dequantized one, and the
torch reference on any device. The target still verifies every drafted token, so the served tokens are the same as
without it; how many are accepted may change. The head is changed in place (as `fuse_projections` changes it), after
`fuse_projections`, whose joint weights are the ones quantized. Weights the head borrows (an EAGLE-1/2 head's
lm_head, which is the target's) stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3 value


@dataclass(frozen=True)
class Fp8Weight:
    """weight [N, K] = values · scale[:, None]."""

    values: Tensor  # [N, K] float8 e4m3
    scale: Tensor  # [N] float32, powers of two


def quantize(weight: Tensor) -> Fp8Weight:
    """Each row scaled by the least power of two that brings its largest magnitude within e4m3's range, then rounded
    to nearest e4m3. (A power of two costs no precision: e4m3's relative step is the same across its normal range;
    only the smallest values, below 2^-9 of the range, flush to zero.)"""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / E4M3_MAX
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa · 2^exponent, mantissa in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(amax), exponent - (mantissa == 0.5).int())  # 2^ceil(log2 amax)
    return Fp8Weight((w / scale[:, None]).to(E4M3), scale)


def dequantize(weight: Fp8Weight, dtype: torch.dtype) -> Tensor:
    return (weight.values.float() * weight.scale[:, None]).to(dtype)


class Fp8Weights:
    """Which weights have a float8 copy, by the weight tensor itself (the kernels are handed `proj.weight`)."""

    def __init__(self):
        self._copies: dict[int, tuple[Tensor, Fp8Weight]] = {}

    def __len__(self) -> int:
        return len(self._copies)

    def add(self, weight: Tensor, copy: Fp8Weight) -> None:
        self._copies[id(weight)] = (weight, copy)  # the weight is held, so its id is not reused

    def get(self, weight: Tensor) -> Fp8Weight | None:
        weight_and_copy = self._copies.get(id(weight))
        return weight_and_copy[1] if weight_and_copy is not None and weight_and_copy[0] is weight else None


@torch.no_grad()
def quantize_linears(model: nn.Module) -> Fp8Weights:
    """Every `nn.Linear` of `model` gets its weight rounded as `quantize` rounds it (a new tensor of the same dtype:
    the old one may be shared); returns their float8 copies. Idempotent, as `fuse_projections` is: the table stays on
    the model and a second call returns it, so engines built over one head share its copies (new ones would replace
    the tensors that an earlier engine's CUDA graphs read, as `bench-eagle --repeats` keeps engines side by side)."""
    if (table := getattr(model, "fp8_copies", None)) is not None:
        return table
    table = Fp8Weights()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            copy = quantize(module.weight)
            module.weight = nn.Parameter(dequantize(copy, module.weight.dtype), requires_grad=False)
            table.add(module.weight, copy)
    model.fp8_copies = table
    return table
