"""Golden EAGLE-2 trees: hand-built draft log-probs give hand-computed trees, masks and depths."""

import torch

from eyas.serve.tree import TreeBuilder, ancestor_mask, top_log_probs


def logp_row(V, **token_logp):
    """A [V] log-prob row with the given tokens' values and everything else far below."""
    row = torch.full((V,), -50.0)
    for token, value in token_logp.items():
        row[int(token[1:])] = value
    return row


def test_worked_example_from_the_docstring():
    """k=2, 2 passes, 4 nodes. Tokens: a=1, b=2, c=3, d=4, e=5, f=6; root token 9."""
    V = 10
    builder = TreeBuilder(torch.tensor([9]), topk=2)
    frontier = builder.first(*logp_row(V, t1=-0.1, t2=-0.5)[None].topk(2))
    assert frontier.tolist() == [[1, 2]]
    assert builder.frontier.ancestors.tolist() == [[[True, False], [False, True]]]
    logp = torch.stack([logp_row(V, t3=-0.2, t4=-0.9), logp_row(V, t5=-0.2, t6=-1.5)])[None]  # [1, 2, V]
    frontier = builder.extend(*logp.topk(2))
    # children scores: c -0.3, d -1.0, e -0.7, f -2.0 -> frontier [c, e] (creation order), rows [a, b]
    assert frontier.tolist() == [[3, 5]]
    assert builder.frontier.rows.tolist() == [[0, 1]]
    # drafted nodes so far: [a, b, c, e]; c sees a and itself; e sees b and itself
    assert builder.frontier.ancestors.int().tolist() == [[[1, 0, 1, 0], [0, 1, 0, 1]]]
    tree = builder.finalize(4)
    assert tree.tokens.tolist() == [[9, 1, 2, 3]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1]]
    assert tree.depth.tolist() == [[0, 1, 1, 2]]
    assert tree.mask.int().tolist() == [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]]


def test_chain_when_topk_is_one():
    V, steps = 8, 4
    builder = TreeBuilder(torch.tensor([0, 7]), topk=1)
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(2, V, generator=g).log_softmax(-1)
    expected = [logp.argmax(-1)]
    builder.first(*top_log_probs(logp, 1))
    for _ in range(steps - 1):
        logp = torch.randn(2, 1, V, generator=g).log_softmax(-1)
        expected.append(logp[:, 0].argmax(-1))
        builder.extend(*top_log_probs(logp, 1))
    tree = builder.finalize(steps + 1)
    assert tree.tokens[:, 1:].tolist() == torch.stack(expected, 1).tolist()
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3]] * 2
    assert torch.equal(tree.mask, torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5))


def test_kept_nodes_form_a_tree_with_parents_first():
    """Random log-probs, many shapes: every kept node's parent is kept and precedes it; depth = parent + 1;
    the kept set is exactly the best-scored candidates."""
    g = torch.Generator().manual_seed(1)
    for k, steps, n in [(2, 3, 6), (4, 5, 8), (8, 6, 48), (3, 1, 4)]:
        V, B = 30, 3
        builder = TreeBuilder(torch.zeros(B, dtype=torch.long), topk=k)
        builder.first(*top_log_probs(torch.randn(B, V, generator=g), k))
        for _ in range(steps - 1):
            builder.extend(*top_log_probs(torch.randn(B, k, V, generator=g), k))
        tree = builder.finalize(n)
        scores = torch.cat(builder.scores, 1)
        assert tree.tokens.shape == (B, min(n, scores.shape[1]))
        for b in range(B):
            parents = tree.parents[b].tolist()
            for i, p in enumerate(parents[1:], start=1):
                assert 0 <= p < i and tree.depth[b, i] == tree.depth[b, p] + 1
        # the kept candidates are the best-scored ones
        best = scores.sort(dim=-1, descending=True).values[:, : tree.tokens.shape[1]]
        assert torch.equal(tree.scores.sort(dim=-1, descending=True).values, best)


def test_ancestor_mask_of_hand_built_tree():
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 5]])
    mask = ancestor_mask(parents, max_depth=3)
    expected = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 2, 5, 6]}
    for i, anc in expected.items():
        assert mask[0, i].nonzero().flatten().tolist() == anc
