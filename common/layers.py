"""Building blocks of the Llama-family decoder, shared by the target model and the draft heads.

Parameter names follow Hugging Face (`self_attn.q_proj`, `mlp.gate_proj`, ...) so checkpoints
load key for key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import AttentionMetadata
from .config import RopeConfig


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x [..., dim] -> norm(x); weight None is a unit weight (one folded into the next projection: `fold_norm`)."""
    # Normalise in fp32, scale in the input dtype (as every Llama-family reference does).
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed


def norm_cat(a: Tensor, b: Tensor, norm_a: tuple[Tensor, float], norm_b: tuple[Tensor, float]) -> Tensor:
    """cat(norm_a(a), norm_b(b)) on the last dim, two RMSNorms' (weight, eps): a, b [..., H] -> [..., 2H] (the
    EAGLE-3 layer's input, its token embeddings and hidden states side by side)."""
    return torch.cat([rms_norm(a, *norm_a), rms_norm(b, *norm_b)], dim=-1)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, H, D]; cos, sin [B, T, D]. Rotates the two halves of D (the HF / GGUF-converted layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def fused_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                 norm: tuple[Tensor | None, float] | None = None, silu_mul_output: bool = False,
                 residual: Tensor | None = None, donate_residual: bool = False) -> Tensor:
    """residual + epilogue(linear(norm(x))): a projection with what comes before and after it, one kernel where
    fused (at one token, `eyas.serve.kernels.fused_linear`). `norm`: an RMSNorm's (weight, eps) applied to x first;
    `silu_mul_output`: SiLU·mul of the output's two halves (a joint gate/up projection); `residual`: the residual
    stream the output is added to (a sublayer's output projection), which with `donate_residual` the caller gives
    up, so that a kernel may write the sum into it. x [..., K], weight [N, K], residual [..., N] -> [..., N]
    ([..., N / 2] with silu_mul_output)."""
    if norm is not None:
        x = rms_norm(x, *norm)
    y = F.linear(x, weight, bias)
    if silu_mul_output:
        y = silu_mul(*y.chunk(2, dim=-1))
    return y if residual is None else residual + y


@dataclass(frozen=True)
class Kernels:
    """The elementwise work of a layer. Modules that have a `kernels` attribute call it; these torch versions are
    the reference; the server swaps in fused Triton ones from outside (`eyas.serve.kernels.install`), and the trainer
    compiled ones (`eyas.train.ttt.training_kernels`), leaving the model as is (`use_kernels`)."""

    rms_norm: Callable = rms_norm
    rotary: Callable = lambda q, k, cos, sin: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))
    silu_mul: Callable = silu_mul
    linear: Callable = fused_linear
    norm_cat: Callable = norm_cat


def use_kernels(model: nn.Module, kernels: Kernels) -> None:
    """Makes every layer of `model` (each module with a `kernels` attribute) call `kernels`."""
    for module in model.modules():
        if isinstance(getattr(module, "kernels", None), Kernels):
            module.kernels = kernels


class RMSNorm(nn.Module):
    kernels = Kernels()

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    @property
    def spec(self) -> tuple[Tensor | None, float]:
        """(weight, eps): the form `rms_norm` and the fused kernels take a norm in (weight None once folded)."""
        return self.weight, self.eps

    def forward(self, x: Tensor) -> Tensor:
        """x [..., dim] -> norm(x) (`rms_norm`)."""
        return self.kernels.rms_norm(x, *self.spec)


def norm_spec(norm: RMSNorm | None) -> tuple[Tensor | None, float] | None:
    """`RMSNorm.spec`, or None without a norm: `Kernels.linear`'s `norm`."""
    return None if norm is None else norm.spec


@torch.no_grad()
def fold_norm(norm: RMSNorm, proj: nn.Linear) -> None:
    """Inference: `norm`'s weight g multiplied into the input columns of `proj`, the one projection it feeds
    (W' = W · diag(g), rounded once to W's dtype), the norm keeping its eps and a unit weight (None). What is left of
    the norm is then a per-row scale, 1 / RMS(x), which commutes with the matmul: the served kernels can scale the
    product of the stream itself (cuBLAS's) where a separate launch would otherwise normalise it first. The rounding
    moves greedy bf16 text no further from fp32 than bf16 itself does (docs/perf.md, thirty-second entry).
    Idempotent."""
    if norm.weight is not None:
        proj.weight.mul_(norm.weight)  # computed in fp32 (torch's half-type arithmetic), no fp32 copy of W
        norm.weight = None


