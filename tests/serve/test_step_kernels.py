"""The fused kernels of a decode step's work around the model's layers (serve/step_kernels.py) match their torch
references: the draft's top-k and tree bookkeeping (serve/tree.py), verification's walks and the target's
probabilities (serve/verify.py, serve/sampling.py), and the accept phase's (serve/accept.py).

As in test_kernels.py, each `check_*` body runs on CUDA at the real shapes (`gpu` marker) and on CPU under Triton's
interpreter with small shapes, in a spawned worker whose launches are also compiled for Hopper as far as Triton's IR.
"""

import dataclasses

import pytest
import torch

from eyas.serve import accept, sampling, tree
from eyas.serve.kv_cache import KVPool
from eyas.serve.verify import verify_greedy
from tests import triton_interpreter
from tests.serve.kernel_cases import DTYPES, dtype_id, randn

pytest.importorskip("triton", reason="triton is not installed (the fused kernels are optional)")
from eyas.serve import hopper_compile, step_kernels  # noqa: E402  (needs triton)


def check_top_log_probs(device, dtype, shape, k, ties=False, impl=step_kernels.top_log_probs):
    """logits [*shape] -> the k best log-probs and indices, as a stable descending sort of the float log-softmax
    ranks them (equal logits: lower index first), none above 0 (a first row whose best holds nearly all the mass:
    a log-prob just above 0 would let a tree's child outscore its parent). `ties`: integer logits, most of them
    tied."""
    if ties:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randint(0, 4, shape, generator=gen).to(dtype=dtype, device=device)
    else:
        logits = randn(*shape, dtype=dtype, device=device, seed=0, scale=3.0)
    logits.view(-1, shape[-1])[0, 1] += 40
    logp = logits.float().log_softmax(-1)
    order = logp.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    values, indices = impl(logits, k)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64 and values.shape == order.shape
    assert torch.equal(indices, order) and (values <= 0).all()
    torch.testing.assert_close(values, logp.gather(-1, order), atol=1e-5, rtol=1e-5)


