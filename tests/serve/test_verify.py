"""Tree verification: golden greedy walks, and sampling that is distribution-exact (chi-square tests
against the target's own sampling, with negative controls showing the test can fail) and draws at each position
what the target draws there on its own."""

import pytest
import torch
from scipy.stats import chisquare

import eyas.serve.sampling as sampling
from eyas.serve.sampling import (
    TORCH_PROBS,
    SamplingParams,
    SamplingRows,
    for_prompt,
    nucleus_floor,
    position_uniforms,
    sample,
    target_probs,
)
from eyas.serve.tree import ancestor_mask
from eyas.serve.verify import verify_greedy, verify_sampling

V = 6  # tiny vocab for the statistical tests
DRAWS = 20_000
P_MIN = 1e-3


def probs_of(logits: torch.Tensor, params) -> torch.Tensor:
    """`target_probs` with one SamplingParams for every row of `logits`, or one per row."""
    return target_probs(logits, SamplingRows.of(params, len(logits), logits.shape[-1], logits.device))


def argmax_logits(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    """[N, vocab] logits whose row j has its unique maximum at argmaxes[j]."""
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float() * 3.0


def run_greedy(tokens, parents, argmaxes, valid=None):
    tokens, parents = torch.tensor(tokens), torch.tensor(parents)
    logits = torch.stack([argmax_logits(a) for a in argmaxes])
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else torch.tensor(valid)
    acc, n, bonus = verify_greedy(tokens, parents, logits, valid)
    return acc.tolist(), n.tolist(), bonus.tolist()


# --- greedy: golden walks ------------------------------------------------------------------------


def test_greedy_chain():
    # root predicts 2 = node 1, node 1 predicts 7 = node 2, node 2 predicts 3 != node 3's 1.
    assert run_greedy([[5, 2, 7, 1]], [[-1, 0, 1, 2]], [[2, 7, 3, 0]]) == ([[0, 1, 2, -1]], [2], [3])


def test_greedy_branching():
    tokens = [[0, 3, 4, 5, 6, 6, 2]] * 4
    parents = [[-1, 0, 0, 0, 1, 2, 2]] * 4
    argmaxes = [
        [4, 6, 2, 0, 1, 1, 7],  # root -> node 2 (2nd child) -> node 6 (its 2nd child); bonus 7
        [4, 6, 6, 0, 1, 3, 7],  # root -> node 2 -> node 5 (token 6 under node 2, not node 4 under node 1)
        [1, 6, 6, 0, 1, 3, 7],  # root predicts 1: no child matches; bonus 1
        [5, 6, 6, 2, 1, 3, 7],  # root -> node 3 (a leaf); bonus 2
    ]
    acc, n, bonus = run_greedy(tokens, parents, argmaxes)
    assert acc == [[0, 2, 6, -1, -1, -1, -1], [0, 2, 5, -1, -1, -1, -1], [0] + [-1] * 6, [0, 3] + [-1] * 5]
    assert n == [2, 2, 0, 1]
    assert bonus == [7, 3, 1, 2]


def test_greedy_duplicate_siblings_take_the_first():
    assert run_greedy([[0, 4, 4]], [[-1, 0, 0]], [[4, 2, 3]]) == ([[0, 1, -1]], [1], [2])


def test_greedy_root_only():
    assert run_greedy([[3]], [[-1]], [[5]]) == ([[0]], [0], [5])


def test_greedy_padded_batch():
    tokens = [[5, 2, 7, 1], [3, 6, 6, 6]]
    parents = [[-1, 0, 1, 2], [-1, 0, 0, 1]]
    argmaxes = [[2, 7, 1, 4], [6, 6, 0, 6]]
    # Row 1: node 1 (and its child node 3) are padding although their tokens match the target.
    valid = [[True] * 4, [True, False, True, False]]
    acc, n, bonus = run_greedy(tokens, parents, argmaxes, valid)
    assert acc == [[0, 1, 2, 3], [0, 2, -1, -1]]
    assert n == [3, 1]
    assert bonus == [4, 0]


# --- sampling: exactness against the target's own sampling ---------------------------------------


def make_tree(parents: list[int], ranks: list[int], seed: int = 0):
    """A fixed target over a tiny vocab and a draft tree in it. Node j's token is the ranks[j]-th most
    likely token after its parent (0 = likely, V - 1 = unlikely; distinct among siblings). The target's
    logits after a path are those of the node ending it; after (root, a) with no such node, `off`.
    Returns tokens [N], parents [N], logits [N, V], off [V]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(parents), V, generator=g) * 1.5
    off = torch.randn(V, generator=g) * 1.5
    tokens = [0]
    for j in range(1, len(parents)):
        tokens.append(int(logits[parents[j]].argsort(descending=True)[ranks[j]]))
    return torch.tensor(tokens), torch.tensor(parents), logits, off


CHAIN = make_tree([-1, 0, 1, 2], [0, 1, 0, 3], seed=1)
# Root with 3 children (likely, unlikely, middling), each with 2 children.
TREE = make_tree([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 4, 2, 1, 3, 0, 5, 1, 2], seed=2)


def duplicate_sibling_tree():
    """Root children: node 1, node 2 holding node 1's token (the same path, so the same logits) and node 3; node 4
    under node 1. Once node 1 is rejected its token has no mass left, so node 2 must never be accepted."""
    tokens, parents, logits, off = make_tree([-1, 0, 0, 0, 1], [0, 1, 1, 0, 0], seed=3)
    logits[2] = logits[1]
    return tokens, parents, logits, off


DUPLICATE = duplicate_sibling_tree()
PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.5, top_k=3),
    SamplingParams(top_p=0.7),
    SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
]


def target_first_two(tree, params):
    """Exact target distributions: first token p1 [V] and second given first, cond [V (first), V]."""
    tokens, parents, logits, off = tree
    after = off.expand(V, V).clone()  # [a, V]: logits after (root, a)
    for j in torch.nonzero(parents == 0).flatten():
        after[tokens[j]] = logits[j]
    return probs_of(logits[:1], params)[0].double(), probs_of(after, params).double()


def depths(parents: torch.Tensor) -> torch.Tensor:
    """parents [..., N] -> each node's depth [..., N] (the root's 0), its position past the root's: its ancestors'
    count, as the drafter's trees give it."""
    N = parents.shape[-1]
    return ancestor_mask(parents.reshape(-1, N), N - 1).sum(-1).view(parents.shape) - 1


