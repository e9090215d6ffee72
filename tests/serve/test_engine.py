"""The engine: speculative greedy output equals target-only greedy output token for token; blocks are
returned; preemption and aborts never lose or corrupt a request."""

import collections
import copy
import dataclasses
import re

import pytest
import torch

from eyas.common.attention import CausalAttention, MaskedAttention, causal_mask
from eyas.common.config import ConfigError
from eyas.common.eagle3 import Eagle3Config, Eagle3Head
from eyas.common.hot_vocab import HotVocab
from eyas.common.target import TargetModel
from eyas.serve.attention.torch_sdpa import TorchPagedAttention
from eyas.serve.cuda_graphs import GraphCache, length_bucket
from eyas.serve.engine import Engine, EngineConfig, TreeShape
from eyas.serve.fp8 import dequantize, quantize
from eyas.serve.generate import greedy_tokens, target_tokens
from eyas.serve.sampling import SamplingParams
from eyas.serve.transfer import to_device
from eyas.serve.tree import TreeBuilder, top_log_probs
from tests.serve.heads import fitted_head, random_head

GREEDY = SamplingParams(temperature=0)
SHAPES = {"chain": TreeShape(4, 1, 5), "tree": TreeShape(3, 3, 8), "wide": TreeShape(4, 4, 16)}


def prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(L),), generator=g).tolist() for L in torch.randint(3, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def target(hf_checkpoint):
    return TargetModel.from_pretrained(hf_checkpoint("llama")[0])


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 8])
def test_speculative_greedy_equals_target_greedy(target, shape, batch):
    ps = prompts(batch, target.config.vocab_size)
    reference = [list(greedy_tokens(target, p, 24)) for p in ps]
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES[shape], block_size=4, num_blocks=256))
    requests = engine.generate(ps, GREEDY, max_new_tokens=24)
    assert [r.output for r in requests] == reference
    assert all(r.finish_reason == "length" for r in requests)
    assert engine.pool.allocator.num_free == 256


def test_block_table_is_built_again_only_when_blocks_change(target):
    """The engine hands out its last block table again while the rows' blocks, padding and width stay the same, and
    builds the pool's table afresh once any of them changes, even to blocks of the same count: a stale table would
    send a request's KV into another's blocks."""
    engine = Engine(target, None, EngineConfig(speculative=False, block_size=4, num_blocks=64))
    a, b = (engine.add_request(p, GREEDY, max_new_tokens=8) for p in prompts(2, target.config.vocab_size))
    engine.step()  # the prefill gives both their blocks

    def check(requests, pad):
        table = engine._block_table(requests, pad)
        assert torch.equal(table, engine.pool.block_table([r.blocks for r in requests], None, engine.table_width, pad))
        return table

    table = check([a, b], 2)
    assert engine._block_table([a, b], 2) is table
    for requests, pad in (([a, b], 1), ([b, a], 2), ([a], 2)):
        check(requests, pad)
    a.blocks[0], b.blocks[0] = b.blocks[0], a.blocks[0]
    check([a, b], 2)
    a.blocks.append(engine.pool.allocator.allocate(1)[0])
    check([a, b], 2)


def reference_tree(engine: Engine, request, shape: TreeShape, top_k):
    """The tree EAGLE-2 drafts for `request` now, recomputed without the paged cache: every pass runs the head over
    the whole sequence so far plus the nodes drafted so far, under an explicit mask (the head's one layer gives each
    position's k/v from its own inputs alone, so only the frontier's rows matter). `top_k(logits, k)` picks each
    pass's children."""
    head, target, hot, k, device = engine.drafter.head, engine.target, engine.drafter.hot, shape.topk, engine.device
    ids = torch.tensor([request.tokens], device=device)  # the prompt, what was generated, and the root last
    P = len(request.tokens) - 1
    positions = torch.arange(P, device=device)
    out = target(ids[:, :P], positions[None], CausalAttention(), aux_layers=engine.aux_layers)
    embeds, hidden = target.embed_tokens(ids[:, 1:]), head.project_target(out)
    mask = causal_mask(P, device)
    builder = TreeBuilder(ids[:, P], k)
    o = head.step(embeds, hidden, positions[None], MaskedAttention(mask[None]))
    tokens = builder.first(*top_k(head.logits(o[:, -1]), k))
    parents_out = o[:, -1:].expand(1, k, -1)
    for depth in range(1, shape.num_steps):
        embeds = torch.cat([embeds, target.embed_tokens(hot.to_target(tokens))], dim=1)
        hidden = torch.cat([hidden, parents_out], dim=1)
        positions = torch.cat([positions, torch.full((k,), P - 1 + depth, device=device)])
        S = len(positions)  # earlier nodes' rows see the prompt and themselves; their outputs are not read
        rows = torch.cat([mask, torch.ones(S - len(mask), len(mask), dtype=torch.bool, device=device)])
        mask = torch.cat([rows, torch.eye(S, dtype=torch.bool, device=device)[:, len(mask):]], dim=1)
        mask[-k:, P:] = builder.frontier.ancestors[0]
        o = head.step(embeds, hidden, positions[None], MaskedAttention(mask[None]))[:, -k:]
        tokens = builder.extend(*top_k(head.logits(o), k))
        parents_out = o.gather(1, builder.frontier.rows[:, :, None].expand(-1, -1, o.shape[-1]))
    tree = builder.finalize(shape.num_draft_tokens)
    return torch.cat([ids[:, P:], hot.to_target(tree.tokens[:, 1:])], dim=1), tree.parents


def recording(seen: list, top_k=top_log_probs):
    """`top_k` (a top_log_probs) that also keeps every logits tensor it is given."""
    def recorded(logits, k):
        seen.append(logits.clone())
        return top_k(logits, k)
    return recorded


def accepting_last_children(verify):
    """`verify_greedy` on logits rewritten so that after each node the target emits its last child's token: a
    random head's trees are then accepted as deep as they go, along paths of later-ranked nodes (which move)."""
    def verified(tokens, parents, logits, node_valid, max_depth=None):
        logits = logits.clone()
        for b, c in torch.nonzero(parents >= 0).tolist():  # children in node order: the last one written wins
            logits[b, parents[b, c]] = -1e9
            logits[b, parents[b, c], tokens[b, c]] = 1e9
        return verify(tokens, parents, logits, node_valid, max_depth)
    return verified


@torch.no_grad()
def check_drafted_tree(target, shape: TreeShape, tol: float, decode_steps: int = 0, padded: bool = False):
    """The draft's paged KV (the prompt's, extended at prefill, then along each decode step's accepted path, and
    each pass's frontier at its scratch slots) gives every pass the logits, and so the tree, that a cache-free
    recomputation gives. The decode steps accept paths of drafted nodes (`accepting_last_children`). Eager (no CUDA
    graphs: the recording runs each call); on CUDA with the Triton kernels. `padded`: in the fixed shapes of graphs
    (on CPU, where nothing is captured), the prefill's among them: its rows and length padded to their buckets."""
    device = target.embed_tokens.weight.device
    engine = Engine(target, random_head(target).to(device), EngineConfig(tree=shape, block_size=4, num_blocks=64,
                                                                          cuda_graphs=padded, overlap=False))
    assert engine.graphs.enabled == padded and not engine.graphs.capture
    engine.verify_greedy = accepting_last_children(engine.verify_greedy)
    request = engine.add_request(prompts(1, target.config.vocab_size, seed=3)[0], GREEDY, max_new_tokens=32)
    for _ in range(1 + decode_steps):  # the prefill (the first token, the draft extended over the prompt), then steps
        engine.step()
    assert not request.finished and len(request.accepted) == decode_steps and (sum(request.accepted) > 0) == (
        decode_steps > 0)
    assert_drafts_as_uncached(engine, request, shape, tol)


