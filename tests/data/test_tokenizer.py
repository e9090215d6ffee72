"""The tokenizer: stop ids contain the end-of-turn token and a checkpoint's generation eos ids, chats render and decode
back."""

import copy
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from eyas.common.config import ConfigError
from eyas.data.tokenizer import SENTINEL, align_eos, end_of_turn_id, load_tokenizer, render_chat, stop_token_ids


def test_smollm2_stop_ids_contain_im_end(smollm2_tokenizer):
    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2
    assert end_of_turn_id(smollm2_tokenizer) == im_end
    assert im_end in stop_token_ids(smollm2_tokenizer)
    assert smollm2_tokenizer.eos_token_id == im_end


def test_smollm2_mislabelled_eos(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.eos_token = "<|endoftext|>"  # the label some transformers versions read from the GGUF
    assert 2 in stop_token_ids(tok)
    align_eos(tok)  # <|endoftext|> never appears in the template, so eos becomes <|im_end|>
    assert tok.eos_token_id == 2


def test_smollm2_render_chat_round_trip(smollm2_tokenizer):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
    ]
    ids = render_chat(smollm2_tokenizer, messages, add_generation_prompt=False)
    text = smollm2_tokenizer.decode(ids)
    assert "What is the capital of France?" in text and "Paris is the capital of France." in text
    assert ids[-2] == 2  # "<|im_end|>\n" closes the assistant turn
    prompt = render_chat(smollm2_tokenizer, messages[:1])
    assert smollm2_tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert prompt.count(smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # no BOS added on top


def tiny_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with eos `</s>` and special markers `<turn>`, `<end>`, `<eom>`."""
    words = ["[UNK]", "user", "assistant", ":", "x", SENTINEL]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["</s>", "<turn>", "<end>", "<eom>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="[UNK]")
    tok.chat_template = template
    return tok


LOOP = "{% for m in messages %}<turn>{{ m['role'] }}: {{ m['content'] }}"


@pytest.mark.parametrize(
    "template, end_of_turn, stops, eos_after_align",
    [
        (LOOP + " <end>\n{% endfor %}", "<end>", ["</s>", "<end>"], "<end>"),  # eos unused by the template: replaced
        (LOOP + "</s>{% endfor %}", "</s>", ["</s>"], "</s>"),  # eos closes turns: one stop
        (LOOP + "<end>{% endfor %}</s>", "<end>", ["</s>", "<end>"], "</s>"),  # eos ends the conversation: kept
        (LOOP + "\n\n{% endfor %}", None, ["</s>"], "</s>"),  # turns end with plain text
    ],
)
def test_end_of_turn_detection(template, end_of_turn, stops, eos_after_align):
    tok = tiny_tokenizer(template)
    expected = None if end_of_turn is None else tok.convert_tokens_to_ids(end_of_turn)
    assert end_of_turn_id(tok) == expected
    assert tok.convert_ids_to_tokens(stop_token_ids(tok)) == stops
    align_eos(tok)
    assert tok.eos_token == eos_after_align


def test_stop_ids_add_the_generation_configs_eos_ids(tmp_path):
    """A checkpoint directory's generation_config.json may end generations at more ids than eos and the end of turn
    (Llama 3.1 Instruct: <|eom_id|> after a tool call, <|end_of_text|>): each is a stop, once."""
    tiny_tokenizer(LOOP + " <end>\n{% endfor %}").save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.convert_ids_to_tokens(stop_token_ids(tok)) == ["<end>"]  # eos aligned to it: </s> is never written
    ids = {token: tok.convert_tokens_to_ids(token) for token in ("</s>", "<end>", "<eom>")}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<end>"], ids["<eom>"]]}))
    tok = load_tokenizer(tmp_path)
    assert tok.convert_ids_to_tokens(stop_token_ids(tok)) == ["<end>", "<eom>"]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["</s>"]}))
    assert tok.convert_ids_to_tokens(stop_token_ids(tok)) == ["<end>", "</s>"]


@pytest.mark.parametrize("eos", ["</s>", [6, 10], [True]], ids=["name", "past-vocabulary", "bool"])
def test_a_bad_generation_eos_is_named(tmp_path, eos):
    tiny_tokenizer(LOOP + " <end>\n{% endfor %}").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(ConfigError, match=r"generation_config.json: field 'eos_token_id' must be a token id"):
        stop_token_ids(load_tokenizer(tmp_path))
