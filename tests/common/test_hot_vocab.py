"""The hot vocabulary: d2t / t2d / token-map round trips are exact, top-k selection is deterministic,
mapping and restriction are consistent, and malformed inputs fail with errors that name the problem."""

import numpy as np
import pytest
import torch

from eyas.common.hot_vocab import HotVocab, HotVocabError

V = 50


@pytest.fixture
def freq_order():
    """A draft vocab of 12 out of 50 target ids, in an arbitrary (frequency-like) order."""
    torch.manual_seed(0)
    return HotVocab(torch.randperm(V)[:12], V)


def test_worked_example():
    hv = HotVocab(torch.tensor([1, 2, 5]), 8)
    assert hv.d2t.tolist() == [1, 1, 3] and hv.d2t.dtype == torch.int64
    assert hv.t2d.tolist() == [False, True, True, False, False, True, False, False]
    assert hv.draft_vocab_size == 3 and hv.vocab_size == 8


def test_round_trips_are_exact(freq_order, tmp_path):
    hv = freq_order
    assert torch.equal(HotVocab.from_d2t(hv.d2t, V).hot_ids, hv.hot_ids)

    path = tmp_path / "freq_12.pt"
    hv.save_token_map(path)
    raw = torch.load(path, weights_only=True)
    assert isinstance(raw, list) and raw == hv.hot_ids.tolist()  # FR-Spec's format: a plain list
    assert torch.equal(HotVocab.load_token_map(path, V).hot_ids, hv.hot_ids)
    # SGLang's loader reads the same file as `torch.tensor(torch.load(...))`.
    assert torch.equal(torch.tensor(raw, dtype=torch.int64), hv.hot_ids)

    # t2d keeps the set, not the order.
    by_id = HotVocab(hv.hot_ids.sort().values, V)
    assert torch.equal(by_id.t2d, hv.t2d)
    assert int(hv.t2d.sum()) == hv.draft_vocab_size


def test_token_map_file_may_hold_a_tensor(freq_order, tmp_path):
    path = tmp_path / "freq_12.pt"
    torch.save(freq_order.hot_ids.to(torch.int32), path)
    loaded = HotVocab.load_token_map(path, V)
    assert loaded.hot_ids.dtype == torch.int64 and torch.equal(loaded.hot_ids, freq_order.hot_ids)


def test_from_counts_hand_example():
    counts = torch.tensor([5, 0, 9, 5, 1])
    # 9 (id 2) first; ids 0 and 3 tie at 5 and both fit; id 4 (1) is left out.
    assert HotVocab.from_counts(counts, 3).hot_ids.tolist() == [0, 2, 3]  # default: EAGLE-3 order
    assert HotVocab.from_counts(counts, 3, order="by_frequency").hot_ids.tolist() == [2, 0, 3]
    # A tie at the cut goes to the lower id: ids 0 and 3 tie for the second place.
    assert HotVocab.from_counts(counts, 2, order="by_frequency").hot_ids.tolist() == [2, 0]
    # Fewer seen ids than `size`: zero-count ids fill up from the lowest id.
    assert HotVocab.from_counts(torch.tensor([0, 0, 3, 0]), 3).hot_ids.tolist() == [0, 1, 2]


def test_from_counts_orders():
    torch.manual_seed(1)
    counts = torch.randint(0, 4, (V,))  # many ties
    by_id = HotVocab.from_counts(counts, 20)
    by_freq = HotVocab.from_counts(counts, 20, order="by_frequency")
    assert torch.equal(by_id.t2d, by_freq.t2d)  # same set
    assert (by_id.d2t.diff() >= 0).all()  # EAGLE-3: d2t non-decreasing
    assert (counts[by_freq.hot_ids].diff() <= 0).all()  # FR-Spec: most frequent first
    # Every chosen id is at least as frequent as every id left out.
    assert counts[by_id.hot_ids].min() >= counts[~by_id.t2d].max()
    # FR-Spec maps nest: the top 8 is a prefix of the top 20.
    assert torch.equal(HotVocab.from_counts(counts, 8, order="by_frequency").hot_ids, by_freq.hot_ids[:8])


def test_ties_go_to_the_lower_id_in_a_large_vocabulary():
    """Counts of a 50,000-token vocabulary with few distinct values (an unstable sort orders ties arbitrarily at this
    size): most frequent first, equal counts in ascending id order, and at the cut the lowest ids of the tied count."""
    counts = torch.randint(0, 5, (50_000,), generator=torch.Generator().manual_seed(0))
    hot = HotVocab.from_counts(counts, 30_000, order="by_frequency").hot_ids
    expected = sorted(range(50_000), key=lambda i: (-int(counts[i]), i))[:30_000]
    assert hot.tolist() == expected


def test_to_target(freq_order):
    hv = freq_order
    assert torch.equal(hv.to_target(torch.arange(hv.draft_vocab_size)), hv.hot_ids)
    grid = torch.randint(0, hv.draft_vocab_size, (3, 4))  # any shape
    assert torch.equal(hv.to_target(grid), hv.hot_ids[grid.flatten()].view(3, 4)) and hv.t2d[hv.to_target(grid)].all()