@torch.no_grad()
def assert_drafts_as_uncached(engine: Engine, request, shape: TreeShape, tol: float):
    """The tree the engine's draft gives `request` now (its pass logits and its tokens) is `reference_tree`'s."""
    device = engine.device
    engine._ensure_blocks()  # room for the tree drafted below
    served, recomputed = [], []
    kernels = engine.drafter.kernels  # on CUDA the fused ones: the reference drafts with torch's
    engine.drafter.kernels = dataclasses.replace(kernels, top_log_probs=recording(served, kernels.top_log_probs))
    tree = engine.drafter.draft_tree(shape, torch.tensor([request.last_token], device=device),
                                     request.draft.hidden[None], request.draft.logits[None],
                                     torch.tensor([request.cached], device=device), engine._block_table([request]))
    tokens, parents = reference_tree(engine, request, shape, recording(recomputed))
    assert len(served) == len(recomputed) == shape.num_steps
    for ours, theirs in zip(served, recomputed, strict=True):
        torch.testing.assert_close(ours, theirs.view(ours.shape), atol=tol, rtol=tol)
    assert torch.equal(tree.tokens, tokens) and torch.equal(tree.parents, parents)


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
@pytest.mark.parametrize("decode_steps", [0, 2], ids=["after-prefill", "after-2-steps"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_drafted_tree_equals_uncached_drafting(target, shape, decode_steps, padded, monkeypatch):
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", padded)
    check_drafted_tree(target, SHAPES[shape], 1e-5, decode_steps, padded)


@pytest.mark.gpu
@pytest.mark.parametrize("decode_steps", [0, 2], ids=["after-prefill", "after-2-steps"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_drafted_tree_equals_uncached_drafting_cuda(target, shape, decode_steps):
    check_drafted_tree(copy.deepcopy(target).to("cuda"), SHAPES[shape], 1e-4, decode_steps)


@pytest.mark.parametrize("shape", [TreeShape(4, 1, 5), TreeShape(4, 1, 3), TreeShape(1, 1, 2)], ids=str)
def test_chain_drafts_the_tree_the_selection_keeps(target, shape):
    """A chain (topk 1) drafts without the candidate pool (`Drafter._draft_chain`): for 2 requests its tree (tokens,
    parents, depths, mask) is the one the general drafting selects, also where that keeps fewer nodes than it drafts
    ((4, 1, 3): the chain runs two passes less)."""
    engine = Engine(target, random_head(target), EngineConfig(tree=shape, block_size=4, num_blocks=64, overlap=False))
    requests = [engine.add_request(p, GREEDY, 16) for p in prompts(2, target.config.vocab_size, seed=5)]
    engine.step()  # both prompts prefilled: each has the draft's state after its last position
    assert all(r.draft is not None for r in requests)
    engine._ensure_blocks()
    inputs = (torch.tensor([r.last_token for r in requests]), torch.stack([r.draft.hidden for r in requests]),
              torch.stack([r.draft.logits for r in requests]), torch.tensor([r.cached for r in requests]),
              engine._block_table(requests))
    with torch.no_grad():
        chain, general = engine.drafter._draft_chain(shape, *inputs), engine.drafter._draft_tree(shape, *inputs)
    assert chain[0].shape == (2, min(shape.num_draft_tokens, 1 + shape.num_steps))
    for ours, selected in zip(chain, general, strict=True):
        assert torch.equal(ours, selected)


@pytest.mark.parametrize("graphs", [False, True])
def test_settings_by_batch_size(target, graphs, monkeypatch):
    """Autotuned settings: as requests finish the batch shrinks 3 -> 2 -> 1 and each step drafts the tree of
    its batch size, or none (the draft falls behind, and catches up for batch size 1); the output stays the target's,
    and a request's speculative statistics count the steps that verified a drafted tree for it, not the plain ones."""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", graphs)
    ps = prompts(3, target.config.vocab_size, seed=5)
    lengths = [8, 16, 28]
    table = ((1, SHAPES["chain"]), (2, None), (3, SHAPES["tree"]))
    engine = Engine(target, random_head(target), EngineConfig(tree_by_batch=table, block_size=4, num_blocks=128))
    drafted = []  # (tree, batch) of every drafting step
    draft_tree = engine.drafter.draft_tree
    monkeypatch.setattr(engine.drafter, "draft_tree", lambda shape, *rest: (
        drafted.append((shape, len(engine.running))), draft_tree(shape, *rest))[1])
    verified = collections.Counter()  # request -> drafting steps that handed it tokens
    finish_decode = engine._finish_decode

    def counting(step):
        handed = [r for r in step.requests if not r.finished]
        finish_decode(step)
        verified.update(id(r) for r in handed if step.advance > 1)

    monkeypatch.setattr(engine, "_finish_decode", counting)
    requests = [engine.add_request(p, GREEDY, n) for p, n in zip(ps, lengths, strict=True)]
    while engine.has_work():
        engine.step()
    assert [r.output for r in requests] == [list(greedy_tokens(target, p, n)) for p, n in zip(ps, lengths, strict=True)]
    assert set(drafted) == {(SHAPES["tree"], 3), (SHAPES["chain"], 1)}
    assert [len(r.accepted) for r in requests] == [verified[id(r)] for r in requests]
    assert engine.decode_steps > len(drafted)  # the steps at batch size 2 drafted nothing
    assert engine.reserve == 1 + SHAPES["tree"].num_draft_tokens


@pytest.mark.parametrize("chunk", [2048, 16])
@pytest.mark.parametrize("graphs", [False, True])
def test_a_draft_left_behind_without_speculation_catches_up(target, graphs, chunk, monkeypatch):
    """At batch size 2 the setting is off: its steps cost what decoding without a head costs, so the draft is not
    extended and falls behind. When the other request ends, batch size 1 speculates: the remaining request goes back
    to its last drafted position, prefill steps recompute what it missed (one, or with 16-token chunks several,
    handing out no token and running no decode step until it is done), and the tree it then drafts is the one a
    cache-free recomputation drafts."""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", graphs)
    shape = SHAPES["tree"]
    engine = Engine(target, random_head(target), EngineConfig(tree_by_batch=((1, shape), (2, None)), block_size=4,
                                                               num_blocks=64, max_prefill_tokens=chunk, overlap=False))
    extended = []
    extend = engine.drafter.extend
    monkeypatch.setattr(engine.drafter, "extend", lambda *a, **k: (extended.append(1), extend(*a, **k))[1])
    long, short = (engine.add_request(p, GREEDY, n) for p, n in zip(prompts(2, target.config.vocab_size, seed=6),
                                                                    (48, 40), strict=True))
    while not (long.output and short.output):  # the prompts' prefill: the draft extended over them
        engine.step()
    passes, drafted_at = len(extended), long.cached
    assert long.drafted == drafted_at
    while not short.finished:
        engine.step()
    assert len(extended) == passes and long.drafted == drafted_at < long.cached and not long.accepted
    output, cached, decode_steps = list(long.output), long.cached, engine.decode_steps
    while long.drafted < cached:  # the catch-up: prefill chunks from the last drafted position
        engine.step()
        assert long.output == output and long.drafted == long.cached and engine.decode_steps == decode_steps
    assert len(extended) - passes == -(-(cached - drafted_at) // chunk) and long.cached == cached
    assert_drafts_as_uncached(engine, long, shape, 1e-5)
    while engine.has_work():
        engine.step()
    assert long.output == list(greedy_tokens(target, long.prompt, 48)) and long.accepted
    assert engine.pool.allocator.num_free == 64


def test_seeded_sampling_is_the_targets_own(target, trained):
    """A seeded sampled request through the engine (a tree, chunked prefill) emits what the target alone samples
    token by token (`target_tokens`: each token drawn at the position before it): the prefill's first token and
    every step's are keyed alike, drafts accepted or not. (A low temperature, so that the trained head's drafts are
    accepted: with a random head, or at 0.9, none were, and every step emitted its bonus token alone.)"""
    head, ps, _ = trained
    params = SamplingParams(temperature=0.1, top_p=0.95, seed=123)
    engine = Engine(target, head, EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=128,
                                               max_prefill_tokens=5))  # 8-token prompts: two chunks each
    requests = engine.generate(ps[:2], params, max_new_tokens=20)
    assert [r.output for r in requests] == [list(target_tokens(target, p, 20, params=params)) for p in ps[:2]]
    assert [r.output for r in requests] != [list(greedy_tokens(target, p, 20)) for p in ps[:2]]
    assert all(sum(r.accepted) > 0 for r in requests)


def test_a_seeded_request_draws_the_same_tokens_with_any_tree_or_none(target, trained):
    """A seeded sampled request's draws belong to its positions (`sampling.position_uniforms`): beside a greedy
    request, it emits the same tokens without speculation, with a chain, with a tree, and on a server that stops
    speculating at batch size 2 and catches its draft up once alone; the speculative runs do accept drafts (the
    trained head at a low temperature: a random head's, or at 0.8, were all rejected). Unseeded, two requests draw
    differently."""
    head, (long, short, *_), _ = trained
    params = SamplingParams(temperature=0.1, top_k=40, seed=11)
    settings = {"plain": dict(speculative=False), "chain": dict(tree=SHAPES["chain"]),
                "tree": dict(tree=SHAPES["tree"]), "by batch": dict(tree_by_batch=((1, SHAPES["tree"]), (2, None)))}
    outputs = {}
    for name, setting in settings.items():
        engine = Engine(target, head, EngineConfig(block_size=4, num_blocks=64, **setting))
        sampled, _ = engine.add_request(long, params, 40), engine.add_request(short, GREEDY, 8)
        while engine.has_work():
            engine.step()
        outputs[name] = sampled.output
        assert len(sampled.output) == 40 and (sum(sampled.accepted) > 0) == (name != "plain")
    assert all(out == outputs["plain"] for out in outputs.values())
    assert outputs["plain"] != list(greedy_tokens(target, long, 40))
    unseeded = dataclasses.replace(params, seed=None)
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=64))
    first, second = (r.output for r in engine.generate([long, long], unseeded, max_new_tokens=16))
    assert first != second


def test_no_tree_is_drafted_from_a_draft_left_behind(target, monkeypatch):
    """A preemption at batch size 2 (no speculation) leaves one request, whose draft is behind, in a batch size that
    speculates: that step decodes plainly and the next catches the draft up (not chained to it: the preempted request
    cannot come back, and chained steps would decode plainly to the end), so every tree is drafted from a current
    draft, and both requests verify trees."""
    shape = SHAPES["tree"]
    ps = prompts(2, target.config.vocab_size, seed=7)
    engine = Engine(target, random_head(target), EngineConfig(tree_by_batch=((1, shape), (2, None)), block_size=4,
                                                               num_blocks=24))
    current, preempted, plain = [], [], []  # plain: per decode step at batch size 1, whether it drafted no tree
    draft_tree, preempt, decode = engine.drafter.draft_tree, engine._preempt, engine._decode
    monkeypatch.setattr(engine.drafter, "draft_tree", lambda *a: (
        current.append(all(r.drafted == r.cached for r in engine.running)), draft_tree(*a))[1])
    monkeypatch.setattr(engine, "_preempt", lambda r: (preempted.append(len(engine.running)), preempt(r))[1])
    monkeypatch.setattr(engine, "_decode", lambda requests, after=None: (
        len(requests) == 1 and plain.append(engine._setting(requests) is None), decode(requests, after))[1])
    requests = engine.generate(ps, GREEDY, max_new_tokens=40)
    assert [r.output for r in requests] == [list(greedy_tokens(target, p, 40)) for p in ps]
    assert preempted == [2] and current and all(current)
    assert plain.count(True) == 1 and all(r.accepted for r in requests)
    assert engine.pool.allocator.num_free == 24


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fixed_shapes_of_cuda_graphs_change_nothing(target, shape, monkeypatch):
    """What CUDA graphs need, run eagerly on CPU: batches padded to their bucket (3 -> 4 rows, the padding
    row writing the scratch block), full-width block tables, draft extensions of fixed length."""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", True)
    ps = prompts(3, target.config.vocab_size, seed=4)
    reference = [list(greedy_tokens(target, p, 20)) for p in ps]
    for head in (random_head(target), None):
        engine = Engine(target, head, EngineConfig(tree=SHAPES[shape], block_size=4, num_blocks=96))
        assert engine.graphs.enabled and not engine.graphs.capture
        assert [r.output for r in engine.generate(ps, GREEDY, max_new_tokens=20)] == reference
        assert engine.pool.allocator.num_free == 96


def test_prefill_in_buckets_where_they_fit(target, monkeypatch):
    """With graphs a prefill chunk runs padded to its batch bucket and length bucket (here on CPU, uncaptured),
    except where the padded positions would pass the context's end: that chunk runs as it is. Output and acceptance
    are the unpadded engine's, the output the target's. (`test_drafted_tree_equals_uncached_drafting` checks the
    draft's state after a padded prefill.)"""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", True)
    ps = prompts(3, target.config.vocab_size, seed=9)
    ps[0] = (ps[0] * 10)[:170]  # the context is 192 positions; its length bucket, 256, is not
    padded = []  # (rows, columns) of every prefill run in a graph's shapes
    call = GraphCache.__call__
    monkeypatch.setattr(GraphCache, "__call__", lambda graphs, name, fn, *inputs: (
        padded.append(tuple(inputs[0].shape)) if name.startswith("prefill") else None, call(graphs, name, fn,
                                                                                             *inputs))[1])
    runs = []
    for graphs in (True, False):
        engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=48,
                                                                  cuda_graphs=graphs))
        assert engine.context_limit == 192
        requests = [engine.add_request(p, GREEDY, 10) for p in ps]
        while engine.has_work():
            engine.step()
        runs.append([(r.output, r.accepted) for r in requests])
    assert runs[0] == runs[1] and [output for output, _ in runs[0]] == [list(greedy_tokens(target, p, 10)) for p in ps]
    # The long prompt ran unpadded; the other two, admitted together once it ended, as one padded chunk.
    assert padded == [(2, length_bucket(max(map(len, ps[1:]))))]


