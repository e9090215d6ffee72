"""python -m eyas.serve.chat prints the answer as it comes, whole characters only."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from eyas.serve import chat, commands
from tests.serve.test_api import tokenizer


def fake_models(context: int):
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context))
    return lambda target, device: (model, None, tokenizer(), Path("model.gguf"))


def test_chat_streams_whole_characters(monkeypatch, capsys):
    tok = tokenizer()
    answer = "Eyas 🦅 means a young hawk — 幼鷹."
    ids = tok(answer, add_special_tokens=False).input_ids
    monkeypatch.setattr(commands, "load_models", fake_models(512))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    monkeypatch.setattr(chat, "greedy_tokens", lambda *args, **kw: iter([*ids, end]))
    chat.main(["Hello"])
    out = capsys.readouterr()
    assert out.out == answer + "\n" and f"[{len(ids)} tokens in" in out.err


def test_a_prompt_past_the_context_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(commands, "load_models", fake_models(8))
    with pytest.raises(SystemExit) as exit_:
        chat.main(["a message of more tokens than the context holds"])
    assert exit_.value.code == 2 and "model.gguf's context holds 8" in capsys.readouterr().err