def test_restrict_logits_is_a_gather(freq_order):
    hv = freq_order
    logits = torch.randn(2, 3, V)
    manual = torch.stack([logits[..., t] for t in hv.hot_ids.tolist()], dim=-1)
    assert torch.equal(hv.restrict_logits(logits), manual)
    # In the EAGLE-3 order it equals SpecForge's boolean-mask restriction `logits[..., t2d]`.
    by_id = HotVocab(hv.hot_ids.sort().values, V)
    assert torch.equal(by_id.restrict_logits(logits), logits[..., by_id.t2d])
    with pytest.raises(HotVocabError, match=r"last dim is 49, expected the target vocab 50"):
        hv.restrict_logits(logits[..., :-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_to_device(freq_order, device):
    moved = freq_order.to(device)
    assert moved is not freq_order and torch.equal(moved.hot_ids.cpu(), freq_order.hot_ids)
    assert moved.vocab_size == V and moved.hot_ids.device.type == moved.t2d.device.type == device


ERRORS = {
    "out of range": (
        lambda: HotVocab(torch.tensor([3, 50, 7]), V),
        r"hot_ids: 1 id\(s\) outside the target vocab \[0, 50\), first at draft index 1: target id 50",
    ),
    "negative": (lambda: HotVocab(torch.tensor([3, -2]), V), r"outside the target vocab .* target id -2"),
    "duplicate": (
        lambda: HotVocab(torch.tensor([3, 9, 4, 9]), V),
        r"duplicated target id\(s\), e\.g\. \[9\]; target id 9 is at draft indices \[1, 3\]",
    ),
    "float ids": (
        lambda: HotVocab(torch.tensor([1.0, 2.0]), V),
        r"hot_ids: token ids must be an integer tensor, got dtype torch\.float32",
    ),
    "bool ids": (lambda: HotVocab(torch.tensor([True, False]), V), r"integer tensor, got dtype torch\.bool"),
    "2-D ids": (lambda: HotVocab(torch.tensor([[1, 2]]), V), r"non-empty 1-D tensor .* shape \(1, 2\)"),
    "empty": (lambda: HotVocab(torch.zeros(0, dtype=torch.int64), V), r"non-empty 1-D tensor .* shape \(0,\)"),
    "vocab size": (lambda: HotVocab(torch.tensor([1]), 0), r"vocab_size must be a positive int, got 0"),
    "d2t out of range": (
        lambda: HotVocab.from_d2t(torch.tensor([0, 0, 48]), V),
        r"d2t: 1 id\(s\) outside the target vocab \[0, 50\), first at draft index 2: target id 50",
    ),
    "d2t duplicate": (
        lambda: HotVocab.from_d2t(torch.tensor([0, -1]), V),
        r"d2t: 1 duplicated target id\(s\), e\.g\. \[0\]",
    ),
    "d2t cast with the weights": (
        lambda: HotVocab.from_d2t(torch.tensor([1, 2], dtype=torch.bfloat16), V),
        r"d2t: token ids must be an integer tensor, got dtype torch\.bfloat16",
    ),
    "token map floats": (
        lambda: HotVocab.from_token_map([4, 2.5], V),
        r"token map: token ids must be an integer tensor",
    ),
    "token map ragged": (
        lambda: HotVocab.from_token_map([[1, 2], [3]], V),
        r"token map: not a flat list of token ids",
    ),
    "counts size": (
        lambda: HotVocab.from_counts(torch.ones(5), 6),
        r"counts: size must be an int in \[1, 5\], got 6",
    ),
    "counts order": (
        lambda: HotVocab.from_counts(torch.ones(5), 2, order="by_count"),
        r"order must be 'by_id' or 'by_frequency', got 'by_count'",
    ),
    "counts 2-D": (lambda: HotVocab.from_counts(torch.ones(2, 5), 2), r"counts: expected a 1-D real tensor"),
}


@pytest.mark.parametrize("make, message", ERRORS.values(), ids=ERRORS.keys())
def test_validation_errors(make, message):
    with pytest.raises(HotVocabError, match=message):
        make()


@pytest.mark.parametrize(
    "content, message",
    [
        ([1, 2, 2], r"duplicated target id\(s\), e\.g\. \[2\]"),
        ([1, 60], r"outside the target vocab \[0, 50\)"),
        ([1.0, 2.0], r"integer tensor, got dtype torch\.float32"),
        (torch.tensor([1.0, 2.0]), r"integer tensor, got dtype torch\.float32"),
        ({"d2t": torch.tensor([0])}, r"expected a list or 1-D tensor of token ids, got dict"),
    ],
)
def test_token_map_file_errors_name_the_file(tmp_path, content, message):
    path = tmp_path / "freq_3.pt"
    torch.save(content, path)
    with pytest.raises(HotVocabError, match=message) as err:
        HotVocab.load_token_map(path, V)
    assert str(err.value).startswith(f"token map {path}: ")


@pytest.mark.parametrize("write", [
    lambda path: path.write_text("[1, 2, 3]"),  # JSON
    lambda path: torch.save(np.arange(3), path),  # a numpy array: unpickling it is refused
    lambda path: path.write_bytes(b""),  # empty
], ids=["json", "numpy", "empty"])
def test_a_token_map_in_another_format_is_named(tmp_path, write):
    path = tmp_path / "freq_3.pt"
    write(path)
    with pytest.raises(HotVocabError, match=r"not a torch\.save'd list of token ids") as err:
        HotVocab.load_token_map(path, V)
    assert str(err.value).startswith(f"token map {path}: ") and "weights_only" not in str(err.value)
