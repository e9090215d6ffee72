"""Token counts cover loss-masked tokens only; the CLI writes a loadable FR-Spec map."""

import copy
import json

import pytest
import torch
from datasets import Dataset

from eyas.common.hot_vocab import HotVocab
from eyas.data.vocab import draft_vocab, main, token_counts
from tests.conftest import hf_config_dict


def test_counts_only_masked_tokens():
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 3], [3, 4, 0]], "loss_mask": [[0, 1, 1, 1], [1, 0, 1]]})
    counts = token_counts(ds, vocab_size=6)
    assert counts.tolist() == [1, 0, 1, 3, 0, 0]
    assert draft_vocab(counts, 2).hot_ids.tolist() == [0, 3]  # ties go to the lower id; EAGLE-3 order by id
    assert draft_vocab(counts, 2, order="by_frequency").hot_ids.tolist() == [3, 0]
    assert draft_vocab(counts).draft_vocab_size == 6  # the default size exceeds the vocab: all of it


def test_cli_writes_token_map(smollm2_tokenizer, tmp_path, capsys):
    # A target directory holding the real tokenizer and a config: loads in well under a second, unlike the GGUF.
    target = tmp_path / "target"
    smollm2_tokenizer.save_pretrained(target)
    (target / "config.json").write_text(json.dumps(hf_config_dict("llama", vocab_size=len(smollm2_tokenizer))))
    data = tmp_path / "chats.jsonl"
    chat = [{"role": "user", "content": "Count: one, two."}, {"role": "assistant", "content": "one one one two"}]
    data.write_text(json.dumps({"messages": chat}) + "\n")
    output = tmp_path / "freq_4.pt"

    main(["--target", str(target), "--data", str(data), "--size", "4", "--output", str(output),
          "--cache-dir", str(tmp_path / "cache")])

    hot = HotVocab.load_token_map(output, len(smollm2_tokenizer))
    assert hot.draft_vocab_size == 4
    # Most frequent first: " one" (twice in the answer) leads.
    assert smollm2_tokenizer.decode(hot.hot_ids[:1]) == " one"
    assert set(hot.hot_ids.tolist()) <= set(smollm2_tokenizer("one one one two<|im_end|>").input_ids)
    assert isinstance(torch.load(output, weights_only=True), list)
    out = capsys.readouterr().out
    assert "wrote" in out and "never occur" not in out

    # More ids asked for than distinct tokens occur: the map is padded with unseen ids, and the summary says so.
    distinct = len(set(smollm2_tokenizer("one one one two<|im_end|>").input_ids))
    main(["--target", str(target), "--data", str(data), "--size", "10", "--output", str(output),
          "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert f"{10 - distinct} of them never occur in the data (it has only {distinct} distinct" in out


def test_cli_refuses_a_tokenizer_without_a_chat_template(smollm2_tokenizer, tmp_path, capsys):
    base = copy.deepcopy(smollm2_tokenizer)
    base.chat_template = None
    base.save_pretrained(tmp_path / "base")
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    with pytest.raises(SystemExit) as stopped:
        main(["--target", str(tmp_path / "base"), "--data", str(data), "--output", str(tmp_path / "freq.pt")])
    assert stopped.value.code == 2 and "its tokenizer has no chat template" in capsys.readouterr().err


def test_cli_refuses_a_tokenizer_larger_than_the_target_vocabulary(smollm2_tokenizer, tmp_path, capsys):
    """A fine-tune that added tokens without resizing its config: refused by name (bincount's shape error before)."""
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    small = hf_config_dict("llama", vocab_size=len(smollm2_tokenizer) - 1)
    (tmp_path / "target" / "config.json").write_text(json.dumps(small))
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    with pytest.raises(SystemExit) as stopped:
        main(["--target", str(tmp_path / "target"), "--data", str(data), "--output", str(tmp_path / "freq.pt")])
    assert stopped.value.code == 2 and (f"its tokenizer has {len(smollm2_tokenizer)} tokens, more than its config's "
                                        f"vocab_size {len(smollm2_tokenizer) - 1}") in capsys.readouterr().err


def test_counts_name_an_id_past_the_vocabulary():
    ds = Dataset.from_dict({"input_ids": [[1, 7]], "loss_mask": [[1, 1]]})
    with pytest.raises(ValueError, match="token id 7 is past the target's vocabulary of 6"):
        token_counts(ds, vocab_size=6)


def test_cli_names_a_file_without_a_usable_conversation(smollm2_tokenizer, tmp_path, capsys):
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "target" / "config.json").write_text(json.dumps(hf_config_dict("llama",
                                                                               vocab_size=len(smollm2_tokenizer))))
    data = tmp_path / "empty.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": ""}]}) + "\n")
    with pytest.raises(SystemExit) as stopped:
        main(["--target", str(tmp_path / "target"), "--data", str(data), "--output", str(tmp_path / "freq.pt"),
              "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "--data: no usable conversation" in err and "Traceback" not in err


def test_cli_names_data_whose_every_row_is_cut_off(smollm2_tokenizer, tmp_path, capsys):
    """Every assistant part past --max-length: no rows to count (a traceback deep in the counting before)."""
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "target" / "config.json").write_text(json.dumps(hf_config_dict("llama",
                                                                               vocab_size=len(smollm2_tokenizer))))
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    with pytest.raises(SystemExit) as stopped:
        main(["--target", str(tmp_path / "target"), "--data", str(data), "--output", str(tmp_path / "freq.pt"),
              "--max-length", "3", "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "no conversation with loss tokens (all cut off by --max-length 3" in err


def test_cli_names_a_missing_data_file(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(SystemExit) as stopped:  # a usage error before the (here unloadable) target loads
        main(["--target", "unused", "--data", str(missing), "--output", str(tmp_path / "freq.pt")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"argument --data: data '{missing}' is neither an existing path" in err


@pytest.mark.parametrize("args, words", [(["--size", "0"], "--size and --max-length must be at least 1, got 0 and"),
                                         (["--max-length", "0"], "must be at least 1, got 32000 and 0"),
                                         (["--output", "no/such/dir/freq.pt"], "--output no/such/dir/freq.pt: no "
                                          "directory no/such/dir"),
                                         (["--output", "."], "--output .: a directory; give the map's file name"),
                                         (["--target", "no-such-model"], "argument --target: target 'no-such-model' "
                                          "is neither an existing path")])
def test_cli_refuses_bad_sizes_and_paths_before_counting(tmp_path, capsys, args, words):
    data = tmp_path / "d.jsonl"
    data.write_text("")
    with pytest.raises(SystemExit) as stopped:
        main(["--target", "unused", "--data", str(data), "--output", str(tmp_path / "freq.pt"), *args])
    assert stopped.value.code == 2 and words in capsys.readouterr().err