def speculative_first_two(tree, params, seed=0):
    """First two emitted tokens of DRAWS verifications of the same tree [DRAWS] each, one seed each. When a step
    emits only one token, the second comes from the target's next step, drawn here as it is: by the same seed at
    the next position."""
    tokens, parents, logits, off = tree
    N = len(tokens)
    seeds = torch.arange(DRAWS) + seed * DRAWS
    valid = torch.ones(DRAWS, N, dtype=torch.bool)
    acc, n, bonus = verify_sampling(tokens.expand(DRAWS, N), parents.expand(DRAWS, N), logits.expand(DRAWS, N, V),
                                    valid, params, seeds, depths(parents).expand(DRAWS, N))
    emitted = torch.cat([tokens[acc[:, 1:].clamp(min=0)], bonus[:, None]], 1)  # [DRAWS, N]
    emitted.scatter_(1, n[:, None], bonus[:, None])  # the bonus right after the accepted drafts
    first, second = emitted[:, 0], emitted[:, 1]
    _, cond = target_first_two(tree, params)
    next_step = sample(cond[first].float(), sampling.position_uniforms(seeds, torch.ones(DRAWS, dtype=torch.long)))
    return first, torch.where(n == 0, next_step, second)


def chi2_pvalue(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness of fit of integer samples to probabilities `expected` (flattened). Outcomes
    of expected count < 5 are pooled; an outcome of probability 0 that occurs gives p = 0."""
    expected = expected.flatten()
    counts = torch.bincount(samples, minlength=len(expected)).double()
    if counts[expected == 0].sum() > 0:
        return 0.0
    exp = expected / expected.sum() * len(samples)
    big = exp >= 5
    obs_bins, exp_bins = [*counts[big].tolist()], [*exp[big].tolist()]
    if (~big & (exp > 0)).any():
        obs_bins.append(counts[~big].sum().item())
        exp_bins.append(exp[~big].sum().item())
    return float(chisquare(obs_bins, exp_bins).pvalue)


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("tree", [CHAIN, TREE, DUPLICATE], ids=["chain", "tree", "duplicate"])
def test_sampling_is_exact(tree, params):
    p1, cond = target_first_two(tree, params)
    first, second = speculative_first_two(tree, params)
    assert chi2_pvalue(first, p1) > P_MIN
    assert chi2_pvalue(first * V + second, p1[:, None] * cond) > P_MIN  # joint over V * V outcomes


def test_biased_draws_fail_the_test(monkeypatch):
    """Uniforms squared (draws leaning to the vocabulary's first tokens) give a first token the test rejects."""
    monkeypatch.setattr(sampling, "position_uniforms",
                        lambda seeds, positions: position_uniforms(seeds, positions) ** 2)
    p1, _ = target_first_two(TREE, PARAMS[0])
    first, _ = speculative_first_two(TREE, PARAMS[0])
    assert chi2_pvalue(first, p1) < P_MIN


def test_one_uniform_for_every_position_fails_the_test(monkeypatch):
    """A request's draws not keyed to their position (one uniform for all): each token alone is drawn from its
    distribution, but the two are not independent, and the joint test rejects them."""
    monkeypatch.setattr(sampling, "position_uniforms",
                        lambda seeds, positions: position_uniforms(seeds, torch.zeros_like(positions)))
    p1, cond = target_first_two(TREE, PARAMS[0])
    first, second = speculative_first_two(TREE, PARAMS[0])
    assert chi2_pvalue(first, p1) > P_MIN
    assert chi2_pvalue(first * V + second, p1[:, None] * cond) < P_MIN


def test_position_uniforms_are_splitmix64():
    """The draws are splitmix64's outputs (its top 53 bits) at state seed + (position + 1) * gamma, computed here with
    Python's unbounded integers: seed 0's first is 0xe220a8397b1dcdaf, the generator's published first output."""
    mask = (1 << 64) - 1

    def reference(seed, position):
        z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return ((z ^ (z >> 31)) >> 11) / 2**53

    assert reference(0, 0) == (0xE220A8397B1DCDAF >> 11) / 2**53
    seeds = torch.tensor([0, 1, -5, 2**62, -(2**63)])
    positions = torch.tensor([[0, 1, 2, 1000, 2**40]] * 5)
    expected = [[reference(s % (1 << 64), p) for p in positions[0].tolist()] for s in seeds.tolist()]
    assert position_uniforms(seeds, positions).tolist() == expected


# --- sampling: batching, padding, seeds ------------------------------------------------------------


def random_trees(B=64, N=12, vocab=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(j, (1,), generator=g)) for j in range(1, N)])
                           for _ in range(B)])
    tokens = torch.randint(vocab, (B, N), generator=g)
    logits = torch.randn(B, N, vocab, generator=g)
    # Make some drafts the argmax after their parent so that greedy accepts deep paths.
    hit = torch.rand(B, N, generator=g) < 0.6
    tokens = torch.where(hit, logits.argmax(-1).gather(1, parents.clamp(min=0)), tokens)
    valid = torch.arange(N) < torch.randint(1, N + 1, (B, 1), generator=g)  # padded tails
    return tokens, parents, logits, valid


