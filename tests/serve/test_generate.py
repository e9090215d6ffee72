"""Greedy generation over the paged KV cache equals transformers' greedy `generate`."""

import pytest
import torch

from eyas.common.attention import CausalAttention
from eyas.common.target import TargetModel
from eyas.serve.attention.torch_sdpa import TorchPagedAttention
from eyas.serve.generate import greedy_tokens
from eyas.serve.kv_cache import KVPool


def test_greedy_matches_transformers(hf_checkpoint):
    path, hf = hf_checkpoint("qwen3")
    model = TargetModel.from_pretrained(path)
    prompt = [5, 17, 99, 3, 250, 42, 7]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(prompt):].tolist()
    ours = list(greedy_tokens(model, prompt, 40, block_size=4))
    assert ours == ref


def test_stops_at_the_context(hf_checkpoint):
    """The last token is read at the context's last position; a prompt longer than the context is refused."""
    path, _ = hf_checkpoint("llama")
    model = TargetModel.from_pretrained(path)
    context = model.config.max_position_embeddings
    assert len(list(greedy_tokens(model, [1] * (context - 3), 20))) == 4
    with pytest.raises(ValueError, match=f"the prompt has {context + 1} tokens; the model's context holds {context}"):
        next(greedy_tokens(model, [1] * (context + 1), 20))


def test_stops_after_stop_token(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    model = TargetModel.from_pretrained(path)
    free = list(greedy_tokens(model, [1, 2, 3], 20))
    stop = free[5]
    cut = list(greedy_tokens(model, [1, 2, 3], 20, stop_ids=[stop]))
    assert cut == free[: free.index(stop) + 1]


def test_tree_verification_through_paged_cache(hf_checkpoint):
    """A cached prefix, then a tree of new tokens with an ancestry mask: each node's logits equal those of
    its root path decoded causally. Tree (parents): 0 -> {1, 2}; 1 -> {3}; 2 -> {4}."""
    path, _ = hf_checkpoint("mistral")
    model = TargetModel.from_pretrained(path)
    cfg = model.config
    torch.manual_seed(0)
    prefix, tree = torch.randint(0, 257, (9,)), torch.randint(0, 257, (5,))
    parent = [-1, 0, 0, 1, 2]
    depth = [0, 1, 1, 2, 2]
    pool = KVPool(cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    table = pool.block_table([[5, 2, 7, 0]])  # non-contiguous blocks of the pool
    with torch.no_grad():
        n = len(prefix)
        prefill_mask = torch.ones(1, n, n, dtype=torch.bool).tril()
        model(prefix[None], torch.arange(n)[None], TorchPagedAttention(pool, table, torch.tensor([0]), prefill_mask))
        mask = torch.zeros(5, 5, dtype=torch.bool)  # over the tree's nodes; the prefix is seen whole
        for i in range(5):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = parent[j]
        positions = torch.tensor([n + d for d in depth])[None]
        out = model(tree[None], positions, TorchPagedAttention(pool, table, torch.tensor([n]), mask[None]))
        tree_logits = model.logits(out.hidden)[0]
        for i in range(5):
            chain, j = [], i
            while j >= 0:
                chain.append(int(tree[j]))
                j = parent[j]
            seq = torch.cat([prefix, torch.tensor(chain[::-1])])
            ref = model.logits(model(seq[None], torch.arange(len(seq))[None], CausalAttention()).hidden)[0, -1]
            assert (tree_logits[i] - ref).abs().max() < 1e-4, f"tree node {i}"


def test_pool_move_reads_every_source_before_writing():
    """Slots 2->1 and 5->2 (slot 2 both a source and a destination), in every layer's keys and values; the
    other slots keep their contents."""
    pool = KVPool(3, 4, 2, 2, 4, torch.float32, "cpu")
    pool.kv.copy_(torch.randn_like(pool.kv))
    before = pool.kv.clone()
    pool.move(pool.rows_of(torch.tensor([2, 5])), pool.rows_of(torch.tensor([1, 2])))
    expected = before.clone()
    expected[:, :, 1], expected[:, :, 2] = before[:, :, 2], before[:, :, 5]
    assert torch.equal(pool.kv, expected)
    assert torch.equal(pool.k[1], expected[0, 1]) and torch.equal(pool.v[2], expected[1, 2])  # the layer views
