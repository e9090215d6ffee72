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



# Qwen3's handling of replies, restated: a reply's `<think>` block is taken apart; after the last user turn the
# reasoning is written back in a block (an empty block for the last reply when it has none), before it dropped.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_query=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role != 'assistant' %}{{- '<|im_start|>' + m.role + '\n' + m.content + "
    "'<|im_end|>\n' }}{%- else %}{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1]"
    ".lstrip('\n') %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}{{- '<|im_start|>assistant\n<think>\n' + "
    "reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}{%- else %}{{- '<|im_start|>assistant\n' + "
    "content }}{%- endif %}{{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


@pytest.mark.parametrize("chat, runs", [
    # Replies with reasoning, as the target writes them when regenerating: the earlier one is masked as the template
    # writes it (reasoning dropped), the last one from its `<think>` on, as served after the generation prompt.
    ([CHAT[1], {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nParis."}, CHAT[3],
      {"role": "assistant", "content": "<think>\nAlso easy.\n</think>\n\nRome."}],
     ["Paris.<|im_end|>", "<think>\nAlso easy.\n</think>\n\nRome.<|im_end|>"]),
    # A last reply whose leading newline the template strips (and an earlier one kept verbatim).
    ([*CHAT[1:4], {"role": "assistant", "content": "\nRome. "}],
     ["Paris is the capital of France.<|im_end|>", "<think>\n\n</think>\n\nRome. <|im_end|>"]),
    # Replies the template writes verbatim keep their content spans: the empty block it adds is its own text.
    (CHAT[1:], ["Paris is the capital of France.<|im_end|>", "Rome.\n<|im_end|>"]),
])
def test_replies_a_template_takes_apart_are_masked_as_generated(smollm2_tokenizer, chat, runs):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = QWEN3_STYLE
    row = tokenize_conversation(tok, chat, end_of_turn=end_of_turn_id(tok))
    assert masked_runs(tok, row["input_ids"], row["loss_mask"]) == runs
    unmasked = tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m])
    assert unmasked.count("<|im_start|>assistant\n") == 2 and "Easy" not in unmasked


def test_a_rewriting_template_without_a_generation_prompt_is_refused(smollm2_tokenizer):
    """Without a generation prompt the start of a reply is unknown: the fallback refuses rather than mask the header."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = QWEN3_STYLE.replace("{%- if add_generation_prompt %}", "{%- if false %}")
    chat = [CHAT[1], {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nParis."}]
    with pytest.raises(TemplateMismatch, match="rewrites assistant content.*has no generation prompt"):
        render_with_spans(tok, chat)

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


def test_a_bad_record_is_reported_by_every_run_the_cache_serves(tmp_path, caplog):
    """The reader logs skipped records as it reads; a later run takes the conversations from the cache and read
    nothing, so it dropped the same record silently. A clean file stays quiet either way."""
    from eyas.data.dataset import load_conversations

    path, clean = tmp_path / "chats.jsonl", tmp_path / "clean.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n{broken\n")
    clean.write_text(json.dumps({"messages": CHAT}) + "\n")
    config = DataConfig(cache_dir=str(tmp_path / "cache"))
    for run in ("read", "cached"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert len(load_conversations(path, config)) == 1 and len(load_conversations(clean, config)) == 1
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "skipped 1 bad record(s), first at line 2" in warnings[0], (run, warnings)
        assert ("now come from the cache" in warnings[0]) == (run == "cached")