def check_verify_greedy(device, B, N, max_depth=None, impl=step_kernels.verify_greedy, dtype=torch.float32):
    """Random trees (duplicate siblings, padded tails, deep matches): the same walk as the torch verifier's on the
    logits' float32 copy, with the logits in `dtype` (the engine passes the target's, bf16 on a GPU)."""
    from tests.serve.test_verify import random_trees

    tokens, parents, logits, valid = (x.to(device) for x in random_trees(B, N, vocab=8, seed=N))
    logits = (logits * 3).to(dtype)  # spread, so that rounding to a half type leaves few ties
    ours = impl(tokens, parents, logits, valid, max_depth)
    reference = verify_greedy(tokens, parents, logits.float(), valid, max_depth)
    assert N < 3 or reference[1].float().mean() > 1  # the trees are accepted deeply
    for a, b in zip(ours, reference, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def check_softmax(device, R, V, impl=step_kernels.softmax):
    """Rows of random logits (bf16 and float32) at temperatures from 0.01 to 3, one row's tail at -inf (a chunk of
    it all -inf when V spans several chunks): the kernel's probabilities equal torch's up to float32 rounding."""
    g = torch.Generator().manual_seed(R * 1000 + V)
    x = torch.randn(R, V, generator=g) * 4
    x[0, V // 3:] = float("-inf")
    t = torch.logspace(-2, 0.5, R)
    for dtype in (torch.float32, torch.bfloat16):
        xs, ts = x.to(device, dtype), t.to(device)
        ours, reference = impl(xs, ts), sampling.softmax(xs, ts)
        assert ours.dtype == torch.float32 and ours.shape == (R, V)
        torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)


def check_row_sum(device, R, V, impl=step_kernels.row_sum):
    """Rows of random probabilities (one row's tail zero, one strided out of a wider tensor): the kernel's sums equal
    torch's up to float32 summation order."""
    g = torch.Generator().manual_seed(R * 1000 + V)
    x = torch.rand(R, V + 3, generator=g)[:, :V]
    x[0, V // 2:] = 0
    ours, reference = impl(x.to(device)), sampling.row_sum(x.to(device))
    assert ours.dtype == torch.float32 and ours.shape == (R,)
    torch.testing.assert_close(ours, reference, atol=0, rtol=1e-5)


def check_nucleus_floor(device, R, V):
    """Rows of random logits at several temperatures (one so sharp most probabilities are 0, one with ties), with
    top-k and top-p on and off in turn. Top-k floors (counts are exact) equal the sorting reference; top-p floors,
    whose masses are summed in another order, meet the definition in float64 up to float32 rounding: the tokens
    from the floor up hold the goal, those above it do not. A filter passed as None (off in every row, its search
    skipped) gives what it gives switched off row by row."""
    g = torch.Generator().manual_seed(R * 1000 + V)
    logits = torch.randn(R, V, generator=g) * torch.tensor([0.3, 1.0, 3.0, 300.0]).repeat(R)[:R, None]
    logits[1::5] = logits[1::5].round(decimals=1)  # ties: logits on a grid of 0.1
    probs = logits.softmax(-1).to(device)
    top_k = torch.tensor([[V, 1, 7, V, 2 * V, V // 3][i % 6] for i in range(R)]).float().to(device)
    top_p = torch.tensor([[0.9, 1.0, 0.5, 0.999, 1.0, 1.0, 0.05][i % 7] for i in range(R)]).to(device)
    ours, reference = step_kernels.nucleus_floor(probs, top_k, top_p), sampling.nucleus_floor(probs, top_k, top_p)
    assert ours.dtype == torch.float32 and ours.shape == (R,)
    only_k = top_p == 1
    assert torch.equal(ours[only_k], reference[only_k])
    p, by_k = probs.double().cpu(), sampling.nucleus_floor(probs, top_k, torch.ones_like(top_p)).cpu()
    for row in torch.nonzero(~only_k).flatten().tolist():
        kept = p[row][p[row] >= by_k[row]]
        goal, floor = top_p[row].item() * kept.sum(), ours[row].item()
        assert floor in kept and kept[kept >= floor].sum() >= goal * (1 - 1e-5)
        assert kept[kept > floor].sum() < goal * (1 + 1e-5)
    k_off, p_off = torch.full_like(top_k, V), torch.ones_like(top_p)
    for floor in (step_kernels.nucleus_floor, sampling.nucleus_floor):
        assert torch.equal(floor(probs, None, top_p), floor(probs, k_off, top_p))
        assert torch.equal(floor(probs, top_k, None), floor(probs, top_k, p_off))


def check_tree_builder(device, B, k, steps, n, ties=False, impl=step_kernels.DRAFT):
    """Two builders fed the same random passes, the torch one and one on `impl`'s kernels: every pass's frontier
    and candidates, and the final tree, equal. `ties`: integer log-probs, -inf among them (ranks fall to creation
    order, as a stable sort orders them)."""
    gen = torch.Generator().manual_seed(B * 1000 + k * 10 + steps)

    def children(*shape):  # a pass's top-k output: log-probs [*shape, k] descending, tokens [*shape, k]
        if ties:
            scores = -torch.randint(0, 3, (*shape, k), generator=gen).float()
            scores[torch.rand(scores.shape, generator=gen) < 0.1] = float("-inf")
        else:  # each node's best child far ahead of the rest: the kept tree reaches the deepest pass
            scores = -3 * torch.rand(*shape, k, generator=gen)
            scores[..., 0] = -0.01 * torch.rand(shape, generator=gen)
        tokens = torch.randint(0, 1000, (*shape, k), generator=gen)
        return scores.sort(dim=-1, descending=True).values.to(device), tokens.to(device)

    roots = torch.randint(0, 1000, (B,), generator=gen).to(device)
    reference, fused = tree.TreeBuilder(roots, k), tree.TreeBuilder(roots, k, impl)
    first = children(B)
    assert torch.equal(reference.first(*first), fused.first(*first))
    for _ in range(steps - 1):
        step = children(B, k)
        assert torch.equal(reference.extend(*step), fused.extend(*step))
        for field in dataclasses.fields(tree.Frontier):
            ours, theirs = getattr(fused.frontier, field.name), getattr(reference.frontier, field.name)
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), field.name
        for ours, theirs in zip(fused.scores + fused.parents, reference.scores + reference.parents, strict=True):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    ours, theirs = fused.finalize(n), reference.finalize(n)
    assert theirs.depth.max() == min(steps, n - 1) or ties  # the walk reaches the deepest nodes
    for field in dataclasses.fields(tree.DraftTree):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        assert a.dtype == b.dtype and torch.equal(a, b), field.name


def check_frontier_inputs(device, B, k, V, H, first, impl=step_kernels.frontier_inputs):
    """Random frontier tokens and parent rows (before the first pass: every node's parent is the extension's one
    output row): the kernel's embeddings and parent outputs equal the torch reference's, and their dtypes."""
    gen = torch.Generator().manual_seed(B * 100 + k * 10 + first)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokens = torch.randint(0, V, (B, k), generator=gen).to(device)
    embeddings = torch.randn(V, H, generator=gen).to(device, dtype)
    outputs = torch.randn(B, 1 if first else k, H, generator=gen).to(device, dtype)
    rows = None if first else torch.randint(0, k, (B, k), generator=gen).to(device)
    for ours, theirs in zip(impl(tokens, embeddings, outputs, rows),
                            tree.frontier_inputs(tokens, embeddings, outputs, rows), strict=True):
        assert ours.shape == theirs.shape == (B, k, H) and ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def random_paths(B, N, T, gen):
    """Accepted paths as verification gives them: [B, N] rising node indices from the root (node 0), then -1; and
    num_accepted [B], from 0 to T - 1. Row 0 accepts the most, its nodes packed from node 2 on where they fit, so
    that its moves read slots that earlier moves write; row 1 accepts nothing."""
    num_accepted = torch.randint(0, T, (B,), generator=gen)
    num_accepted[0] = T - 1
    num_accepted[1:2] = 0
    path = torch.full((B, N), -1)
    path[:, 0] = 0
    for b, m in enumerate(num_accepted.tolist()):
        packed = b == 0 and m + 1 < N
        nodes = torch.arange(2, m + 2) if packed else torch.randperm(N - 1, generator=gen)[:m] + 1
        path[b, 1 : m + 1] = nodes.sort().values
    return path, num_accepted


def block_tables(B, blocks_each, gen):
    """[B, blocks_each] int32: every row's own blocks, shuffled over the pool."""
    return torch.randperm(B * blocks_each, generator=gen).view(B, blocks_each).to(torch.int32)


def check_path_inputs(device, B, N, T, H, A, block_size=16, impl=step_kernels.path_inputs):
    """Random accepted paths (none accepted, all T - 1, in between), tables and target states (aux or none), the last
    of three or more rows a padding row (n = 0, a table of one block): the kernel's next tokens, positions, slots and
    rows of hidden and aux equal the torch reference's, and their dtypes."""
    gen = torch.Generator().manual_seed(B * 100 + N * 10 + T)
    path, num_accepted = random_paths(B, N, T, gen)
    tokens, bonus = torch.randint(0, 5000, (B, N), generator=gen), torch.randint(0, 5000, (B,), generator=gen)
    blocks_each = -(-(N + 40) // block_size)
    n = torch.randint(0, blocks_each * block_size - T, (B,), generator=gen)
    table = block_tables(B, blocks_each, gen)
    if B >= 3:
        n[-1], table[-1] = 0, B * blocks_each
    hidden = torch.randn(B, N, H, generator=gen).to(torch.bfloat16 if device == "cuda" else torch.float32)
    aux = None if A == 0 else torch.randn(B, N, A, generator=gen).to(hidden.dtype)
    inputs = [x if x is None else x.to(device) for x in (path, num_accepted, bonus, tokens, hidden, aux, n, table)]
    ours, reference = impl(*inputs, block_size, T), accept.path_inputs(*inputs, block_size, T)
    for name, a, b in [*zip(ours._fields[:3], ours[:3], reference[:3], strict=True),
                       ("hidden", ours.states.hidden, reference.states.hidden),
                       ("aux", ours.states.aux, reference.states.aux)]:
        assert (a is None) == (b is None) == (name == "aux" and A == 0), name
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), name


def check_move_path(device, B, N, T, L=2, Hkv=2, D=8, block_size=4, impl=step_kernels.move_path):
    """Random accepted paths moved in pools of random KV (rows' own blocks, shuffled; each row's path starting
    anywhere in them, across block boundaries): the kernel leaves every slot of every layer as the torch reference's
    gather and scatter do. The last of three or more rows is a padding row (n = 0, every position in the scratch
    block, where its moves collide): the scratch block is left out of the comparison."""
    gen = torch.Generator().manual_seed(B * 100 + N * 10 + T)
    path, num_accepted = random_paths(B, N, T, gen)
    padding = B >= 3
    real = B - padding
    blocks_each = -(-(N + 10) // block_size)
    n = torch.randint(0, blocks_each * block_size - N, (B,), generator=gen)
    table = block_tables(B, blocks_each, gen)
    if padding:  # the scratch block's id is the pool's block count
        n[-1], table = 0, torch.cat([block_tables(real, blocks_each, gen), table[-1:].fill_(real * blocks_each)])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pools = [KVPool(L, real * blocks_each, block_size, Hkv, D, dtype, device) for _ in range(2)]
    kv = torch.randn(pools[0].kv.shape, generator=gen).to(dtype)
    inputs = [x.to(device) for x in (path, num_accepted, n, table)]
    for pool, move in zip(pools, (impl, accept.move_path), strict=True):
        pool.kv.copy_(kv)
        move(pool, *inputs, T)
    kept = slice(0, real * blocks_each * block_size)  # every slot but the scratch block's
    assert not torch.equal(pools[1].kv[:, :, kept].cpu(), kv[:, :, kept])  # the reference moved something
    assert torch.equal(pools[0].kv[:, :, kept], pools[1].kv[:, :, kept])


# --- CUDA: the real shapes ---
@pytest.mark.gpu
@pytest.mark.parametrize("case", [((1, 32000), 8, False), ((8, 32000), 8, False), ((64, 8, 32000), 8, True),
                                  ((3, 49152), 10, False), ((2, 1000), 1, True), ((4, 128256), 32, False),
                                  ((64, 49152), 1, True), ((48, 128256), 1, False),  # verification's argmax
                                  ((2, 500), 40, False)], ids=str)  # k > TOP_MAX_K: the torch path
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_top_log_probs_cuda(dtype, case):
    check_top_log_probs("cuda", dtype, *case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(64, 12, None), (1, 48, 6), (8, 8, 7), (64, 60, 6), (4, 1, 0), (2, 97, 10),
                                  (64, 256, 12)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_verify_greedy_cuda(case, dtype):
    check_verify_greedy("cuda", *case, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 128256), (9, 128256), (392, 32000), (49, 49152), (7, 1000), (3, 5)], ids=str)
def test_softmax_cuda(case):
    check_softmax("cuda", *case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 128256), (9, 128256), (392, 32000), (49, 49152), (3, 5)], ids=str)
def test_row_sum_cuda(case):
    check_row_sum("cuda", *case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 128256), (9, 128256), (49, 128256), (392, 32000), (49, 49152), (7, 1000)],
                         ids=str)
