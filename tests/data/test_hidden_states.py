"""Offline hidden states: dump -> read back gives the trainer's online batch and the same TTT loss; resume; refusal."""

import json

import pytest
import torch

from eyas.common.config import ConfigError
from eyas.common.eagle3 import Eagle3Config, Eagle3Head
from eyas.common.hot_vocab import HotVocab
from eyas.common.target import TargetModel
from eyas.data.dataset import collate
from eyas.data.hidden_states import HiddenStateDataset, collate_hidden_states, dump_hidden_states
from eyas.train.target import target_forward
from eyas.train.ttt import ttt_loss

SHARD_MB = 0.05  # ~2-3 of these conversations per shard (a token is (3+1)·64·4 B of fp32 states)


@pytest.fixture(scope="module")
def target(hf_checkpoint):
    return TargetModel.from_pretrained(hf_checkpoint("llama")[0])


@pytest.fixture(scope="module")
def rows(target):
    g = torch.Generator().manual_seed(0)
    out = []
    for n in torch.randint(5, 40, (10,), generator=g).tolist():
        loss_mask = (torch.rand(n, generator=g) < 0.7).long()
        loss_mask[-1] = 1
        out.append({"input_ids": torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist(),
                    "loss_mask": loss_mask.tolist()})
    return out


def random_head(target: TargetModel, counts: torch.Tensor, draft_vocab: int = 8) -> Eagle3Head:
    """A random head whose draft vocab is the target's most frequent argmaxes (`counts` [V]): many counted
    positions, and accuracies near 1/draft_vocab rather than 0, so comparing them means something."""
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab)).eval()
    head.set_hot_vocab(HotVocab.from_counts(counts + torch.rand(counts.shape) / 2, draft_vocab))
    return head


def test_collate_pads_every_tensor_to_the_multiple():
    """Rows of 3 and 5 tokens, multiple 4: ids, masks and states all padded to T = 8, zeros past each row's end;
    with multiple 5 the longest row is already a multiple: T = 5."""
    rows = [{"input_ids": torch.arange(1, n + 1), "loss_mask": torch.ones(n, dtype=torch.long),
             "aux": torch.rand(n, 6)} for n in (3, 5)]
    batch = collate_hidden_states(rows, multiple=4)
    assert {key: tuple(t.shape) for key, t in batch.items()} == {
        "input_ids": (2, 8), "loss_mask": (2, 8), "attention_mask": (2, 8), "aux": (2, 8, 6)}
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 0, 0, 0]]
    assert torch.equal(batch["attention_mask"], batch["input_ids"].ne(0).long())
    assert torch.equal(batch["loss_mask"], batch["attention_mask"])
    for i, n in enumerate((3, 5)):
        assert torch.equal(batch["aux"][i, :n], rows[i]["aux"]) and batch["aux"][i, n:].eq(0).all()
    assert collate_hidden_states(rows, multiple=5)["aux"].shape == (2, 5, 6)


@pytest.mark.parametrize("store", ["hidden", "logits"])
def test_offline_batch_matches_online(target, rows, tmp_path, store):
    aux_layers = target.config.default_aux_layers
    dump_hidden_states(target, rows, tmp_path, aux_layers, shard_size_mb=SHARD_MB, store=store)
    ds = HiddenStateDataset(tmp_path, target, aux_layers)
    assert len(ds) == len(rows) and len(ds.files) > 2
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == [r["input_ids"] for r in rows]

    online = collate(rows)
    aux, logits = target_forward(target, online, aux_layers)
    offline = collate_hidden_states([ds[i] for i in range(len(ds))])
    for key in ("input_ids", "loss_mask", "attention_mask"):
        assert torch.equal(offline[key], online[key])
    off_logits = target.logits(offline["hidden"]) if store == "hidden" else offline["logits"]
    valid = online["attention_mask"].bool()
    torch.testing.assert_close(offline["aux"][valid], aux[valid], rtol=0, atol=1e-5)
    torch.testing.assert_close(off_logits[valid], logits[valid], rtol=0, atol=1e-5)
    assert offline["aux"][~valid].eq(0).all()

    head = random_head(target, logits[valid].argmax(-1).bincount(minlength=target.config.vocab_size).float())
    embed = target.embed_tokens.weight
    args = (online["loss_mask"], online["attention_mask"])
    on = ttt_loss(head, embed, online["input_ids"], aux, logits, *args)
    off = ttt_loss(head, embed, offline["input_ids"], offline["aux"], off_logits, *args)
    assert on.per_step_count.min() > 0 and on.per_step_acc.min() > 0
    torch.testing.assert_close(off.loss, on.loss, rtol=1e-6, atol=0)  # ~8.8: |Δ| is 1 fp32 ulp (9.5e-7)
    assert torch.equal(on.per_step_acc, off.per_step_acc) and torch.equal(on.per_step_count, off.per_step_count)