def test_prompts_are_grouped_into_prefill_chunks_that_run_as_graphs(target, monkeypatch):
    """With graphs, prompts share a prefill step only while their padded chunk fits `max_prefill_tokens`: three
    prompts of 40 tokens fit 128 tokens as they are (120), but padded to 4 rows of 64 they would run eagerly."""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", True)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in (40, 40, 40, 40, 35)]
    graphed, steps = [], []  # (rows, columns) of each prefill run as a graph's shapes; every prefill step's rows
    call, prefill = GraphCache.__call__, Engine._prefill
    monkeypatch.setattr(GraphCache, "__call__", lambda graphs, name, fn, *inputs: (
        graphed.append(tuple(inputs[0].shape)) if name.startswith("prefill") else None, call(graphs, name, fn,
                                                                                              *inputs))[1])
    monkeypatch.setattr(Engine, "_prefill", lambda engine, requests: steps.append(len(requests)) or prefill(
        engine, requests))
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=128,
                                                              max_prefill_tokens=128))
    assert [r.output for r in engine.generate(ps, GREEDY, max_new_tokens=4)] == [
        list(greedy_tokens(target, p, 4)) for p in ps]
    assert steps == [2, 2, 1] and graphed == [(2, 64), (2, 64), (1, 64)]


@pytest.mark.parametrize("head", [False, True])
def test_a_short_last_chunk_beside_a_longer_one_at_the_context_s_end(target, head):
    """A long prompt's short last chunk, prefilled beside a newer prompt's longer chunk, is padded to it, past the
    context's end: the padding takes the last position's rotary angles (it used to index the rotary tables out of
    range and fail both requests). Both get the target's tokens."""
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (485, 60)]
    engine = Engine(target, random_head(target) if head else None,
                    EngineConfig(tree=SHAPES["tree"], speculative=head, block_size=4, num_blocks=256,
                                 max_prefill_tokens=120))
    assert engine.context_limit == target.config.max_position_embeddings == 512
    requests = [engine.add_request(p, GREEDY, 3) for p in ps]
    while engine.has_work():
        engine.step()
    assert [r.output for r in requests] == [list(greedy_tokens(target, p, 3)) for p in ps]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_triton_engine_equals_target_greedy(hf_checkpoint, target, shape, graphs):
    """The triton backend on CUDA (fp32), with CUDA graphs and without, gives the same greedy tokens as the
    reference on CPU, speculative (draft passes, tree verification, KV moves) and plain, over a batch of
    ragged prompts (6 rows: a bucket of 8 with graphs)."""
    ps = prompts(6, target.config.vocab_size, seed=3)
    reference = [list(greedy_tokens(target, p, 24)) for p in ps]
    cuda_target = TargetModel.from_pretrained(hf_checkpoint("llama")[0], device="cuda")
    for head in (random_head(target).cuda(), None):
        engine = Engine(cuda_target, head, EngineConfig(tree=SHAPES[shape], block_size=16, num_blocks=64,
                                                        attention="triton", cuda_graphs=graphs))
        assert engine.graphs.capture == graphs
        assert [r.output for r in engine.generate(ps, GREEDY, max_new_tokens=24)] == reference


