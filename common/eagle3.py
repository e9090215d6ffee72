"""The EAGLE-3 draft head: one decoder layer over (token embedding ‖ fused target features).

One draft step, for tokens x_t whose embeddings are e [B, T, H] and input features h [B, T, H]:

    a   = attn(cat(input_layernorm(e), hidden_norm(h)))      # attention input is 2H wide
    r   = (hidden_norm(h) if norm_before_residual else h) + a
    out = r + mlp(post_attention_layernorm(r))               # next step's hidden input (pre-norm)
    logits = lm_head(norm(out))                              # [B, T, draft_vocab]

At the first step h = fc(aux), aux being the target's three captured residual streams [B, T, 3·Ht];
later steps feed the head its own `out`. The token embedding is the target's (frozen), passed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .attention import AttentionMetadata
from .config import (
    ConfigError,
    RopeConfig,
    TargetConfig,
    build_dataclass,
    check_layer_sizes,
    mapping_field,
    read_layer_fields,
    write_layer_fields,
)
from .hot_vocab import HotVocab
from .layers import MLP, Attention, Kernels, RMSNorm, Rotary, fold_norm
from .target import TargetOutput

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def is_eagle3_config(cfg: Mapping[str, Any]) -> bool:
    """An EAGLE-3 head's config.json: an architecture named for EAGLE-3 (SGLang's and SpecForge's
    `LlamaForCausalLMEagle3`, `Qwen2ForCausalLMEagle3`; vLLM's `Eagle3LlamaForCausalLM`: one layout), or the original
    heads' `LlamaForCausalLM` with a draft vocabulary."""
    arch = (cfg.get("architectures") or [None])[0]
    named = isinstance(arch, str) and (arch.startswith("Eagle3") or arch.endswith("Eagle3"))
    return named or (arch == "LlamaForCausalLM" and "draft_vocab_size" in cfg)


# EAGLE-3 variants whose layer computes otherwise (vLLM's EAGLE-3.1 normed output, a norm before fc): flags with no
# tensor of their own, so a head that sets one would load and draft wrongly.
UNSUPPORTED_FLAGS = ("norm_output", "norm_before_fc", "fc_norm")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Residual streams of the target fused by `fc`, as the ids of the layers they *enter*.
    aux_layers: tuple[int, ...] | None = None  # None: the default [2, L//2, L-3] of the target
    norm_before_residual: bool = False  # vLLM speculators variant: the residual is hidden_norm(h)

    def __post_init__(self):
        check_layer_sizes(self, ("draft_vocab_size", "target_hidden_size"))
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            raise ValueError(f"aux_layers must name 3 layers, got {self.aux_layers}")

    @classmethod
    def for_target(cls, target: TargetConfig, draft_vocab_size: int, **overrides) -> Eagle3Config:
        """A head shaped like one layer of `target` (the usual choice)."""
        values: dict[str, Any] = dict(
            hidden_size=target.hidden_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            rms_norm_eps=target.rms_norm_eps,
            max_position_embeddings=target.max_position_embeddings,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            rope=target.rope,
        )
        values.update(overrides)
        return cls(**values)

    def aux_layers_for(self, target: TargetConfig) -> tuple[int, ...]:
        layers = self.aux_layers if self.aux_layers is not None else target.default_aux_layers
        if not all(0 <= i <= target.num_hidden_layers for i in layers):
            raise ValueError(
                f"aux layers {layers} do not exist in a target of {target.num_hidden_layers} layers "
                "(the default [2, L//2, L-3] needs at least 3 layers)"
            )
        return layers

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str) -> Eagle3Config:
        if not is_eagle3_config(cfg):
            raise ConfigError(
                f"{source}: field 'architectures' is {cfg.get('architectures')!r}; expected "
                f"['{EAGLE3_ARCHITECTURE}'] (or ['LlamaForCausalLM'] with 'draft_vocab_size')"
            )
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ConfigError(f"{source}: field 'num_hidden_layers' must be 1 for an EAGLE-3 head")
        if unsupported := [flag for flag in UNSUPPORTED_FLAGS if cfg.get(flag)]:
            raise ConfigError(f"{source}: field '{unsupported[0]}' is set: an EAGLE-3 variant eyas does not serve")
        values = read_layer_fields(cfg, source)
        if "norm_before_residual" in cfg:
            values["norm_before_residual"] = cfg["norm_before_residual"]
        draft_vocab = cfg.get("draft_vocab_size")  # vLLM reads null as the whole vocabulary
        values["draft_vocab_size"] = cfg.get("vocab_size") if draft_vocab is None else draft_vocab
        values["target_hidden_size"] = cfg.get("target_hidden_size") or cfg.get("hidden_size")
        # Engines disagree on what an explicit layer id means; we store the layers the streams *enter*, as vLLM and
        # speculators read a top-level list (read first). SGLang reads the nested
        # `eagle_config.eagle_aux_hidden_state_layer_ids`: since its PR 25454 a list starting at 1 names layers whose
        # *output* is captured (it taps id + 1), any other the layers entered; before, every list the former. All
        # engines' defaults are the same streams, [2, L//2, L-3]. The streams are fused in layer order.
        top = cfg.get("eagle_aux_hidden_state_layer_ids")
        nested = mapping_field(cfg, "eagle_config", source).get("eagle_aux_hidden_state_layer_ids")
        if top is not None:
            values["aux_layers"] = tuple(sorted(_layer_ids(top, "eagle_aux_hidden_state_layer_ids", source)))
        elif nested is not None:
            ids = _layer_ids(nested, "eagle_config.eagle_aux_hidden_state_layer_ids", source)
            outputs = ids[:1] == [1]  # the ids name the layers whose output the streams are
            values["aux_layers"] = tuple(sorted(i + outputs for i in ids))
        return build_dataclass(cls, values, source=source)

    def to_hf(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "architectures": [EAGLE3_ARCHITECTURE],
            **write_layer_fields(self),
            "num_hidden_layers": 1,
            "draft_vocab_size": self.draft_vocab_size,
        }
        if self.target_hidden_size != self.hidden_size:
            cfg["target_hidden_size"] = self.target_hidden_size
        if self.norm_before_residual:
            cfg["norm_before_residual"] = True
        if self.aux_layers is not None:  # both engines' forms (from_hf): vLLM's top-level, SGLang's nested
            if self.aux_layers[0] == 1:
                raise ValueError(f"aux layers {self.aux_layers}: SGLang's config cannot name the stream entering layer "
                                 "1 (a list starting at 1 names layer outputs)")
            cfg["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layers)
            # SGLang shifts a list starting at 1 (every SGLang, so the stream entering layer 2 is named 1) and no other
            # (since its PR 25454; older ones shift every list, and read one starting past 2 a layer late).
            first_entered = self.aux_layers[0] == 2
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids":
                                   [i - first_entered for i in self.aux_layers]}
        return cfg