def test_resume_recreates_the_missing_shard(target, rows, tmp_path):
    aux_layers = target.config.default_aux_layers
    dump_hidden_states(target, rows, tmp_path, aux_layers, shard_size_mb=SHARD_MB)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    *_, last = sorted(p for p in tmp_path.glob("shard_*.safetensors"))
    last.unlink()
    with pytest.raises(ConfigError, match=rf"{last.name} \(1 of the \d+ shards index.json lists are missing\); "
                                          "rerun the dump"):
        HiddenStateDataset(tmp_path, target, aux_layers)  # found when training opens it, not when it reaches it

    calls = []
    hook = target.register_forward_hook(lambda *_: calls.append(1))
    try:
        dump_hidden_states(target, rows, tmp_path, aux_layers, shard_size_mb=SHARD_MB)
    finally:
        hook.remove()
    ds = HiddenStateDataset(tmp_path, target, aux_layers)
    assert len(calls) == ds.shard_of.count(len(ds.files) - 1)  # only the last shard's conversations reran
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_resume_refuses_other_rows_of_the_same_lengths(target, rows, tmp_path):
    """A dump resumed over other data is refused before any new shard, even where the lengths agree: the index
    keeps each shard's digest of its rows."""
    aux_layers = target.config.default_aux_layers
    dump_hidden_states(target, rows[:4], tmp_path, aux_layers, shard_size_mb=SHARD_MB)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    other = [dict(row) for row in rows]
    other[1] = {**rows[1], "input_ids": [(t + 1) % target.config.vocab_size for t in rows[1]["input_ids"]]}
    with pytest.raises(ValueError, match=r"shard_00000.safetensors holds other conversations than rows 0\.\."):
        dump_hidden_states(target, other, tmp_path, aux_layers, shard_size_mb=SHARD_MB)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    dump_hidden_states(target, rows, tmp_path, aux_layers, shard_size_mb=SHARD_MB)  # the same rows resume
    assert len(HiddenStateDataset(tmp_path, target, aux_layers)) == len(rows)


def test_a_dump_without_row_digests_is_refused(target, rows, tmp_path):
    aux_layers = target.config.default_aux_layers
    dump_hidden_states(target, rows[:2], tmp_path, aux_layers)
    index = json.loads((tmp_path / "index.json").read_text())
    for shard in index["shards"]:
        del shard["digest"]
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="shard_00000.safetensors has no digest of its rows"):
        dump_hidden_states(target, rows, tmp_path, aux_layers)


def test_reader_refuses_another_target_or_aux_layers(target, rows, hf_checkpoint, tmp_path):
    aux_layers = target.config.default_aux_layers
    dump_hidden_states(target, rows[:2], tmp_path, aux_layers)
    other = TargetModel.from_pretrained(hf_checkpoint("qwen2")[0])
    with pytest.raises(ValueError, match="dumped with target=.*'llama'.*this run has target=.*'qwen2'"):
        HiddenStateDataset(tmp_path, other, aux_layers)
    with pytest.raises(ValueError, match="dumped with target="):  # same config, other weights (base vs instruct)
        HiddenStateDataset(tmp_path, TargetModel(target.config), aux_layers)
    with pytest.raises(ValueError, match=r"dumped with aux_layers=\[2, 3, 3\], but this run has aux_layers=\[1, 3,"):
        HiddenStateDataset(tmp_path, target, (1, 3, 4))
    with pytest.raises(ValueError, match="aux_layers"):  # nor does a resumed dump mix them
        dump_hidden_states(target, rows, tmp_path, (1, 3, 4))