def test_nucleus_floor_cuda(case):
    check_nucleus_floor("cuda", *case)


TREES_CUDA = [(1, 8, 6, 48), (1, 8, 8, 64), (64, 8, 6, 48), (4, 1, 7, 8), (3, 4, 5, 8), (2, 10, 6, 60),
              (2, 16, 4, 100), (2, 17, 3, 40), (1, 12, 16, 64)]  # B, k, steps, n; k 17, C 2173: torch


@pytest.mark.gpu
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("case", TREES_CUDA, ids=lambda c: "B{}-k{}-steps{}-n{}".format(*c))
def test_tree_builder_cuda(case, ties):
    check_tree_builder("cuda", *case, ties)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 8, 32000, 4096, True), (1, 4, 32000, 4096, False), (64, 8, 49152, 576, False),
                                  (4, 1, 128256, 4096, False), (3, 10, 1000, 1500, True)],
                         ids=lambda c: "B{}-k{}-V{}-H{}-first{}".format(*c))
def test_frontier_inputs_cuda(case):
    check_frontier_inputs("cuda", *case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 8, 6, 4096, 3 * 4096), (1, 48, 7, 576, 3 * 576), (64, 8, 6, 4096, 0),
                                  (8, 64, 9, 576, 3 * 576), (3, 2, 2, 100, 300), (4, 1, 1, 576, 3 * 576)],
                         ids=lambda c: "B{}-N{}-T{}-H{}-A{}".format(*c))
