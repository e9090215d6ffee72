"""Target-only greedy generation of one sequence over the paged KV cache (the simplest use of the
serving stack: the chat main job and the parity tests run it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from eyas.common.attention import causal_mask
from eyas.common.target import TargetModel

from .attention.torch_sdpa import TorchPagedAttention
from .kv_cache import KVPool


@torch.no_grad()
def greedy_tokens(
    model: TargetModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    block_size: int = 16,
) -> Iterator[int]:
    """Yields up to `max_new_tokens` greedy tokens after `prompt_ids`, stopping after a stop id or where the next
    token would be read at a position past the model's context. ValueError: the prompt alone is longer."""
    cfg = model.config
    context = cfg.max_position_embeddings
    if len(prompt_ids) > context:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context holds {context}")
    max_new_tokens = min(max_new_tokens, context - len(prompt_ids) + 1)  # the last one read at position context - 1
    device = model.embed_tokens.weight.device
    total = len(prompt_ids) + max_new_tokens
    pool = KVPool(
        cfg.num_hidden_layers, -(-total // block_size), block_size, cfg.num_key_value_heads, cfg.head_dim,
        model.embed_tokens.weight.dtype, device,
    )
    table = pool.block_table([pool.allocator.allocate(pool.allocator.num_free)], device)  # [1, M]
    new = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    start = 0
    for _ in range(max_new_tokens):
        end = start + len(new)
        positions = torch.arange(start, end, device=device)
        prefix = torch.tensor([start], device=device)
        attn = TorchPagedAttention(pool, table, prefix, causal_mask(len(new), device)[None])
        hidden = model(new[None], positions[None], attn).hidden[0, -1]
        token = int(model.logits(hidden).argmax())
        yield token
        if token in stop_ids:
            return
        new, start = torch.tensor([token], device=device), end