def seeded(B: int, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B requests' seeds (0, 1, ...) and their trees' node positions, past a 100-token prefix."""
    return torch.arange(B), 100 + depths(parents)


def test_a_seeded_run_gives_each_prompt_a_seed_of_its_own():
    """`for_prompt`: a prompt's seed repeats for the same run seed and prompt (token ids or a conversation), and moves
    with either; the other fields stay; an unseeded or greedy run's params pass through."""
    run = SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=7)
    conversation = [{"role": "user", "content": "Hi"}]
    seeds = {str(prompt): for_prompt(run, prompt).seed for prompt in ([1, 2, 3], [1, 2, 4], conversation)}
    assert len(set(seeds.values())) == 3 and 7 not in seeds.values()
    assert for_prompt(run, [1, 2, 3]) == SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=seeds["[1, 2, 3]"])
    assert for_prompt(run, [{"content": "Hi", "role": "user"}]).seed == seeds[str(conversation)]  # keys in any order
    assert for_prompt(SamplingParams(temperature=0.8, seed=8), [1, 2, 3]).seed != seeds["[1, 2, 3]"]
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=0, seed=7)):
        assert for_prompt(params, [1, 2, 3]) is params


def test_temperature_zero_sampling_equals_greedy():
    tokens, parents, logits, valid = random_trees()
    greedy = verify_greedy(tokens, parents, logits, valid)
    sampled = verify_sampling(tokens, parents, logits, valid, SamplingParams(temperature=0), *seeded(64, parents))
    assert greedy[1].float().mean() > 1  # the trees do get accepted deeply
    for a, b in zip(greedy, sampled, strict=True):
        assert torch.equal(a, b)