@pytest.mark.gpu
def test_speculative_steps_of_a_large_target_release_late(hf_checkpoint, target, monkeypatch):
    """On a target whose matmuls stream long (hidden size at least `kernels.ROWS_LONG_MIN_K`, lowered here to the test
    target's), a speculative step's kernels let the next launch only at their end (`kernels.releasing_late`), and the
    greedy tokens stay the reference's; prefills launch as ever, and so does every step without a head, or on a
    target below the bound."""
    from eyas.serve import kernels

    ps = prompts(3, target.config.vocab_size, seed=4)
    reference = [list(greedy_tokens(target, p, 16)) for p in ps]
    cuda_target = TargetModel.from_pretrained(hf_checkpoint("llama")[0], device="cuda")
    launch_options, releasing = kernels.launch_options, []
    monkeypatch.setattr(kernels, "launch_options", lambda *args: releasing.append(
        kernels._releasing_late) or launch_options(*args))

    def releases(head, min_k):
        monkeypatch.setattr(kernels, "ROWS_LONG_MIN_K", min_k)
        releasing.clear()
        engine = Engine(cuda_target, head, EngineConfig(tree=SHAPES["tree"], block_size=16, num_blocks=64,
                                                        attention="triton"))
        assert [r.output for r in engine.generate(ps, GREEDY, max_new_tokens=16)] == reference
        return set(releasing)

    hidden = target.config.hidden_size
    assert releases(random_head(target).cuda(), hidden) == {False, True}
    assert releases(None, hidden) == {False}
    assert releases(random_head(target).cuda(), hidden + 1) == {False}


# Top-1 sampling is greedy decoding at any temperature; with a greedy row, so the batch mixes both.
TOP_ONE = [SamplingParams(temperature=0.7, top_k=1, seed=3), GREEDY, SamplingParams(temperature=1.3, top_k=1)]


def top_one_sampling(target_model, head, config, ps):
    engine = Engine(target_model, head, config)
    requests = [engine.add_request(p, params, 20) for p, params in zip(ps, TOP_ONE, strict=True)]
    while engine.has_work():
        engine.step()
    return engine, [r.output for r in requests]


@pytest.mark.parametrize("graphs", [False, True])
def test_sampled_verification_of_top_one_is_greedy(target, graphs, monkeypatch):
    """Sampled requests verify in the target pass (its graph on CUDA), padded to the batch bucket with graphs: top-1
    sampling at two temperatures, beside a greedy request, gives the target's greedy tokens."""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", graphs)
    ps = prompts(3, target.config.vocab_size, seed=5)
    config = EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=96)
    engine, outputs = top_one_sampling(target, random_head(target), config, ps)
    assert outputs == [list(greedy_tokens(target, p, 20)) for p in ps]
    assert engine.pool.allocator.num_free == 96


@pytest.mark.gpu
def test_sampled_verification_in_the_cuda_graph(hf_checkpoint, target, trained):
    """On CUDA the sampled verification is captured with the target pass; top-1 sampling stays greedy there, and a
    seeded request samples what it samples on the CPU, drafts accepted (the trained head at a low temperature: a
    random head's drafts were all rejected, and every step emitted its bonus token alone)."""
    head, ps, _ = trained
    cuda_target = TargetModel.from_pretrained(hf_checkpoint("llama")[0], device="cuda")
    cuda_head = copy.deepcopy(head).cuda()  # the module's head stays on the CPU for the tests after this one
    config = EngineConfig(tree=SHAPES["tree"], block_size=16, num_blocks=64, attention="triton")
    engine, outputs = top_one_sampling(cuda_target, cuda_head, config, ps[:3])
    assert outputs == [list(greedy_tokens(target, p, 20)) for p in ps[:3]]
    assert engine.graphs.capture and any("sampled verification" in key[0] for key in engine.graphs.graphs)
    # A seeded request draws there what it draws on the CPU without speculation: its draws belong to positions.
    params = SamplingParams(temperature=0.1, top_p=0.95, seed=5)
    on_gpu = engine.generate(ps[:1], params, max_new_tokens=30)[0]
    plain = Engine(target, None, EngineConfig(speculative=False, block_size=4, num_blocks=64))
    assert sum(on_gpu.accepted) > 0 and on_gpu.output == plain.generate(ps[:1], params, max_new_tokens=30)[0].output
    assert on_gpu.output != list(greedy_tokens(target, ps[0], 30))


