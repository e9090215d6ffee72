"""python -m eyas.serve.chat prints the answer as it comes, whole characters only."""

from pathlib import Path

from eyas.serve import chat
from tests.serve.test_api import tokenizer


def test_chat_streams_whole_characters(monkeypatch, capsys):
    tok = tokenizer()
    answer = "Eyas 🦅 means a young hawk — 幼鷹."
    ids = tok(answer, add_special_tokens=False).input_ids
    monkeypatch.setattr(chat, "load_models", lambda target, device: (None, None, tok, Path("model.gguf")))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    monkeypatch.setattr(chat, "greedy_tokens", lambda *args, **kw: iter([*ids, end]))
    chat.main(["Hello"])
    out = capsys.readouterr()
    assert out.out == answer + "\n" and f"[{len(ids)} tokens in" in out.err
