"""The EAGLE-1/2 draft head (`LlamaForCausalLMEagle`): decoder layers over fc(embedding ‖ feature).

One draft step, for tokens x_t with embeddings e [B, T, H] and features f [B, T, H]:

    x   = fc(cat(e, f))                  # [B, T, H]; fc may carry a bias
    out = layers(x)                      # layer 0 has no input_layernorm; no final norm
    logits = out @ lm_head[hot].T        # the target's lm_head, optionally restricted by an FR-Spec map

At the first step f is the target's final (normed) hidden state; later steps feed the head its own `out`.
Embedding and lm_head are the target's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .attention import AttentionMetadata
from .config import ConfigError, RopeConfig, build_dataclass, check_layer_sizes, read_layer_fields
from .hot_vocab import HotVocab
from .layers import MLP, Attention, Kernels, RMSNorm, Rotary, fold_layer_norms
from .target import TargetOutput

EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int
    num_hidden_layers: int = 1
    fc_bias: bool = True  # config.json "bias"; EAGLE's Llama-3 heads write false
    rope: RopeConfig = field(default_factory=RopeConfig)

    def __post_init__(self):
        check_layer_sizes(self, ("num_hidden_layers",))

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str) -> EagleConfig:
        arch = (cfg.get("architectures") or [None])[0]
        if arch not in (EAGLE_ARCHITECTURE, "LlamaForCausalLM"):
            raise ConfigError(
                f"{source}: field 'architectures' is {cfg.get('architectures')!r}; expected ['{EAGLE_ARCHITECTURE}']"
            )
        values = read_layer_fields(cfg, source)
        if "num_hidden_layers" in cfg:
            values["num_hidden_layers"] = cfg["num_hidden_layers"]
        if "bias" in cfg:
            values["fc_bias"] = cfg["bias"]
        return build_dataclass(cls, values, source=source)


class EagleLayer(nn.Module):
    def __init__(self, cfg: EagleConfig, index: int):
        super().__init__()
        H = cfg.hidden_size
        # Layer 0's input is fc's output, which EAGLE does not normalise.
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps) if index > 0 else None
        self.self_attn = Attention(H, H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.index = index

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionMetadata) -> Tensor:
        """The residual stream x [B, T, H] in and out, as in the target's `DecoderLayer`."""
        x = self.self_attn(x, cos, sin, attn, self.index, norm=self.input_layernorm, residual=x)
        return self.mlp(x, norm=self.post_attention_layernorm, residual=x)


class EagleHead(nn.Module):
    """`lm_head_weight` [draft_vocab, H] holds the target's lm_head rows of the hot vocabulary (all rows
    without a token map); it is not part of the head's checkpoint."""

    kernels = Kernels()  # fc and the lm_head go through `Kernels.linear` as the layers' projections do

    def __init__(self, cfg: EagleConfig, hot_vocab: HotVocab | None = None):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(EagleLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        self.token_map = hot_vocab  # an FR-Spec map restricting the lm_head, or None (the whole vocabulary)
        self.register_buffer("lm_head_weight", torch.empty(0), persistent=False)

    @property
    def kv_layers(self) -> int:
        return len(self.layers)

    def target_layers(self, target) -> tuple[int, ...]:
        """EAGLE-1/2 read the target's final hidden state, no intermediate layers."""
        return ()

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the draft can propose: the token map's, or the whole vocabulary's."""
        return self.config.vocab_size if self.token_map is None else self.token_map.hot_ids.numel()

    @property
    def hot_vocab(self) -> HotVocab:
        """Draft index -> target id: the token map, or the identity over the whole vocabulary."""
        if self.token_map is not None:
            return self.token_map
        return HotVocab(torch.arange(self.config.vocab_size), self.config.vocab_size)

    def attach_lm_head(self, target_lm_head: Tensor) -> None:
        """Takes the target's lm_head [vocab, H], restricted to the hot vocabulary when there is one."""
        self.lm_head_weight = target_lm_head if self.token_map is None else target_lm_head[self.token_map.hot_ids]

    def fold_norms(self) -> None:
        """Inference, after `fuse_projections`: each layer's norm weights into the projections they feed
        (`fold_layer_norms`; the lm_head is the target's, after no norm of the head's)."""
        for layer in self.layers:
            fold_layer_norms(layer)

    def project_target(self, target: TargetOutput) -> Tensor:
        """First-step features: the target's final normed hidden state [B, T, H]."""
        return target.hidden

    def step(self, embeds: Tensor, features: Tensor, positions: Tensor | tuple[Tensor, Tensor],
             attn: AttentionMetadata) -> Tensor:
        """embeds, features [B, T, H]; positions [B, T] (or their `rotary` tables) -> output [B, T, H], the next
        step's features."""
        x = self.kernels.linear(torch.cat([embeds, features], dim=-1), self.fc.weight, self.fc.bias)
        cos, sin = self.rotary.tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return x

    def logits(self, out: Tensor) -> Tensor:
        """out [B, T, H] -> logits over the draft vocabulary [B, T, draft_vocab]."""
        return self.kernels.linear(out, self.lm_head_weight)