def sampled_run(target, ps, params, monkeypatch):
    """Runs `ps` with `params` -> their outputs and what `Engine._sampling` returned at each decode step."""
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=96))
    verified, sampling = [], engine._sampling
    monkeypatch.setattr(engine, "_sampling", lambda *args: verified.append(sampling(*args)) or verified[-1])
    requests = [engine.add_request(p, q, 16) for p, q in zip(ps, params, strict=True)]
    while engine.has_work():
        engine.step()
    return [r.output for r in requests], verified


def test_sampled_decoding_is_the_same_padded_or_not(target, monkeypatch):
    """Seeded sampled requests (temperature 0.8, one with top-p) draw the same tokens whether their batch is padded to
    its bucket (3 -> 4 rows, as CUDA graphs run it) or not: parameters and seeds reach their own rows; and every
    decode step verifies them by sampling."""
    ps = prompts(3, target.config.vocab_size, seed=6)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, top_p=0.9, seed=2),
              SamplingParams(temperature=0.8, seed=3)]
    runs = {}
    for padded in (False, True):
        monkeypatch.setattr(TorchPagedAttention, "graph_safe", padded)
        runs[padded], verified = sampled_run(target, ps, params, monkeypatch)
        assert verified and all(v is not None for v in verified)
    assert runs[True] == runs[False]
    assert runs[True] != [list(greedy_tokens(target, p, 16)) for p in ps]


def chained_steps(engine: Engine, monkeypatch) -> list[int]:
    """Records the batch size of every decode step queued from the one before (`Engine.step`'s overlap), and
    checks that its padding rows stay at an empty prefix (their block tables hold only the scratch block)."""
    chained, decode = [], engine._decode

    def record(requests, after=None):
        step = decode(requests, after)
        if after is not None:
            chained.append(len(requests))
            assert not step.n[len(requests):].any()
        return step

    monkeypatch.setattr(engine, "_decode", record)
    return chained


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("shape", ["tree", "chain", None])
def test_overlapped_steps_change_nothing(target, shape, graphs, sampled, monkeypatch):
    """Decode steps queued before the last one's tokens are read (the default) give every request the tokens,
    acceptance and finish that steps run one at a time give, with requests ending (by stop id and by length) and
    the batch shrinking while a step is in flight; every block comes back. Speculative and plain, padded to batch
    buckets (graphs) and not, greedy and sampled (each request with its own seed: the same draws either way; the
    stop id, from greedy decoding, ends only a greedy request)."""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", graphs)
    ps = prompts(5, target.config.vocab_size, seed=8)
    stop = list(greedy_tokens(target, ps[1], 6))[-1]  # ends request 1 early (when greedy)
    lengths = [7, 30, 18, 25, 12]
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i) if sampled else GREEDY for i in range(5)]
    runs = {}
    for overlap in (False, True):
        config = EngineConfig(speculative=shape is not None, tree=SHAPES[shape or "tree"], block_size=4,
                              num_blocks=160, overlap=overlap)
        engine = Engine(target, random_head(target), config)
        chained = chained_steps(engine, monkeypatch)
        requests = [engine.add_request(p, q, n, {stop}) for p, q, n in zip(ps, params, lengths, strict=True)]
        while engine.has_work():
            engine.step()
        runs[overlap] = [(r.output, r.accepted, r.finish_reason) for r in requests]
        assert engine.pool.allocator.num_free == 160
        assert shape is not None or engine.in_flight is None  # no step queued past the last request's last token
        assert bool(chained) == overlap and (not overlap or {5, 1} <= set(chained))
    assert runs[True] == runs[False]
    if not sampled:
        outputs = [list(greedy_tokens(target, p, n)) for p, n in zip(ps, lengths, strict=True)]
        assert [out for out, *_ in runs[True]] == [o[: o.index(stop) + 1] if stop in o else o for o in outputs]
        assert runs[True][1][2] == "stop"


def test_abort_while_a_step_is_in_flight(target):
    """A request aborted while its decode step is queued gets none of that step's tokens; its blocks, the extra
    ones the chained step took included, come back."""
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=64))
    request = engine.add_request(prompts(1, 257)[0], GREEDY, max_new_tokens=100)
    while engine.in_flight is None or len(request.output) < 4:
        engine.step()  # the prefill, then decode steps, each queued before the last one's tokens are handed out
    emitted = list(request.output)
    engine.abort(request)
    assert not engine.has_work() and engine.pool.allocator.num_free == 64
    engine.step()  # the in-flight step is dropped, not handed out
    assert request.output == emitted and request.finish_reason == "abort" and engine.in_flight is None


def test_a_request_arriving_during_overlapped_steps_is_admitted_at_once(target):
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=128))
    first = engine.add_request(prompts(1, 257)[0], GREEDY, max_new_tokens=60)
    while engine.in_flight is None:
        engine.step()
    second = engine.add_request(prompts(1, 257, seed=1)[0], GREEDY, max_new_tokens=8)
    engine.step()  # hands out the step in flight, then prefills the newcomer instead of chaining the next
    assert second in engine.running and second.output and not first.finished


@pytest.mark.gpu
def test_host_tensors_reach_the_gpu_without_waiting_for_queued_work():
    """The block tables and step inputs a chained step sends (`to_device`) must not wait for the step in flight:
    a copy from pageable memory would, and the overlap would be lost."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued device work
    busy = torch.cuda.Event()
    busy.record()
    copied = to_device(torch.arange(64, dtype=torch.int32), "cuda")
    assert not busy.query()  # the host got here while the device was still sleeping
    torch.cuda.synchronize()
    assert torch.equal(copied.cpu(), torch.arange(64, dtype=torch.int32))


def test_profiling_switched_on_with_a_step_in_flight(target):
    """A benchmark turns profiling on between runs; with a step still in flight the next one runs alone, after it,
    and tokens come out in order."""
    p = prompts(5, target.config.vocab_size, seed=2)[4]  # a prompt whose greedy tokens do not repeat at once
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=64))
    request = engine.add_request(p, GREEDY, max_new_tokens=30)
    while engine.in_flight is None or len(request.output) < 4:
        engine.step()
    engine.profile = True
    while engine.has_work():
        engine.step()
    assert request.output == list(greedy_tokens(target, p, 30))


def test_no_overlap_near_the_end_of_the_pool(target):
    """Where the blocks for a chained step run short, steps run one at a time (preempting as they must) and the
    output stays the target's."""
    ps = prompts(4, target.config.vocab_size, seed=9)
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["wide"], block_size=4, num_blocks=44))
    requests = engine.generate(ps, GREEDY, max_new_tokens=24)
    assert [r.output for r in requests] == [list(greedy_tokens(target, p, 24)) for p in ps]
    assert engine.pool.allocator.num_free == 44