def fold_layer_norms(layer: nn.Module) -> None:
    """Inference, after `fuse_projections`: a decoder layer's norm weights folded (`fold_norm`) into the joint
    projections they feed: `input_layernorm` (where the layer has one) into q/k/v, `post_attention_layernorm` into
    gate/up. Idempotent."""
    attention, mlp = layer.self_attn, layer.mlp
    assert attention.qkv_proj is not None and mlp.gate_up_proj is not None, "fuse_projections first"
    if layer.input_layernorm is not None:
        fold_norm(layer.input_layernorm, attention.qkv_proj)
    fold_norm(layer.post_attention_layernorm, mlp.gate_up_proj)


def rope_inv_freq(rope: RopeConfig, head_dim: int, device: torch.device | str | None = None) -> Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with `linear` or `llama3` scaling applied."""
    inv_freq = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        interpolated = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(is_medium, interpolated, inv_freq)
    return inv_freq


class Rotary(nn.Module):
    """cos/sin tables for explicit positions; the inverse frequencies are rebuilt, never loaded."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)

    def reset_parameters(self, device: torch.device | str | None = None):
        """Recomputes `inv_freq` (after a meta-device build)."""
        self.inv_freq = rope_inv_freq(self.rope, self.head_dim, device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, T] int -> cos, sin [B, T, D] in `dtype` (angles computed in fp32)."""
        angles = positions[..., None].float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def tables(self, positions: Tensor | tuple[Tensor, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """`forward`, or `positions` itself when it already is the pair (cos, sin) [B, T, D]: a caller running several
        passes (the drafter, once per tree) computes all of theirs in one call."""
        return positions if isinstance(positions, tuple) else self(positions, dtype)


class Attention(nn.Module):
    """Grouped-query attention. `in_features` differs from the model width in the EAGLE-3 head (2H)."""

    kernels = Kernels()

    def __init__(
        self,
        in_features: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        # Qwen3: RMSNorm over each head's q and k, before rotary.
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.qkv_proj: nn.Linear | None = None  # set by `fuse_projections`

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionMetadata, layer: int, *,
                norm: RMSNorm | None = None, residual: Tensor | None = None) -> Tensor:
        """x [B, T, in_features] -> residual + attention(norm(x)) [B, T, hidden] (without `residual`, the attention
        alone). The norm goes into the q/k/v projection's kernel, the add into the output projection's
        (`Kernels.linear`)."""
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            qkv = self.kernels.linear(x, self.qkv_proj.weight, self.qkv_proj.bias, norm=norm_spec(norm))
            kv = self.num_kv_heads * self.head_dim
            q, k, v = qkv.split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        else:
            x = x if norm is None else norm(x)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attn.attend_rotary(layer, q, k, v, cos, sin, self.kernels.rotary)  # [B, T, Hq, D]
        return self.kernels.linear(out.reshape(B, T, -1), self.o_proj.weight, self.o_proj.bias, residual=residual)


class MLP(nn.Module):
    kernels = Kernels()

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up_proj: nn.Linear | None = None  # set by `fuse_projections`

    def forward(self, x: Tensor, *, norm: RMSNorm | None = None, residual: Tensor | None = None) -> Tensor:
        """x [..., hidden] -> residual + mlp(norm(x)), as `Attention.forward`. The caller gives `residual` up: the
        sum may be written into it (in place of a copy, where cuBLAS adds)."""
        if self.gate_up_proj is not None:
            h = self.kernels.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias, norm=norm_spec(norm),
                                    silu_mul_output=True)
        else:
            x = x if norm is None else norm(x)
            h = self.kernels.silu_mul(self.gate_proj(x), self.up_proj(x))
        return self.kernels.linear(h, self.down_proj.weight, self.down_proj.bias, residual=residual,
                                   donate_residual=True)


def _joint_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear computing `parts` side by side: their weights (and biases) stacked along the output."""
    first = parts[0]
    joint = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device="meta")
    joint.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    if first.bias is not None:
        joint.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return joint


@torch.no_grad()
def fuse_projections(model: nn.Module) -> None:
    """Inference: each attention's q, k and v projections become one matmul, each MLP's gate and up another. At
    a decode step's few tokens every projection is a memory-bound read of its weight, and three small reads
    cost more launches and tail time than one large one. The separate Linears are dropped (the state dict
    changes: not for training or saving); idempotent."""
    for module in model.modules():
        if isinstance(module, Attention) and module.qkv_proj is None:
            module.qkv_proj = _joint_linear([module.q_proj, module.k_proj, module.v_proj])
            module.q_proj = module.k_proj = module.v_proj = None
        elif isinstance(module, MLP) and module.gate_up_proj is None:
            module.gate_up_proj = _joint_linear([module.gate_proj, module.up_proj])
            module.gate_proj = module.up_proj = None