def _layer_ids(ids: Any, key: str, source: str) -> list[int]:
    if not (isinstance(ids, list) and all(isinstance(i, int) and i >= 0 for i in ids) and len(set(ids)) == len(ids)):
        raise ConfigError(f"{source}: field '{key}' must be a list of distinct layer ids >= 0, got {ids!r}")
    return ids


class Eagle3Layer(nn.Module):
    kernels = Kernels()

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(2 * H, H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, attn: AttentionMetadata) -> Tensor:
        x = self.kernels.norm_cat(embeds, hidden, self.input_layernorm.spec, self.hidden_norm.spec)  # [B, T, 2H]
        residual = x[..., hidden.shape[-1]:] if self.norm_before_residual else hidden
        r = self.self_attn(x, cos, sin, attn, 0, residual=residual)  # residual + a
        return self.mlp(r, norm=self.post_attention_layernorm, residual=r)


class Eagle3Head(nn.Module):
    kernels = Kernels()  # fc, and the final norm with the lm_head, go through `Kernels.linear` as the layer's do

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        # The draft vocabulary travels with the weights (SGLang/vLLM layout): target id = i + d2t[i].
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    kv_layers = 1  # attention layers whose KV the server caches

    def target_layers(self, target: TargetConfig) -> tuple[int, ...]:
        """The target layers whose entering streams `project_target` fuses."""
        return self.config.aux_layers_for(target)

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the draft can propose (its lm_head's rows)."""
        return self.config.draft_vocab_size

    @property
    def hot_vocab(self) -> HotVocab:
        """Built from `d2t` once per state of that buffer (validation syncs the device: not every step)."""
        key = (self.d2t.device, self.d2t.data_ptr(), self.d2t._version)
        if getattr(self, "_hot_vocab_key", None) != key:
            self._hot_vocab = HotVocab.from_d2t(self.d2t, self.config.vocab_size)
            self._hot_vocab_key = key
        return self._hot_vocab

    def set_hot_vocab(self, vocab: HotVocab) -> None:
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def keep_draft_tokens(self, allowed: HotVocab) -> None:
        """Restricts the draft vocabulary to its tokens that `allowed` holds (an FR-Spec map of the most frequent
        tokens): the lm_head keeps their rows, in the head's order, so each draft pass reads and ranks fewer. The
        served tokens stay the target's; only what the draft can propose narrows."""
        hot = self.hot_vocab
        rows = allowed.t2d.to(hot.hot_ids.device)[hot.hot_ids].nonzero().flatten()  # [kept] lm_head rows
        if rows.numel() == 0:
            raise ValueError("the token map holds none of the head's draft tokens")
        kept = HotVocab(hot.hot_ids[rows], self.config.vocab_size)
        self.config = dataclasses.replace(self.config, draft_vocab_size=rows.numel())
        weight = self.lm_head.weight
        self.lm_head.weight = nn.Parameter(weight.detach()[rows], requires_grad=weight.requires_grad)
        self.lm_head.out_features = rows.numel()
        self.d2t, self.t2d = kept.d2t, kept.t2d.clone()

    def project_target(self, target: TargetOutput) -> Tensor:
        """The target's captured streams aux [B, T, 3·Ht] -> first-step hidden input [B, T, H]."""
        return self.kernels.linear(target.aux, self.fc.weight)

    def step(self, embeds: Tensor, hidden: Tensor, positions: Tensor | tuple[Tensor, Tensor], attn: AttentionMetadata
             ) -> Tensor:
        """embeds, hidden [B, T, H]; positions [B, T] (or their `rotary` tables) -> the layer output [B, T, H]
        (pre-norm)."""
        cos, sin = self.rotary.tables(positions, hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, attn)

    def fold_norms(self) -> None:
        """Inference, after `fuse_projections`: the post-attention norm's weight into gate/up and the final norm's
        into the lm_head (`fold_norm`). The input norms stay whole: each scales its half of q/k/v's input, not all
        of it."""
        mlp = self.midlayer.mlp
        assert mlp.gate_up_proj is not None, "fuse_projections first"
        fold_norm(self.midlayer.post_attention_layernorm, mlp.gate_up_proj)
        fold_norm(self.norm, self.lm_head)

    def logits(self, out: Tensor) -> Tensor:
        """out [B, T, H] from `step` -> logits over the draft vocabulary [B, T, draft_vocab]."""
        return self.kernels.linear(out, self.lm_head.weight, norm=self.norm.spec)