def test_speculation_off_is_plain_decoding(target):
    ps = prompts(3, target.config.vocab_size, seed=1)
    engine = Engine(target, random_head(target), EngineConfig(speculative=False, block_size=4, num_blocks=64))
    assert engine.drafter is None and engine.trees == []  # the head is neither run nor given a KV pool
    requests = engine.generate(ps, GREEDY, max_new_tokens=16)
    assert [r.output for r in requests] == [list(greedy_tokens(target, p, 16)) for p in ps]
    assert all(r.accepted == [] for r in requests)


@pytest.mark.parametrize("graphs", [False, True])
def test_stop_ids_and_chunked_prefill(target, graphs, monkeypatch):
    """With graphs (on CPU, their shapes uncaptured) each 16-token chunk runs padded to its length bucket."""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", graphs)
    p = prompts(1, target.config.vocab_size, seed=2)[0] * 3  # long enough for several chunks
    free = list(greedy_tokens(target, p, 30))
    stop = free[7]
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=128,
                                                              max_prefill_tokens=16))
    (request,) = engine.generate([p], GREEDY, max_new_tokens=30, stop_ids={stop})
    assert request.output == free[: free.index(stop) + 1] and request.finish_reason == "stop"


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("chunk", [16, 2048])
def test_prompts_prefill_together(target, chunk, graphs, monkeypatch):
    """Waiting prompts of different lengths are prefilled in one pass (padded to the longest chunk, and with graphs
    to the batch and length buckets) as far as `max_prefill_tokens` allows, chunked where it does not; outputs are
    the target's own."""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", graphs)
    ps = prompts(5, target.config.vocab_size, seed=6)
    reference = [list(greedy_tokens(target, p, 12)) for p in ps]
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=256,
                                                              max_prefill_tokens=chunk))
    passes = []
    prefill = engine._prefill
    monkeypatch.setattr(engine, "_prefill", lambda requests: (passes.append(len(requests)), prefill(requests)))
    assert [r.output for r in engine.generate(ps, GREEDY, max_new_tokens=12)] == reference
    if chunk == 2048:
        assert passes == [5]
    else:  # 16-token chunks: longer prompts take several passes, short ones share them
        assert len(passes) >= max(-(-len(p) // chunk) for p in ps) and max(passes) <= chunk


@pytest.mark.parametrize("graphs", [False, True])
def test_preemption_when_blocks_run_out(target, graphs, monkeypatch):
    """A pool too small for all requests at once: they are preempted and recomputed (with graphs, the recomputing
    prefill padded to its buckets), outputs unchanged."""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", graphs)
    ps = prompts(6, target.config.vocab_size, seed=3)
    reference = [list(greedy_tokens(target, p, 40)) for p in ps]
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["chain"], block_size=4, num_blocks=40))
    requests = engine.generate(ps, GREEDY, max_new_tokens=40)
    assert [r.output for r in requests] == reference
    assert engine.pool.allocator.num_free == 40


def test_preemptions_count_the_positions_prefilled_again(target, monkeypatch):
    """`Engine.preemptions` and `recomputed` (serve-eagle's /metrics): every position prefilled past the prompts is
    one a preemption freed (plain decoding, which recomputes nothing else)."""
    ps = prompts(6, target.config.vocab_size, seed=3)
    engine = Engine(target, None, EngineConfig(speculative=False, block_size=4, num_blocks=24))
    prefilled = []
    prefill = engine._prefill
    monkeypatch.setattr(engine, "_prefill", lambda rs: (prefilled.extend(map(engine._chunk_length, rs)), prefill(rs)))
    engine.generate(ps, GREEDY, max_new_tokens=40)
    assert engine.preemptions >= 2 and sum(prefilled) == sum(map(len, ps)) + engine.recomputed


def test_admission_leaves_a_block_to_each_running_request(target):
    """A waiting request is admitted only where a block stays free for each running one besides (their growth would
    soon preempt it otherwise): a prompt needing every free block waits while another request runs, one needing a
    block less is admitted."""
    engine = Engine(target, None, EngineConfig(speculative=False, block_size=4, num_blocks=24))
    vocab = target.config.vocab_size
    engine.add_request(prompts(1, vocab, seed=1)[0][:10], GREEDY, max_new_tokens=30)
    engine.step()  # admitted and prefilled
    free = engine.pool.allocator.num_free
    assert len(engine.running) == 1 and free > 2
    # A prompt of 4·b - reserve tokens needs b blocks of 4 (with the step's reserve).
    waiting = engine.add_request(list(range(4 * free - engine.reserve)), GREEDY, max_new_tokens=1)
    assert engine._admissible() == 0
    engine.waiting.remove(waiting)
    engine.add_request(list(range(4 * (free - 1) - engine.reserve)), GREEDY, max_new_tokens=1)
    assert engine._admissible() == free - 1


def test_abort_frees_blocks(target):
    engine = Engine(target, random_head(target), EngineConfig(block_size=4, num_blocks=64))
    request = engine.add_request(prompts(1, 257)[0], GREEDY, max_new_tokens=100)
    for _ in range(3):
        engine.step()
    assert request.output and engine.pool.allocator.num_free < 64
    engine.abort(request)
    assert request.finish_reason == "abort" and engine.pool.allocator.num_free == 64 and not engine.has_work()


def test_warm_up_runs_every_batch_size_and_leaves_the_engine_as_it_was(target, monkeypatch, capsys):
    config = EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=128, max_batch_size=3)
    engine = Engine(target, random_head(target), config)
    batches = []
    generate = engine.generate

    def recording(*args):  # each run's requests' settings, as the engine took them
        requests = generate(*args)
        batches.append([(r.params.temperature, r.params.top_p) for r in requests])
        return requests

    monkeypatch.setattr(engine, "generate", recording)
    engine.warm_up(new_tokens=4, progress=True)
    # Each batch size greedy, sampled and with top-p, the sampled ones past one request beside a greedy one too; then
    # prompts of each other length bucket that fits the context (128 blocks of 4: 512 positions, less the room a
    # step needs) the same ways, at each batch size whose blocks (and one to spare each) the pool has: 7 + 1 blocks
    # each at 16 tokens, 19 + 1 at 64, 35 + 1 at 128, 67 + 1 at 256 (a tree's step reserves 9 positions).
    greedy, each = (0, 1), [(1, 1), (1, 0.95)]

    def each_way(b):
        return [[greedy] * b] + [r for q in each for r in ([q] * b, [greedy] + [q] * (b - 1))[: 1 + (b > 1)]]

    assert engine.context_limit == 512 and engine.reserve == 9
    assert batches == [run for sizes in ([1, 2, 3],) * 4 + ([1],) for b in sizes for run in each_way(b)]
    err = capsys.readouterr().err  # the bar, one step per batch size and one per prompt length
    assert "warming up: 100%" in err and "7/7" in err
    assert not engine.has_work() and engine.pool.allocator.num_free == 128
    ps = prompts(3, target.config.vocab_size)
    fresh = Engine(target, random_head(target), config).generate(ps, GREEDY, max_new_tokens=12)
    assert [r.output for r in generate(ps, GREEDY, max_new_tokens=12)] == [r.output for r in fresh]


