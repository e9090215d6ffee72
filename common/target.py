"""The target decoder: one implementation for the Llama family, used by the trainer and the server.

    model = TargetModel.from_pretrained("path/to/hf_dir_or_file.gguf", dtype=torch.bfloat16, device="cuda")
    out = model(input_ids, positions, CausalAttention(), aux_layers=model.config.default_aux_layers)
    logits = model.logits(out.hidden)

Parameter names match Hugging Face's `LlamaForCausalLM` (`model.layers.N.self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .attention import AttentionMetadata
from .config import TargetConfig
from .layers import MLP, Attention, RMSNorm, Rotary, fold_layer_norms


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPUs; fp32 elsewhere, the exact reference every test compares against."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionMetadata, layer: int) -> Tensor:
        """The residual stream x [B, T, H] -> the stream leaving the layer: each sublayer's output projection adds
        its output to the stream in its kernel (`Attention.forward`)."""
        x = self.self_attn(x, cos, sin, attn, layer, norm=self.input_layernorm, residual=x)
        return self.mlp(x, norm=self.post_attention_layernorm, residual=x)


class DecoderStack(nn.Module):
    """Embedding, layers and final norm: HF's `model.` prefix."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class TargetOutput:
    hidden: Tensor  # [B, T, H] after the final norm: `TargetModel.logits(hidden)` gives the logits
    aux: Tensor | None  # [B, T, len(aux_layers) * H]: residual streams entering the requested layers


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def lm_head_weight(self) -> Tensor:
        """[vocab, H]: the output projection (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | tuple[Tensor, Tensor],
        attn: AttentionMetadata,
        aux_layers: Sequence[int] = (),
    ) -> TargetOutput:
        """input_ids, positions [B, T] (or their `rotary` tables, the pair cos, sin [B, T, D]). `aux_layers`: capture
        the residual stream entering these layers (index L, the layer count, captures the final pre-norm stream)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(positions, x.dtype)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                captured[i] = x
            x = layer(x, cos, sin, attn, i)
        captured[len(self.model.layers)] = x
        hidden = self.model.norm(x)
        aux = torch.cat([captured[i] for i in aux_layers], dim=-1) if aux_layers else None
        return TargetOutput(hidden=hidden, aux=aux)

    def fold_norms(self) -> None:
        """Inference, after `fuse_projections`: each layer's norms folded into the projections they feed
        (`fold_layer_norms`). The final norm stays whole: the lm_head it feeds may be the embedding too."""
        for layer in self.model.layers:
            fold_layer_norms(layer)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] (normed) -> logits [..., vocab]."""
        return hidden @ self.lm_head_weight.T

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> TargetModel:
        """Loads a local HF directory (safetensors, single or sharded) or a `.gguf` file."""
        from .checkpoint import load_target

        return load_target(path, dtype=dtype, device=device)