def test_path_inputs_cuda(case):
    check_path_inputs("cuda", *case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 8, 6, 32, 8, 128, 16), (1, 48, 7, 30, 3, 64, 16), (64, 8, 6, 32, 8, 128, 16),
                                  (8, 64, 9, 2, 2, 8, 4), (4, 8, 2, 2, 2, 8, 4)],
                         ids=lambda c: "B{}-N{}-T{}-L{}-Hkv{}-D{}-bs{}".format(*c))
def test_move_path_cuda(case):
    check_move_path("cuda", *case)


# --- CPU: Triton's interpreter, small shapes ---
@pytest.mark.parametrize("case", [((2, 3, 4100), 4, False), ((1, 70), 8, False), ((5, 2048), 3, True),
                                  ((2, 3000), 1, True)], ids=str)
def test_top_log_probs_interpreter(interpreter, case):
    interpreter(check_top_log_probs, "cpu", torch.float32, *case)


@pytest.mark.parametrize("case", [(16, 12, None), (3, 9, 3), (2, 1, 0)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_verify_greedy_interpreter(interpreter, case, dtype):
    interpreter(check_verify_greedy, "cpu", *case, step_kernels.verify_greedy, dtype)


@pytest.mark.parametrize("case", [(14, 300), (7, 2100), (3, 9000), (2, 1)], ids=str)
def test_nucleus_floor_interpreter(interpreter, case):
    interpreter(check_nucleus_floor, "cpu", *case)


@pytest.mark.parametrize("case", [(3, 5000), (2, 700), (1, 3)], ids=str)  # several chunks a row, one, one partial
def test_softmax_interpreter(interpreter, case):
    interpreter(check_softmax, "cpu", *case)


@pytest.mark.parametrize("case", [(3, 5000), (1, 3000)], ids=str)  # two and three chunks a row (one: torch's)
def test_row_sum_interpreter(interpreter, case):
    interpreter(check_row_sum, "cpu", *case)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("case", [(2, 4, 4, 12), (1, 3, 3, 20), (3, 1, 4, 5), (1, 2, 2, 3), (2, 4, 3, 300)],
                         ids=lambda c: "B{}-k{}-steps{}-n{}".format(*c))
def test_tree_builder_interpreter(interpreter, case, ties):
    interpreter(check_tree_builder, "cpu", *case, ties)


@pytest.mark.parametrize("case", [(2, 4, 50, 40, True), (3, 3, 70, 1500, False), (2, 1, 9, 7, False)],
                         ids=lambda c: "B{}-k{}-V{}-H{}-first{}".format(*c))  # one column chunk, two; a chain
def test_frontier_inputs_interpreter(interpreter, case):
    interpreter(check_frontier_inputs, "cpu", *case)


@pytest.mark.parametrize("case", [(3, 8, 6, 40, 120), (2, 12, 7, 1500, 0), (1, 2, 2, 3, 5), (2, 1, 1, 40, 120)],
                         ids=lambda c: "B{}-N{}-T{}-H{}-A{}".format(*c))  # one column chunk, two; one row; no path
def test_path_inputs_interpreter(interpreter, case):
    interpreter(check_path_inputs, "cpu", *case)


@pytest.mark.parametrize("case", [(3, 8, 6), (4, 12, 9), (2, 3, 2)], ids=lambda c: "B{}-N{}-T{}".format(*c))
def test_move_path_interpreter(interpreter, case):
    interpreter(check_move_path, "cpu", *case)


# --- wrong kernels the checks catch ---
def _walk_into_padding(tokens, parents, logits, node_valid, max_depth):
    return step_kernels.verify_greedy(tokens, parents, logits, torch.ones_like(node_valid), max_depth)


def _softmax_a_little_warmer(x, temperature):
    return step_kernels.softmax(x, temperature * 1.01)


def _row_sum_short_of_the_last(x):
    return step_kernels.row_sum(x[:, :-1])


def _top_of_unnormalised(logits, k):
    values, indices = logits.float().topk(k, dim=-1)
    return values, indices


def _forget_ancestors(frontier, child_scores, child_tokens, start):
    scores, parents, grown = step_kernels.grow_frontier(frontier, child_scores, child_tokens, start)
    grown.ancestors[:, :, : frontier.ancestors.shape[2]] = False
    return scores, parents, grown


def _walk_short(tokens, scores, parents, num_draft_tokens, max_depth):
    return step_kernels.select_tree(tokens, scores, parents, num_draft_tokens, max_depth - 1)


def _frontier_parents_of_row_zero(tokens, embeddings, outputs, rows):
    return step_kernels.frontier_inputs(tokens, embeddings, outputs, None)


def _path_a_position_late(path, num_accepted, bonus, tokens, hidden, aux, n, table, block_size, T):
    return step_kernels.path_inputs(path, num_accepted, bonus, tokens, hidden, aux, n + 1, table, block_size, T)


def _move_one_short(pool, path, num_accepted, n, table, T):
    step_kernels.move_path(pool, path, num_accepted - 1, n, table, T)


@pytest.mark.parametrize("check, args", [
    (check_top_log_probs, ("cpu", torch.float32, (2, 300), 4, False, _top_of_unnormalised)),
    (check_verify_greedy, ("cpu", 16, 12, None, _walk_into_padding)),
    (check_softmax, ("cpu", 3, 5000, _softmax_a_little_warmer)),
    (check_row_sum, ("cpu", 3, 5000, _row_sum_short_of_the_last)),
    (check_tree_builder, ("cpu", 2, 4, 4, 12, False, tree.DraftKernels(grow_frontier=_forget_ancestors))),
    (check_tree_builder, ("cpu", 2, 4, 4, 12, False, tree.DraftKernels(select_tree=_walk_short))),
    (check_frontier_inputs, ("cpu", 3, 4, 50, 40, False, _frontier_parents_of_row_zero)),
    (check_path_inputs, ("cpu", 3, 8, 6, 40, 120, 16, _path_a_position_late)),
    (check_move_path, ("cpu", 3, 8, 6, 2, 2, 8, 4, _move_one_short)),
], ids=["top-of-unnormalised", "walk-into-padding", "softmax-a-little-warmer", "row-sum-short-of-the-last",
        "frontier-forgets-ancestors", "tree-walk-short", "frontier-parents-of-row-zero", "path-a-position-late",
        "move-one-short"])
def test_checks_catch_wrong_kernels(interpreter, check, args):
    """The comparisons can fail: subtly wrong uses of each kernel are caught."""
    triton_interpreter.raises_in_comparison(interpreter, check, *args)


@pytest.mark.parametrize("rows, k, warps", [(64, 1, 2), (1, 1, 8), (8, 8, 8)])
def test_top_log_probs_runs_verification_argmax_on_two_warps(rows, k, warps):
    """Verification's argmax (k = 1) past one row runs its chunks on 2 warps; a draft's k best, and one row, on 8."""
    logits = torch.empty(rows, 49152, dtype=torch.bfloat16, device="meta")
    launches = hopper_compile.recorded_launches(lambda: step_kernels.top_log_probs(logits, k), module=step_kernels)
    (chunks,) = [launch for launch in launches if launch.kernel == "_chunk_top_kernel"]
    assert dict(chunks.options)["num_warps"] == warps
