"""Loss masks cover exactly the assistant contents and their end-of-turn tokens; datasets cache; collate pads."""

import copy
import json

import pytest
import torch

from eyas.data import dataset
from eyas.data.conversations import ConversationError
from eyas.data.dataset import DataConfig, build_dataset, collate
from eyas.data.loss_mask import TemplateMismatch, render_with_spans, tokenize_conversation
from eyas.data.tokenizer import end_of_turn_id

CHAT = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Italy? Say it with a newline at the end."},
    {"role": "assistant", "content": "Rome.\n"},
]


def masked_runs(tokenizer, ids, mask):
    """The decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            current.append(i)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_mask_is_assistant_content_and_end_of_turn(smollm2_tokenizer):
    eot = end_of_turn_id(smollm2_tokenizer)
    row = tokenize_conversation(smollm2_tokenizer, CHAT, end_of_turn=eot)
    assert len(row["input_ids"]) == len(row["loss_mask"])
    assert masked_runs(smollm2_tokenizer, row["input_ids"], row["loss_mask"]) == [
        "Paris is the capital of France.<|im_end|>",
        "Rome.\n<|im_end|>",
    ]
    # Everything unmasked decodes to the template and the system/user text, with no assistant text.
    unmasked = smollm2_tokenizer.decode([i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m])
    for m in CHAT:
        assert (m["content"] in unmasked) == (m["role"] != "assistant")


def test_default_system_prompt_is_not_masked(smollm2_tokenizer):
    # SmolLM2's template adds a default system message when there is none.
    row = tokenize_conversation(smollm2_tokenizer, CHAT[1:3], end_of_turn=end_of_turn_id(smollm2_tokenizer))
    assert masked_runs(smollm2_tokenizer, row["input_ids"], row["loss_mask"]) == [
        "Paris is the capital of France.<|im_end|>"
    ]
    assert "SmolLM" in smollm2_tokenizer.decode(row["input_ids"])


def test_assistant_text_repeated_in_user_turn(smollm2_tokenizer):
    # The spans come from the template's structure, not from searching for the content.
    chat = [{"role": "user", "content": "Say: assistant"}, {"role": "assistant", "content": "assistant"}]
    row = tokenize_conversation(smollm2_tokenizer, chat, end_of_turn=end_of_turn_id(smollm2_tokenizer))
    assert masked_runs(smollm2_tokenizer, row["input_ids"], row["loss_mask"]) == ["assistant<|im_end|>"]


def test_template_that_rewrites_content_is_refused(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    with pytest.raises(TemplateMismatch):
        render_with_spans(tok, CHAT)


def test_a_conversation_the_template_rewrites_is_skipped_by_name(smollm2_tokenizer, tmp_path, caplog):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper if 'shout' in m['content'] "
                         "else m['content'] }}<|im_end|>\n{% endfor %}")
    shouted = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "shout it"}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in (CHAT[1:3], shouted)))
    assert len(build_dataset(path, tok, DataConfig(cache_dir=str(tmp_path / "cache")))) == 1
    assert f"{path}: skipping the conversation at line 2: the template rewrites assistant content" in caplog.text


def test_a_conversation_the_template_refuses_is_skipped_by_name(smollm2_tokenizer, tmp_path, caplog):
    """Templates that raise on a role they do not support (Mistral's, Gemma's on a system message) skip that
    conversation, named, instead of stopping the whole data set."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                         "supported') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}")
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in (CHAT[1:3], CHAT)))
    assert len(build_dataset(path, tok, DataConfig(cache_dir=str(tmp_path / "cache")))) == 1
    want = f"{path}: skipping the conversation at line 2: the template refuses it: System role not supported"
    assert want in caplog.text


def test_truncation(smollm2_tokenizer):
    eot = end_of_turn_id(smollm2_tokenizer)
    full = tokenize_conversation(smollm2_tokenizer, CHAT, end_of_turn=eot)
    cut = tokenize_conversation(smollm2_tokenizer, CHAT, end_of_turn=eot, max_length=40)
    assert cut["input_ids"] == full["input_ids"][:40] and cut["loss_mask"] == full["loss_mask"][:40]