def test_mixed_params_and_per_request_seeds():
    tokens, parents, logits, valid = random_trees()
    B = len(tokens)
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(top_k=3) for i in range(B)]
    first, again = (verify_sampling(tokens, parents, logits, valid, params, *seeded(B, parents)) for _ in range(2))
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)  # seeds reproduce
    other = verify_sampling(tokens, parents, logits, valid, params, torch.arange(B) + B, 100 + depths(parents))
    assert not torch.equal(first[2][::2], other[2][::2])  # and other seeds draw otherwise
    greedy = verify_greedy(tokens, parents, logits, valid)
    for a, b in zip(first, greedy, strict=True):
        assert torch.equal(a[1::2], b[1::2])  # greedy rows of a mixed batch are exactly greedy


@pytest.mark.parametrize("group_entries", [1, 2 * 7 * 50, 5 * 7 * 50], ids=["one-request", "two", "five"])
def test_draws_in_groups_of_requests_equal_one_draw(group_entries, monkeypatch):
    """`draw` turns a group of requests' logits into probabilities at a time (DRAW_ENTRIES); the draws equal one
    draw over the whole batch, with every filter and greedy rows mixed in, in bf16 as the engine passes them."""
    g = torch.Generator().manual_seed(4)
    B, N, V = 9, 7, 50
    logits = (3 * torch.randn(B, N, V, generator=g)).bfloat16()
    params = [SamplingParams(temperature=0), SamplingParams(top_k=3), SamplingParams(top_p=0.8),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams()] * 2
    rows = SamplingRows.of(params[:B], B, V, "cpu")
    seeds, positions = torch.arange(B) * 977, torch.arange(N).expand(B, N) + 30
    whole = sampling.draw(logits, rows, seeds, positions)
    monkeypatch.setattr(sampling, "DRAW_ENTRIES", group_entries)
    assert torch.equal(sampling.draw(logits, rows, seeds, positions), whole)
    assert torch.equal(whole[0], logits[0].float().argmax(-1))  # a greedy row's draws are its argmax


