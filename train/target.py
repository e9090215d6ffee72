"""The frozen target as the trainer uses it: whole (online: it computes the hidden states) or, offline, only the
parts the loss needs, and a batch's hidden states, computed or read from the dump the batch carries.

    target = load_target(recipe.model, torch.bfloat16, device, layers=recipe.data.hidden_states is None)
    aux, logits = target_states(target, batch, aux_layers)    # [B, T, 3·Ht], [B, T, V]

Offline, the loss still needs the target's embedding (the head's token inputs) and its lm_head (logits from the
dumped final hidden states); the final norm starts the head's (`trainer.build_head`) and, with the lm_head,
identifies the target the states were dumped from (`eyas.data.hidden_states.target_fingerprint`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from eyas.common.architectures import architecture_config, random_target
from eyas.common.assets import resolve_target
from eyas.common.attention import CausalAttention
from eyas.common.checkpoint import load_target as load_checkpoint
from eyas.common.checkpoint import target_config
from eyas.common.config import ConfigError, TargetConfig
from eyas.common.target import TargetModel

from .batches import Batch
from .config import ModelConfig, RandomTarget


def random_target_config(cfg: RandomTarget) -> TargetConfig:
    return TargetConfig.from_hf({
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    }, source="model.random_target")


def target_config_of(cfg: ModelConfig) -> TargetConfig:
    """The recipe's target's config, its weights unread (a 70B target's take minutes): what the checks that should
    fail before a load read. A target that does not exist is a `ConfigError` naming `model.target`."""
    if cfg.random_target is not None:
        return random_target_config(cfg.random_target)
    if cfg.random_arch is not None:
        return architecture_config(cfg.random_arch)
    try:
        path = resolve_target(cfg.target)
    except FileNotFoundError as e:
        raise ConfigError(f"model.target: {e}; set it with --set model.target=PATH") from None
    return target_config(path)


def build_random_target(cfg: RandomTarget) -> TargetModel:
    """A random Llama decoder; lm_head drawn N(0, 1/H) so the logits have unit scale and the target's
    distributions are peaked enough to learn from (PyTorch's default init gives nearly flat ones)."""
    config = random_target_config(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = TargetModel(config)
        nn.init.normal_(model.lm_head.weight, std=cfg.hidden_size**-0.5)
    return model.eval()


# What offline training reads of a checkpoint (see the module docstring); a tied lm_head is the embedding.
TARGET_ENDS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def load_target(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, layers: bool = True) -> TargetModel:
    """The frozen target; `layers=False` (offline) loads only a checkpoint's `TARGET_ENDS`, its decoder layers
    staying on the meta device (no memory, and running them fails: a meta weight meets a real input). Random
    targets are built whole either way: they have no checkpoint to read a part of."""
    if cfg.random_target is not None:
        target = build_random_target(cfg.random_target).to(dtype=dtype, device=device)
        target.rotary.reset_parameters(device)  # inv_freq stays fp32
    elif cfg.random_arch is not None:
        target = random_target(cfg.random_arch, dtype, device)
    else:
        target = load_checkpoint(resolve_target(cfg.target), dtype, device, only=None if layers else TARGET_ENDS)
    return target.requires_grad_(False).eval()


@torch.no_grad()
def target_forward(target: TargetModel, batch: Batch, aux_layers: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """(aux [B, T, 3·Ht], logits [B, T, V]). Rows are right-padded (`Batches`), so plain causal attention is exact at
    every real position: a real query never reaches a padded key. On CUDA compiled (`_forward_compiled`)."""
    input_ids = batch["input_ids"]
    return (_forward_compiled if input_ids.is_cuda else _forward)(target, input_ids, aux_layers)


def _forward(target: TargetModel, input_ids: Tensor, aux_layers: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    out = target(input_ids, positions, CausalAttention(), aux_layers=aux_layers)
    return out.aux, target.logits(out.hidden)


# The frozen target needs no backward, so its whole forward compiles into one graph: eager, each RMSNorm, rotary and
# residual add is a chain of small kernels over [B, T, H]; compiled, a few fused ones (a 135M target's training step
# at 16 rows of 2,048 tokens: 13% shorter, docs/perf.md). Lengths vary by batch: dynamic.
_forward_compiled = torch.compile(_forward, dynamic=True)


@torch.no_grad()
def target_states(target: TargetModel, batch: Batch, aux_layers: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """(aux [B, T, 3·Ht], logits [B, T, V]) of a batch on the target's device: the target's forward, or the
    states dumped for it (offline), cast to the target's dtype; logits = lm_head(the dumped final normed state)."""
    if "aux" not in batch:
        return target_forward(target, batch, aux_layers)
    dtype = target.embed_tokens.weight.dtype
    logits = batch["logits"] if "logits" in batch else target.logits(batch["hidden"].to(dtype))
    return batch["aux"].to(dtype), logits.to(dtype)
