"""A conversation -> token ids in the target's chat template + a loss mask on the assistant's tokens.

    eot = end_of_turn_id(tokenizer)
    row = tokenize_conversation(tokenizer, messages, end_of_turn=eot, max_length=2048)
    row["input_ids"], row["loss_mask"]  # lists of equal length; loss_mask 1 on assistant tokens

The mask covers each assistant message's content and the end-of-turn token that closes it (the head
must learn to stop), and nothing of the system/user messages or the template's markers. Worked example,
SmolLM2 (the template adds its default system message):

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
                                                                                  ^^^^^^^^^^^^^^^^ mask 1

Generic for any template, without knowing its markers: the conversation is rendered twice, once as is and
once with every assistant content replaced by SENTINEL. The text between sentinels is the template's
own, so the real text must be `piece0 + content0 + piece1 + content1 + ... + pieceN`; that gives each
content's exact character span (checked against the real rendering, with contents as given or trimmed,
as Llama 3's template trims them). Tokens overlapping a span are masked, plus the end-of-turn token after it.

A template that rewrites contents fails that check: Qwen3's takes a reply's `<think>` block apart, writes its
reasoning only into the replies after the last user turn, and an empty block where there was none. Such a
conversation's spans are then what the model generates when served: from the end of the prompt the template
renders for the turns before a reply (with its generation prompt) to the template's end-of-message marker.
The earlier turns must render alike in that prompt and in the whole conversation, which Qwen3's do:

    ...<|im_start|>assistant\n<think>\nReasoning.\n</think>\n\nAnswer.<|im_end|>\n
                               ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^ mask 1 (a last reply)
"""

from __future__ import annotations

from collections.abc import Sequence

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from eyas.data.tokenizer import SENTINEL, end_of_message


class TemplateMismatch(ValueError):
    """The chat template writes an assistant content neither verbatim (or trimmed) nor after its generation prompt, so
    its span is unknown, or it refuses the conversation (`raise_exception`: Mistral's and Gemma's refuse a system
    message)."""


def render_with_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(The conversation in the chat template, the [start, end) character span of each assistant content)."""
    text = _render(tokenizer, messages)
    try:
        return text, _content_spans(tokenizer, messages, text)
    except TemplateMismatch as rewritten:
        try:
            return text, _generated_spans(tokenizer, messages, text)
        except TemplateMismatch as e:
            raise TemplateMismatch(f"{rewritten}, and its generation prompt does not place it: {e}") from None


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as e:  # one conversation the template refuses must not stop the whole data set
        raise TemplateMismatch(f"the template refuses it: {e}") from e


def _content_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """The spans where `text` holds each assistant content verbatim (or trimmed), placed by the sentinel render."""
    stand_in = [{**m, "content": SENTINEL} if m["role"] == "assistant" else m for m in messages]
    pieces = _render(tokenizer, stand_in).split(SENTINEL)
    contents = [m["content"] for m in messages if m["role"] == "assistant"]
    if len(pieces) != len(contents) + 1:
        raise TemplateMismatch(f"the template wrote {len(pieces) - 1} of {len(contents)} assistant messages")
    for rendered in (contents, [c.strip() for c in contents]):
        spans, parts, pos = [], [], 0
        for piece, content in zip(pieces, rendered, strict=False):  # stops before the last piece
            pos += len(piece)
            spans.append((pos, pos + len(content)))
            pos += len(content)
            parts += [piece, content]
        if "".join(parts) + pieces[-1] == text:
            return spans
    raise TemplateMismatch("the template rewrites assistant content (neither verbatim nor trimmed)")


def _generated_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """The spans of `text` that the model generates after each reply's prompt, up to the end-of-message marker."""
    try:
        marker = end_of_message(tokenizer).strip()  # SmolLM2, Qwen: "<|im_end|>"
    except ValueError as e:  # a template that does not write a content it is given
        raise TemplateMismatch(str(e)) from None
    if not marker:
        raise TemplateMismatch("the template ends a message with whitespace alone")
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompts = [_render(tokenizer, messages[:i], generation_prompt=True) for i in replies]
    if prompts[0] == _render(tokenizer, messages[: replies[0]]):  # where a reply starts would be a guess
        raise TemplateMismatch("the template has no generation prompt")
    spans = []
    for prompt in prompts:
        end = text.find(marker, len(prompt))
        if not text.startswith(prompt) or end < 0:
            raise TemplateMismatch(f"the turns before assistant message {len(spans) + 1} render otherwise in its "
                                   "prompt")
        spans.append((len(prompt), end))
    return spans


def mask_tokens(
    text: str,
    input_ids: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    spans: list[tuple[int, int]],
    end_of_turn: int | None,
) -> list[int]:
    """1 for each token overlapping a span, and for the `end_of_turn` token that follows a span (only
    whitespace tokens between, as in Llama 2's " </s>"); 0 elsewhere. `offsets[k]` is token k's
    [start, end) in `text`; tokens and spans are both in text order, so one pass suffices."""
    mask = [0] * len(input_ids)
    k = 0
    for start, end in spans:
        while k < len(offsets) and offsets[k][1] <= start:
            k += 1
        while k < len(offsets) and offsets[k][0] < end:
            mask[k] = 1
            k += 1
        j = k
        while j < len(offsets) and input_ids[j] != end_of_turn and not text[offsets[j][0] : offsets[j][1]].strip():
            j += 1
        if j < len(offsets) and input_ids[j] == end_of_turn:
            mask[j] = 1
    return mask


def tokenize_rendered(
    tokenizer: PreTrainedTokenizerBase,
    rendered: list[tuple[str, list[tuple[int, int]]]],
    end_of_turn: int | None,
    max_length: int | None = None,
) -> list[dict[str, list[int]]]:
    """{"input_ids", "loss_mask"} of each `render_with_spans` result, cut to the first `max_length` tokens.

    One tokenizer call for the whole list: the Rust tokenizer spreads it over threads (`datasets.map` passes
    batches of 1000). No added special tokens: the template writes BOS and the turn markers itself.
    """
    if not rendered:  # the tokenizer fails on an empty batch (every conversation of a `map` batch skipped)
        return []
    enc = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    return [
        {"input_ids": ids[:max_length], "loss_mask": mask_tokens(text, ids, offsets, spans, end_of_turn)[:max_length]}
        for (text, spans), ids, offsets in zip(rendered, enc.input_ids, enc.offset_mapping, strict=True)
    ]


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    end_of_turn: int | None,
    max_length: int | None = None,
) -> dict[str, list[int]]:
    """{"input_ids", "loss_mask"} of one conversation, cut to the first `max_length` tokens.

    `end_of_turn`: `eyas.data.tokenizer.end_of_turn_id(tokenizer)`, passed in because finding it renders
    the template. Special-token text inside a message (a literal "<|im_end|>") is read as that special
    token, as the tokenizer does at serving time.
    """
    return tokenize_rendered(tokenizer, [render_with_spans(tokenizer, messages)], end_of_turn, max_length)[0]