def test_each_position_draws_what_the_target_draws_there_alone():
    """Every token a sampled verification emits is the target's own draw at its position: what sampling the
    distribution after its parent (alone, as a plain decoding step does) with the seed's uniform there gives."""
    tokens, parents, logits, valid = random_trees(B=256)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    seeds, positions = seeded(256, parents)
    acc, n, bonus = verify_sampling(tokens, parents, logits, valid, params, seeds, positions)
    alone = sample(probs_of(logits, params), position_uniforms(seeds, positions))  # [B, N]: each node's own draw
    path = acc.clamp(min=0)
    last = path.gather(1, n[:, None])[:, 0]
    assert torch.equal(bonus, alone.gather(1, last[:, None])[:, 0])
    for b in range(256):
        for d in range(1, int(n[b]) + 1):  # an accepted node holds its parent's draw
            assert tokens[b, path[b, d]] == alone[b, path[b, d - 1]]
    assert (n >= 2).sum() > 10  # some paths go deep


def test_sampling_never_accepts_padding():
    tokens, parents, logits, valid = random_trees(B=512)
    acc, n, _ = verify_sampling(tokens, parents, logits, valid, SamplingParams(), *seeded(512, parents))
    path = acc >= 0
    assert torch.equal(path.sum(1), n + 1)
    assert valid.gather(1, acc.clamp(min=0))[path].all()
    # Each accepted node is a child of the previous one, with parents before children.
    prev, node = acc[:, :-1], acc[:, 1:]
    step = node >= 0
    assert torch.equal(parents.gather(1, node.clamp(min=0))[step], prev[step])


def test_children_holding_all_the_mass_never_yield_an_impossible_bonus(monkeypatch):
    """With top-k 2 and the root's two children holding the two kept tokens, a uniform just below 1 times the mass
    can round to the total: the draw must still be a token the target can emit (never one after the last kept token in
    the vocabulary, outside the top 2)."""
    B, V = 256, 16
    logits = torch.randn(B, 3, V, generator=torch.Generator().manual_seed(0))
    top2 = logits[:, 0].topk(2).indices  # [B, 2]
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), top2], 1)
    parents = torch.tensor([[-1, 0, 0]] * B)
    params = SamplingParams(top_k=2)
    monkeypatch.setattr(sampling, "position_uniforms",
                        lambda seeds, positions: torch.full(positions.shape, 1 - 2**-53, dtype=torch.float64))
    acc, n, bonus = verify_sampling(tokens, parents, logits, torch.ones(B, 3, dtype=torch.bool), params,
                                    *seeded(B, parents))
    last = acc.gather(1, n[:, None])[:, 0]  # the node the bonus follows
    probs = probs_of(logits, params)
    assert (probs[torch.arange(B), last, bonus] > 0).all()


@pytest.mark.gpu
def test_sampling_walk_never_waits_for_the_gpu():
    """On CUDA the sampling walk, its per-request parameters and seeds included, queues its work and never reads
    the device (so the engine can capture it in the target pass's graph, and a prefill's first token queues the
    steps after it); its paths are still well formed, and its draws are those on the CPU."""
    trees = random_trees()
    tokens, parents, logits, valid = (x.cuda() for x in trees)
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9) for _ in range(len(tokens))]
    seeds, positions = (x.cuda() for x in seeded(len(tokens), trees[1]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        acc, n, bonus = verify_sampling(tokens, parents, logits, valid, params, seeds, positions, max_depth=11)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    path = acc >= 0
    assert torch.equal(path.sum(1), n + 1) and valid.gather(1, acc.clamp(min=0))[path].all()
    assert ((0 <= bonus) & (bonus < logits.shape[-1])).all()
    assert torch.equal(position_uniforms(seeds, positions).cpu(), position_uniforms(*seeded(len(tokens), trees[1])))


def test_params_validation():
    for bad, field in [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(seed="1"), "seed"),
        (dict(seed=2**63), "seed"),  # int64 only: the draws' arithmetic is int64's
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    SamplingParams(temperature=0, top_k=-1, top_p=1.0, seed=7)


def test_nucleus_floor_keeps_ties():
    """The worked example of `nucleus_floor`'s docstring, row by row: top-k 2 keeps the tie at 0.2 whole; top-k 3 with
    top-p 0.6; top-p 0.5 alone keeps the 0.5; neither filter keeps everything."""
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1]] * 4)
    floor = nucleus_floor(probs, torch.tensor([2.0, 3.0, 4.0, 4.0]), torch.tensor([1.0, 0.6, 0.5, 1.0]))
    assert torch.equal(floor, torch.tensor([0.2, 0.2, 0.5, 0.0]))
    kept = probs_of(torch.tensor([[3.0, 1.0, 1.0, 0.0]]), SamplingParams(top_k=2)) > 0
    assert torch.equal(kept, torch.tensor([[True, True, True, False]]))


