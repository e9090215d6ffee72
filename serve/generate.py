"""Target-only generation of one sequence over the paged KV cache (the simplest use of the serving stack: the
chat main job and the parity tests run it): greedy, or sampled with the engine's draws (`sampling.position_uniforms`),
so a seeded request's tokens are the engine's with any tree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from eyas.common.attention import causal_mask
from eyas.common.target import TargetModel

from .attention.torch_sdpa import TorchPagedAttention
from .kv_cache import KVPool
from .sampling import SamplingParams, SamplingRows, draw, request_seed


def greedy_tokens(model: TargetModel, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                  block_size: int = 16) -> Iterator[int]:
    """`target_tokens`, greedy."""
    return target_tokens(model, prompt_ids, max_new_tokens, stop_ids, block_size)


@torch.no_grad()
def target_tokens(
    model: TargetModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    block_size: int = 16,
    params: SamplingParams | None = None,
) -> Iterator[int]:
    """Yields up to `max_new_tokens` tokens after `prompt_ids`, greedy (`params` None or greedy) or drawn by `params`
    as the engine draws them (the token after position t by inverse CDF with the seed's uniform at t), stopping after
    a stop id or where the next token would be read at a position past the model's context. ValueError: the prompt
    alone is longer."""
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
    sampled = params is not None and not params.greedy
    if sampled:
        rows = SamplingRows.of(params, 1, cfg.vocab_size, device)
        seed = torch.tensor([request_seed(params)], device=device)
    new = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    start = 0
    for _ in range(max_new_tokens):
        end = start + len(new)
        positions = torch.arange(start, end, device=device)
        prefix = torch.tensor([start], device=device)
        attn = TorchPagedAttention(pool, table, prefix, causal_mask(len(new), device)[None])
        logits = model.logits(model(new[None], positions[None], attn).hidden[0, -1:]).float()  # [1, V]
        if sampled:  # drawn at the last position, end - 1
            token = int(draw(logits, rows, seed, positions[-1:]))
        else:
            token = int(logits.argmax())
        yield token
        if token in stop_ids:
            return
        new, start = torch.tensor([token], device=device), end
