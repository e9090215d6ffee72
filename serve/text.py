"""Generated token ids to text, piece by piece: never a broken UTF-8 character, and stop strings cut out.

    text = TextStream(tokenizer, stop=["\\n\\n"], prompt=prompt_ids)
    piece = text.push([318, 257])    # text that is final: complete characters, not the start of a stop string
    rest = text.finish()             # what was held back, once the generation has ended
    text.stopped                     # a stop string was found; the text ends before it

Decoding token by token goes wrong in two ways: a byte-level token may hold part of a UTF-8 character
(decoded alone it gives "\\ufffd"), and some tokenizers decode a token differently after its left
neighbour (SentencePiece's leading space). So each step decodes a short window of already-shown tokens
plus the new ones and emits the difference, and waits while that difference ends in "\\ufffd"; the first
window is the prompt's last tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Generated ids as the answer's text: special tokens (a chat template's markers the model may emit) dropped."""
    return tokenizer.decode(ids, skip_special_tokens=True)


# Prompt ids the first generated ones are decoded after: a SentencePiece decoder (Llama 2's, Mistral's) drops the
# leading space of a text's first token, which a generated token is not.
PROMPT_CONTEXT = 4


class TextStream:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str] = (), prompt: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        # Per stop string: its KMP failure table, and how much of it the text's end matches (`_append`, `_held`).
        self.fallback = [_failure(s) for s in self.stop]
        self.matched = [0] * len(self.stop)
        self.ids = list(prompt[-PROMPT_CONTEXT:])
        self.window = 0  # ids[window:shown] give the context the next piece is decoded after
        self.shown = len(self.ids)  # ids decoded into `text` (or the prompt's, shown by the client)
        self.text = ""
        self.sent = 0  # len(text) handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return decode_text(self.tokenizer, ids)

    def _shown_text(self, after: str) -> str:
        """The window's shown ids decoded, which `after` (the window with the new ids) extends; but where the first
        window (the prompt's last ids) ends in an incomplete character ("\ufffd") that the new ids complete (`after`
        no longer starts with it), the text before that character: the answer shows it. (A window the answer's ids
        begin starts with the rest of that character's bytes, as "\ufffd", in both.)"""
        before = self._decode(self.ids[self.window : self.shown])
        return before.rstrip("\ufffd") if self.window == 0 and not after.startswith(before) else before

    def push(self, ids: list[int]) -> str:
        """Adds generated ids; returns the new text that can be shown."""
        if self.stopped:
            return ""
        self.ids += ids
        after = self._decode(self.ids[self.window :])
        before = self._shown_text(after)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._append(after[len(before) :])
            self.window, self.shown = self.shown, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text (an incomplete character included, as a full decode would show it)."""
        if not self.stopped and self.shown < len(self.ids):
            after = self._decode(self.ids[self.window :])
            self._append(after[len(self._shown_text(after)) :])
            self.shown = len(self.ids)
        return self._release(final=True)

    def _append(self, piece: str) -> None:
        """Adds `piece` to `text`, which ends before the first stop string to appear whole, if any: the one completed
        in the earliest piece, and of those completed in one piece the one that starts first (the API pushes a token
        at a time, so the stop string that the earliest token completes wins, as in vLLM)."""
        end = len(self.text)
        self.text += piece
        cut = len(self.text)
        for j, (stop, fallback) in enumerate(zip(self.stop, self.fallback, strict=True)):
            matched = self.matched[j]
            for at, c in enumerate(piece, start=end + 1):  # `at`: the text's length through c
                while matched and stop[matched] != c:
                    matched = fallback[matched - 1]
                matched += stop[matched] == c
                if matched == len(stop):  # this stop's first whole appearance
                    cut = min(cut, at - len(stop))
                    break
            self.matched[j] = matched
        if cut < len(self.text):
            self.text = self.text[:cut]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._held()
        piece = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return piece

    def _held(self) -> int:
        """Length of the longest end of `text` that may begin a stop string (not shown until resolved): kept as each
        piece arrives (`_append`), so a token costs its characters, not the length of the stop strings. Not called
        once a stop string has appeared."""
        return max(self.matched, default=0)


def _failure(s: str) -> list[int]:
    """KMP's table: failure[i] = the length of the longest proper prefix of s[: i + 1] that also ends it."""
    failure, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = failure[k - 1]
        k += s[i] == s[k]
        failure[i] = k
    return failure