def test_a_draw_at_the_top_of_the_cdf_keeps_to_tokens_with_mass():
    """A uniform whose product with the mass rounds to the total (here u = 1) falls past the cdf; the draw falls back
    to the last token with mass, not to a zeroed one after it."""
    q = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0], [0.2, 0.3, 0.1, 0.1, 0.3]])
    assert sample(q, torch.ones(3)).tolist() == [2, 1, 4]
    assert sample(q, torch.zeros(3)).tolist() == [0, 1, 0]


def test_floor_searches_only_the_filters_some_row_uses():
    """target_probs passes a filter no row uses as None (its search skipped), and asks nothing when none is used;
    the probabilities are those of every filter passed (up to the renormalisation a filter does)."""
    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(0))
    cases = [([SamplingParams(top_p=0.9)] * 3, (False, True)), ([SamplingParams(top_k=5)] * 3, (True, False)),
             ([SamplingParams(top_k=5), SamplingParams(), SamplingParams(top_p=0.5)], (True, True)),
             ([SamplingParams(temperature=0.5), SamplingParams(temperature=0)] + [SamplingParams()], None)]
    calls = []  # (top-k passed, top-p passed) of each call

    def floor(probs, top_k, top_p):
        calls.append((top_k is not None, top_p is not None))
        return nucleus_floor(probs, top_k, top_p)

    for params, asked in cases:
        calls.clear()
        rows = SamplingRows.of(params, 3, 50, "cpu")
        probs = target_probs(logits, rows, TORCH_PROBS._replace(nucleus_floor=floor))
        assert calls == ([asked] if asked else [])
        every_filter = SamplingRows(rows.values, True, True, rows.any_greedy)
        if asked:
            assert torch.equal(probs, target_probs(logits, every_filter))
        else:
            torch.testing.assert_close(probs, target_probs(logits, every_filter))


def test_target_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]])
    full = logits.softmax(-1)
    k2 = probs_of(logits, SamplingParams(top_k=2))
    assert torch.allclose(k2[0], torch.tensor([full[0, 0], full[0, 1], 0, 0]) / full[0, :2].sum())
    # top_p = 0.7: keep the shortest prefix by probability with mass >= 0.7 (row 0: 0.644 + 0.237).
    p = probs_of(logits, SamplingParams(top_p=0.7))
    assert torch.equal(p[0] > 0, torch.tensor([True, True, False, False]))
    assert torch.allclose(p[0, :2], full[0, :2] / full[0, :2].sum())  # the kept mass renormalised
    assert torch.allclose(p.sum(-1), torch.ones(2))
    # A top_k past the vocabulary (the API bounds it from below only) keeps every token, however large.
    for huge in (4, 5, 2**70):
        assert torch.equal(probs_of(logits, [SamplingParams(top_k=huge)] * 2), full)
    mixed = probs_of(logits, [SamplingParams(temperature=0), SamplingParams(temperature=2.0)])
    assert torch.equal(mixed[0], torch.tensor([1.0, 0, 0, 0]))
    # A temperature too small to divide by (float32 overflows to inf, then NaN) is greedy, as 0 is.
    for tiny in (1e-6, 1e-40, 1e-300):
        assert torch.equal(probs_of(logits, [SamplingParams(temperature=tiny)] * 2), probs_of(
            logits, SamplingParams(temperature=0)))
    assert torch.allclose(mixed[1], (logits[1] / 2).softmax(-1))
