"""Real data through the trainer: SmolLM2's tokenizer and chat template, a 20-conversation JSONL, a tiny random
target with SmolLM2's vocabulary. The split is disjoint and seeded, batches group similar lengths, the draft
vocabulary comes from the training rows' assistant tokens, and the held-out evaluation is logged and exported."""

import itertools
import json
import random

import pytest

from eyas.common.assets import resolve_target
from eyas.common.head_checkpoint import load_draft_head
from eyas.data.tokenizer import load_tokenizer
from eyas.train.batches import micro_batches
from eyas.train.config import recipe_from_dict
from eyas.train.data import length_groups, load_data
from eyas.train.trainer import build_random_target, train

TOKENIZER = "smollm2-135m-instruct"
WORDS = "the draft head predicts tokens of the target model while it verifies many at once".split()


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    rows = []
    for i in range(20):
        question = f"Question {i}: what does word {WORDS[i % len(WORDS)]} mean?"
        answer = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(4 + 3 * (i % 5)))
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def recipe_values(conversations, tmp_path) -> dict:
    return {
        "model": {"random_target": {"vocab_size": 49152, "hidden_size": 32, "intermediate_size": 64,
                                    "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1},
                  "draft_vocab_size": 64},
        "data": {"path": str(conversations), "tokenizer": TOKENIZER, "max_length": 64, "eval_fraction": 0.2,
                 "batch_size": 2, "bucket": 2, "cache_dir": str(tmp_path / "datasets")},
        "optim": {"lr": 3e-3, "total_steps": 4},
        "ttt": {"steps": 2},
        "logging": {"progress": False, "eval_every": 2},
    }


def test_split_batches_and_draft_vocab(conversations, tmp_path):
    recipe = recipe_from_dict(recipe_values(conversations, tmp_path))
    data = load_data(recipe.data, load_tokenizer(resolve_target(TOKENIZER)), 49152, 64, seed=0)
    train_rows, eval_rows = data.train.rows, data.eval.rows
    assert (len(train_rows), len(eval_rows)) == (16, 4)
    assert not set(map(tuple, train_rows["input_ids"])) & set(map(tuple, eval_rows["input_ids"]))
    assert sorted(i for g in data.train.groups for i in g) == list(range(16))
    batch = data.train[0]
    assert batch["input_ids"].shape[0] == 2 and batch["attention_mask"][:, -1].any()
    # Draft ids are assistant tokens of the training rows (only 20 short answers: fewer than 64 distinct).
    rows = zip(train_rows["input_ids"], train_rows["loss_mask"], strict=True)
    seen = {t for ids, mask in rows for t, k in zip(ids, mask, strict=True) if k}
    assert seen <= set(data.hot.hot_ids.tolist())
    again = load_data(recipe.data, load_tokenizer(resolve_target(TOKENIZER)), 49152, 64, seed=0)
    assert again.train.groups == data.train.groups and again.eval.groups == data.eval.groups


def test_length_groups_sort_within_windows():
    lengths = [5, 1, 9, 3, 7, 2, 8, 4]
    groups = length_groups(lengths, batch_size=2, bucket=4, rng=random.Random(0))
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert all(lengths[a] <= lengths[b] for a, b in groups)


def test_micro_batches_resume_in_place():
    batches = list(range(5))  # stands for batches: positions map to them directly
    first = itertools.islice(micro_batches(batches, 0, rank=1, world_size=2), 7)
    assert list(first) == list(enumerate([1, 3, 1, 3, 1, 3, 1]))
    assert next(micro_batches(batches, 5, rank=1, world_size=2)) == (5, 3)


def test_trainer_on_real_data(conversations, tmp_path):
    # A random target's argmax is rarely among a few frequent tokens: draft over the whole vocab to count some.
    values = recipe_values(conversations, tmp_path)
    values["model"]["draft_vocab_size"] = 49152
    recipe = recipe_from_dict(values)
    final = train(recipe, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(r["tokens"] > 0 and len(r["acc"]) == 2 and 1 <= r["tau"] <= 3 for r in evals)
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    assert json.loads((final / "eval.json").read_text()) == evals[-1]
    head = load_draft_head(final, build_random_target(recipe.model.random_target))
    assert head.config.vocab_size == head.config.draft_vocab_size == 49152