def test_warm_up_runs_each_bucket_with_every_setting_its_batches_draft(target):
    """An autotuned table whose setting changes inside a batch bucket ({1: tree, 3: chain, 8: off}: 3 requests pad
    to 4 and draft a chain, 4 draft none) is warmed up at 3 as well as 4; without a table, at the buckets up to
    max_batch_size."""
    table = ((1, SHAPES["tree"]), (3, SHAPES["chain"]), (8, None))
    config = EngineConfig(block_size=4, num_blocks=128, max_batch_size=8, tree_by_batch=table)
    assert Engine(target, random_head(target), config)._warm_batch_sizes() == [1, 2, 3, 4, 8]
    plain = dataclasses.replace(config, max_batch_size=10, tree_by_batch=())
    assert Engine(target, random_head(target), plain)._warm_batch_sizes() == [1, 2, 4, 8, 10]
    assert Engine(target, None, plain)._warm_batch_sizes() == [1, 2, 4, 8, 10]


def test_after_warm_up_mixed_batches_and_sampled_long_prompts_run_in_graphs_captured(target, monkeypatch):
    """A decode step of a greedy request beside sampled ones (with top-p or not) verifies in a graph of its own
    (`_verification`), and a sampled prompt's prefill samples its first token in the prefill's graph: warm_up
    captures both, long prompts' prefills too (at each batch bucket, greedy, sampled and mixed), so none is captured
    while serving."""
    monkeypatch.setattr(TorchPagedAttention, "graph_safe", True)  # the fixed shapes of graphs
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=128,
                                                               max_batch_size=3))
    keys, call = [], GraphCache.__call__

    def recording(self, name, fn, *inputs):  # the key a GPU's cache captures under
        if name.startswith(("target, ", "prefill, ")):
            keys.append((name, *((x.shape, x.dtype) for x in inputs)))  # a decode step's, a prefill's
        return call(self, name, fn, *inputs)

    monkeypatch.setattr(GraphCache, "__call__", recording)
    engine.warm_up(new_tokens=2)
    warmed = set(keys)
    ps = prompts(3, target.config.vocab_size, seed=3)
    for mix in ([GREEDY, SamplingParams(seed=1), SamplingParams(seed=2)], [SamplingParams(top_p=0.9, seed=1), GREEDY]):
        engine.generate(ps[:len(mix)], mix, 6)
    engine.generate([list(range(100))], SamplingParams(temperature=0.7, top_p=0.9, seed=4), 3)  # a 128-token bucket
    long = [list(range(i, 60 + i)) for i in range(3)]  # three 64-token prompts: one prefill of 4 rows
    engine.generate(long, [GREEDY, SamplingParams(top_p=0.9, seed=5), SamplingParams(seed=6)], 3)
    assert any("greedy rows (False, False, True)" in key[0] for key in keys)
    assert any(key[0].startswith("prefill, sampled") and key[1][0][1] == 128 for key in keys)
    assert any(key[0].startswith("prefill, sampled") and key[1][0] == (4, 64) for key in keys)
    assert set(keys) <= warmed


def test_warm_up_takes_a_runs_own_sampling(target, monkeypatch):
    """A run's own sampled setting (eval-eagle's, here with top-k, whose graphs and kernels the defaults do not
    build) is warmed up too, at each batch size and then at each other length bucket (four here) at each batch size
    the pool holds (two requests of 256 tokens it does not)."""
    engine = Engine(target, random_head(target), EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=128,
                                                               max_batch_size=2))
    warmed, generate = [], engine.generate
    monkeypatch.setattr(engine, "generate", lambda ps, params, *args: warmed.append((len(ps), params)) or
                        generate(ps, params, *args))
    own = SamplingParams(temperature=0.7, top_k=5)
    engine.warm_up(new_tokens=2, params=own)
    assert [b for b, params in warmed if params == own] == [1, 2, 1, 2, 1, 2, 1, 2, 1]


@pytest.mark.parametrize("speculative", [False, True])
def test_room_is_what_a_prompt_gets(target, speculative):
    """A prompt gets `room` new tokens when nothing else stops it (speculation: at least as many); the longest
    prompt that runs gets one."""
    engine = Engine(target, random_head(target), EngineConfig(speculative=speculative, block_size=4, num_blocks=16))
    longest = engine.context_limit - engine.reserve
    for length in (longest, longest - 3):
        (request,) = engine.generate([[5] * length], GREEDY, max_new_tokens=1000)
        got = len(request.output)
        assert request.finish_reason == "length" and (got >= engine.room(length) if speculative else
                                                      got == engine.room(length))
    assert engine.room(longest) == 1 and engine.room(longest - 3) == 4
    with pytest.raises(ValueError, match="context holds"):
        engine.add_request([5] * (longest + 1), GREEDY, max_new_tokens=4)


def test_prompt_longer_than_context_is_refused(target):
    engine = Engine(target, random_head(target), EngineConfig(block_size=4, num_blocks=64))
    with pytest.raises(ValueError, match="context holds"):
        engine.add_request(list(range(300)), GREEDY, max_new_tokens=4)


def test_a_prompt_token_the_target_cannot_embed_is_refused_alone(target):
    """A token id past the target's vocabulary (a tokenizer with tokens the checkpoint lacks) is refused when queued:
    in a step its embedding lookup failed, and with it every request of the batch."""
    engine = Engine(target, random_head(target), EngineConfig(block_size=4, num_blocks=64))
    vocab = target.config.vocab_size
    running = engine.add_request([1, 2, 3], GREEDY, max_new_tokens=4)
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=re.escape(f"token id {bad} of the prompt is not in the target's "
                                                       f"vocabulary [0, {vocab})")):
            engine.add_request([1, bad, 2], GREEDY, max_new_tokens=4)
    while engine.has_work():
        engine.step()
    assert len(running.output) == 4 and engine.pool.allocator.num_free == 64


@pytest.mark.parametrize("config, words", [
    (EngineConfig(tree_by_batch=((1, TreeShape(2, 40, 8)),), block_size=4, num_blocks=64),
     "tree 2,40,8: topk 40 is more than the head's draft vocabulary of 32 tokens"),
    (EngineConfig(tree=TreeShape(3, 20, 600), block_size=4, num_blocks=64),
     "trees ['3,20,600'] need 601 positions a step beyond the prompt; the context holds 256"),
])
def test_a_tree_the_head_or_context_cannot_hold_is_refused_at_start(target, config, words):
    """Where the engine used to start, then fail each request's first step (a torch error) or refuse every prompt."""
    with pytest.raises(ConfigError, match=re.escape(words)):
        Engine(target, random_head(target, draft_vocab=32), config)