def test_dataset_cache_and_collate(smollm2_tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "chats.jsonl"
    long_prompt = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    lines = [{"messages": CHAT}, {"messages": CHAT[1:3]}, {"messages": long_prompt}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = DataConfig(max_length=100, cache_dir=str(tmp_path / "cache"))
    ds = build_dataset(path, smollm2_tokenizer, config)
    assert len(ds) == 2  # the long prompt leaves no assistant token within 100 tokens: dropped
    row = tokenize_conversation(smollm2_tokenizer, CHAT, end_of_turn=end_of_turn_id(smollm2_tokenizer), max_length=100)
    assert ds[0] == row
    # Same file, tokenizer and config: the cached Arrow file is reused; another max_length is not.
    assert build_dataset(path, smollm2_tokenizer, config).cache_files == ds.cache_files
    assert build_dataset(
        path, smollm2_tokenizer, DataConfig(max_length=50, cache_dir=config.cache_dir)
    )._fingerprint != (ds._fingerprint)

    # Other reading or masking code (its source's stamp) is not served the old rows: datasets keys the tokenizing
    # function on its name alone.
    monkeypatch.setattr(dataset, "tokenize_rendered", lambda *args: [{"input_ids": [1, 2], "loss_mask": [0, 1]}])
    assert len(build_dataset(path, smollm2_tokenizer, config)) == 2  # the cached rows, though the code changed
    monkeypatch.setattr(dataset, "SOURCE_STAMP", "changed")
    assert build_dataset(path, smollm2_tokenizer, config)[0] == {"input_ids": [1, 2], "loss_mask": [0, 1]}

    batch = collate([ds[0], ds[1]], pad_id=7)
    n0, n1 = len(ds[0]["input_ids"]), len(ds[1]["input_ids"])
    assert n0 > n1
    for key in ("input_ids", "loss_mask", "attention_mask"):
        assert batch[key].shape == (2, n0) and batch[key].dtype == torch.long
    assert batch["input_ids"][1, :n1].tolist() == ds[1]["input_ids"]
    assert (batch["input_ids"][1, n1:] == 7).all()
    assert batch["attention_mask"].sum(1).tolist() == [n0, n1]
    assert batch["loss_mask"][1, n1:].sum() == 0 and batch["loss_mask"][1, :n1].tolist() == ds[1]["loss_mask"]


def test_a_file_with_no_usable_conversation_names_the_cause(smollm2_tokenizer, tmp_path):
    """A messages file read with `format: sharegpt` forced yields nothing: the error says so, and why."""
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    config = DataConfig(format="sharegpt", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConversationError, match=r"no usable conversation \(format 'sharegpt' forced.*line 1"):
        build_dataset(path, smollm2_tokenizer, config)


def test_max_bytes_reads_the_start_of_the_file(smollm2_tokenizer, tmp_path):
    path = tmp_path / "chats.jsonl"
    lines = [json.dumps({"messages": chat}) + "\n" for chat in (CHAT, CHAT[1:3])]
    path.write_text("".join(lines))
    cache = str(tmp_path / "cache")
    assert len(build_dataset(path, smollm2_tokenizer, DataConfig(max_bytes=len(lines[0]) + 10, cache_dir=cache))) == 1
    assert len(build_dataset(path, smollm2_tokenizer, DataConfig(cache_dir=cache))) == 2  # the cache keys on it


def test_conversations_that_the_template_rewrites_are_dropped(smollm2_tokenizer, tmp_path):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | replace('.', '!') }}<|im_end|>\n{% endfor %}"
    )
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in (CHAT, CHAT[1:3])))
    assert len(build_dataset(path, tok, DataConfig(cache_dir=str(tmp_path / "cache")))) == 0  # both contain "."
