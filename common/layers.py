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


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """x [..., dim] -> norm(x). With `residual` (x's shape) -> (norm(s), s) for the residual stream s = x + residual
    (vLLM's pairs: a sublayer's output travels beside the stream, and the next norm adds them)."""
    if residual is not None:
        x = x + residual
    # Normalise in fp32, scale in the input dtype (as every Llama-family reference does).
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * x32.to(x.dtype)
    return normed if residual is None else (normed, x)


def add_norm(x: Tensor, residual: Tensor | None, norm: tuple[Tensor, float] | None, kernel: Callable = rms_norm
             ) -> tuple[Tensor, Tensor]:
    """(norm(s), s) for the residual stream s = x + residual entering a sublayer: x alone where residual is None
    (the first layer), s itself where norm is None. `norm`: an RMSNorm's (weight, eps); `kernel`: its `rms_norm`
    (the fused one adds and normalises in one launch)."""
    if norm is None:
        stream = x if residual is None else x + residual
        return stream, stream
    if residual is None:
        return kernel(x, *norm), x
    return kernel(x, *norm, residual)


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


def fused_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, residual: Tensor | None = None,
                 norm: tuple[Tensor, float] | None = None, silu_mul_output: bool = False):
    """epilogue(linear(norm(x + residual))): a sublayer's input projection with what comes before and after it, one
    kernel where fused (at one token, `eyas.serve.kernels.fused_linear`). `residual`: the residual stream to add
    first, which makes the result the pair (y, x + residual); `norm`: an RMSNorm's (weight, eps);
    `silu_mul_output`: SiLU·mul of the output's two halves (a joint gate/up projection). x [..., K], weight [N, K]
    -> y [..., N] ([..., N / 2] with silu_mul_output)."""
    normed, stream = add_norm(x, residual, norm)
    y = F.linear(normed, weight, bias)
    if silu_mul_output:
        y = silu_mul(*y.chunk(2, dim=-1))
    return y if residual is None else (y, stream)


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
    def spec(self) -> tuple[Tensor, float]:
        """(weight, eps): the form `rms_norm`, `add_norm` and the fused kernels take a norm in."""
        return self.weight, self.eps

    def forward(self, x: Tensor, residual: Tensor | None = None):
        """x [..., dim] -> norm(x); with `residual`, the pair (norm(x + residual), x + residual) (`rms_norm`)."""
        return self.kernels.rms_norm(x, *self.spec, residual)


def sublayer_input(x: Tensor, norm: RMSNorm | None, residual: Tensor | None) -> tuple[Tensor, Tensor]:
    """`add_norm` with an RMSNorm module and its kernels: (norm(s), s)."""
    if norm is None:
        return add_norm(x, residual, None)
    return add_norm(x, residual, norm.spec, norm.kernels.rms_norm)


def project_input(kernels: Kernels, x: Tensor, proj: nn.Linear, norm: RMSNorm | None, residual: Tensor | None,
                  **epilogue) -> tuple[Tensor, Tensor]:
    """`sublayer_input` and the sublayer's joint input projection in one `Kernels.linear`: (epilogue(proj(norm(s))),
    s)."""
    prologue = {} if norm is None else {"norm": norm.spec}
    if residual is None:
        return kernels.linear(x, proj.weight, proj.bias, **prologue, **epilogue), x
    return kernels.linear(x, proj.weight, proj.bias, residual=residual, **prologue, **epilogue)


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
                norm: RMSNorm | None = None, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [B, T, in_features] -> (attention(norm(s)) [B, T, hidden], s) for the residual stream s = x + residual
        (`sublayer_input`). The add and the norm go into the q/k/v projection's kernel (`Kernels.linear`); the
        caller adds the output to s in the next one."""
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            qkv, stream = project_input(self.kernels, x, self.qkv_proj, norm, residual)
            kv = self.num_kv_heads * self.head_dim
            q, k, v = qkv.split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        else:
            x, stream = sublayer_input(x, norm, residual)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attn.attend_rotary(layer, q, k, v, cos, sin, self.kernels.rotary)  # [B, T, Hq, D]
        return self.kernels.linear(out.reshape(B, T, -1), self.o_proj.weight, self.o_proj.bias), stream


class MLP(nn.Module):
    kernels = Kernels()

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up_proj: nn.Linear | None = None  # set by `fuse_projections`

    def forward(self, x: Tensor, *, norm: RMSNorm | None = None, residual: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """x [..., hidden] -> (mlp(norm(s)), s) for the residual stream s = x + residual, as `Attention.forward`."""
        if self.gate_up_proj is not None:
            h, stream = project_input(self.kernels, x, self.gate_up_proj, norm, residual, silu_mul_output=True)
        else:
            x, stream = sublayer_input(x, norm, residual)
            h = self.kernels.silu_mul(self.gate_proj(x), self.up_proj(x))
        return self.kernels.linear(h, self.down_proj.weight, self.down_proj.bias), stream


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