@pytest.fixture(scope="module")
def trained(target):
    """A head trained a little (`fitted_head`) on the target's own greedy continuations of 32 prompts. Returns (head,
    prompts, the TTT-implied acceptance length on their continuations)."""
    ps = [p[:8] for p in prompts(64, target.config.vocab_size, seed=5) if len(p) >= 8][:32]
    plain = Engine(target, config=EngineConfig(block_size=4, num_blocks=1024))
    seqs = [p + r.output for p, r in zip(ps, plain.generate(ps, GREEDY, 40), strict=True)]
    head, tau = fitted_head(target, seqs, [len(p) for p in ps], draft_vocab=target.config.vocab_size)
    return head, ps, tau


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_trained_head_accepts_and_stays_exact(target, trained, shape):
    head, ps, tau = trained
    ps = [p[: 3 + i] for i, p in enumerate(ps[:8])]  # batch 8, mixed prompt lengths
    reference = [list(greedy_tokens(target, p, 32)) for p in ps]
    engine = Engine(target, head, EngineConfig(tree=SHAPES[shape], block_size=4, num_blocks=512))
    requests = engine.generate(ps, GREEDY, max_new_tokens=32)
    assert [r.output for r in requests] == reference
    accepted = [a for r in requests for a in r.accepted]
    assert sum(accepted) / len(accepted) > 0.3, "the trained head should get drafts accepted"


def test_served_acceptance_matches_training(target, trained):
    """The acceptance length TTT predicts is what a chain of the same depth achieves when served."""
    head, ps, tau = trained
    engine = Engine(target, head, EngineConfig(tree=TreeShape(4, 1, 5), block_size=4, num_blocks=1024))
    requests = engine.generate(ps, GREEDY, max_new_tokens=40)
    accepted = [a for r in requests for a in r.accepted]
    served_tau = 1 + sum(accepted) / len(accepted)
    assert tau > 1.3 and abs(served_tau - tau) < 0.25, (served_tau, tau)


def check_draft_fp8(target, trained, shape: TreeShape, batch: int):
    """With the head's weights rounded to float8 (`draft_fp8`) the output is still the target's; the head is rounded
    (its weights are their own float8 rounding), and the trained head's acceptance moves little."""
    head, ps, _ = trained
    device = target.embed_tokens.weight.device
    ps = ps[:8]
    reference = [list(greedy_tokens(target, p, 32)) for p in ps]
    taus = []
    for fp8 in (False, True):
        config = EngineConfig(tree=shape, block_size=4, num_blocks=512, max_batch_size=batch, draft_fp8=fp8)
        engine = Engine(target, copy.deepcopy(head).to(device), config)
        outputs, accepted = [], []
        for i in range(0, len(ps), batch):
            requests = engine.generate(ps[i : i + batch], GREEDY, max_new_tokens=32)
            outputs += [r.output for r in requests]
            accepted += [a for r in requests for a in r.accepted]
        assert outputs == reference
        taus.append(1 + sum(accepted) / len(accepted))
        weight = engine.drafter.head.midlayer.mlp.gate_up_proj.weight
        assert torch.equal(dequantize(quantize(weight), weight.dtype), weight) == fp8
    assert abs(taus[1] - taus[0]) < 0.1 * taus[0], taus


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_draft_fp8_stays_exact_and_keeps_acceptance(target, trained, shape):
    check_draft_fp8(target, trained, SHAPES[shape], 8)


@pytest.mark.gpu
def test_draft_fp8_stays_exact_and_keeps_acceptance_cuda(hf_checkpoint, trained):
    """On CUDA (fp32: float8 kernels at one row, so a chain at batch 1) with CUDA graphs."""
    cuda_target = TargetModel.from_pretrained(hf_checkpoint("llama")[0], device="cuda")
    check_draft_fp8(cuda_target, trained, SHAPES["chain"], 1)


def test_eagle3_head_restricted_by_a_token_map_keeps_the_target_s_output(target, trained):
    """FR-Spec on an EAGLE-3 head (`Eagle3Head.keep_draft_tokens`). Kept to the tokens the target says, most frequent
    first, the head accepts about as much as whole; kept to tokens the target never says, it drafts only those, and
    nothing is accepted. The output is the target's either way."""
    head, ps, _ = trained
    ps, vocab = ps[:8], target.config.vocab_size
    reference = [list(greedy_tokens(target, p, 32)) for p in ps]
    # Past the 32 tokens too: a last step may accept drafts beyond the requests' ends.
    said = torch.bincount(torch.tensor([t for p in ps for t in greedy_tokens(target, p, 48)]), minlength=vocab)
    maps = {"whole": None, "said": HotVocab.from_counts(said, int((said > 0).sum()), order="by_frequency"),
            "never said": HotVocab((said == 0).nonzero().flatten(), vocab)}
    taus = {}
    for name, allowed in maps.items():
        restricted = copy.deepcopy(head)
        if allowed is not None:
            restricted.keep_draft_tokens(allowed)
            assert restricted.lm_head.weight.shape[0] == restricted.config.draft_vocab_size < vocab
        engine = Engine(target, restricted, EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=512))
        requests = engine.generate(ps, GREEDY, max_new_tokens=32)
        assert [r.output for r in requests] == reference, name
        accepted = [a for r in requests for a in r.accepted]
        taus[name] = 1 + sum(accepted) / len(accepted)
    assert taus["said"] > 0.9 * taus["whole"] and taus["whole"] > 1.5 and taus["never said"] == 1, taus


def test_eagle1_head_with_token_map_equals_target_greedy(target, tmp_path):
    """An EAGLE-1/2 head (the target's lm_head restricted by an FR-Spec map) through the same engine."""
    from eyas.common.eagle import EagleConfig, EagleHead

    cfg = target.config
    torch.manual_seed(3)
    head = EagleHead(EagleConfig(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                 cfg.intermediate_size, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.vocab_size),
                     HotVocab(torch.randperm(cfg.vocab_size)[:100], cfg.vocab_size)).eval()
    head.attach_lm_head(target.lm_head_weight)
    ps = prompts(4, cfg.vocab_size, seed=4)
    engine = Engine(target, head, EngineConfig(tree=SHAPES["tree"], block_size=4, num_blocks=256))
    requests = engine.generate(ps, GREEDY, max_new_tokens=16)
    assert [r.output for r in requests] == [list(greedy_tokens(target, p, 16)) for p in ps]
    assert all(len(r.accepted) > 0 for r in requests)
    with pytest.raises(ConfigError, match="topk 101 is more than the head's draft vocabulary of 100 tokens"):
        Engine(target, head, EngineConfig(tree=TreeShape(2, 101, 8), block_size=4, num_blocks=256))


def test_a_head_narrower_than_the_target_is_refused(target):
    """A head of hidden size H != the target's embeds its tokens with its own table, which the engine does not serve:
    refused when the engine is built, not with a shape error at the first draft."""
    cfg = Eagle3Config.for_target(target.config, 64)
    head = Eagle3Head(dataclasses.replace(cfg, hidden_size=cfg.hidden_size // 2, intermediate_size=16,
                                          num_attention_heads=2, num_key_value_heads=1)).eval()
    head.set_hot_vocab(HotVocab.from_counts(torch.rand(target.config.vocab_size), 64))
    with pytest.raises(ConfigError, match=f"the head's hidden size {cfg.hidden_size // 2} is not the target's "):
        Engine(target, head, EngineConfig(tree=TreeShape(2, 1, 3), block_size=4, num_blocks=64))
