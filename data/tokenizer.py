"""The target's tokenizer, its chat template and the tokens that end a generation.

    tok = load_tokenizer("path/to/model.gguf")  # or a Hugging Face directory
    ids = render_chat(tok, [{"role": "user", "content": "Hi"}])  # the prompt, up to the assistant header
    stops = stop_token_ids(tok)  # SmolLM2: [2], <|im_end|>; with a generation_config.json, its eos ids too

Data preparation, serving and evaluation all load tokenizers here, so they agree on the template and
on which tokens end a turn.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from eyas.common.config import ConfigError, errors_naming, read_json

# Stands for an assistant message's content: plain letters that no template rewrites or merges with
# the marker that follows.
SENTINEL = "EyasSentinelContent"


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a target: a Hugging Face directory, or a `.gguf` file (its vocabulary and template). A path
    no tokenizer loads from is a ConfigError naming it."""
    path = Path(path)
    with errors_naming(path, "no tokenizer loads from it", catch=(OSError, ValueError)):
        if path.suffix == ".gguf":
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
    align_eos(tokenizer)
    return tokenizer


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of `messages` (`{"role", "content"}` dicts) in the tokenizer's chat template.

    Rendered to text, then encoded without added special tokens: the template already writes BOS and
    the turn markers, so letting the tokenizer add them would double BOS.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False).input_ids


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token that the chat template closes each message with.

    Found by rendering [user "x", assistant SENTINEL] and taking the first token after the sentinel,
    only whitespace being allowed in between (Llama 2 writes " </s>"). For SmolLM2:
        "...<|im_start|>assistant\\nEyasSentinelContent<|im_end|>\\n"  ->  <|im_end|> (id 2)
    None when there is no chat template or the template ends messages with plain text.
    """
    if tokenizer.chat_template is None:
        return None
    after = end_of_message(tokenizer)
    # Added tokens flagged special include template markers (`<|eot_id|>`, `<end_of_turn>`) that are
    # not among the named special tokens (bos, eos, ...).
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    for token_id in tokenizer(after, add_special_tokens=False).input_ids:
        if token_id in special:
            return token_id
        if tokenizer.decode([token_id]).strip():
            return None
    return None


def end_of_message(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text the chat template writes after an assistant message's content (SmolLM2: "<|im_end|>\\n")."""
    return _render_sentinel(tokenizer)[1]


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end a generation, each once: eos, the end-of-turn token, and the eos ids of the generation_config.json
    beside the tokenizer's files, where the checkpoint has one (Llama 3.1 Instruct's: <|eot_id|>, <|eom_id|> after a
    tool call, <|end_of_text|>; Qwen2.5's: <|im_end|>, <|endoftext|>), as Hugging Face `generate`, vLLM and SGLang
    stop."""
    ids = (tokenizer.eos_token_id, end_of_turn_id(tokenizer), *_generation_eos_ids(tokenizer))
    return list(dict.fromkeys(i for i in ids if i is not None))


def _generation_eos_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """`eos_token_id` (an id or a list of them) of generation_config.json in the directory the tokenizer was loaded
    from; [] where there is none."""
    if not tokenizer.name_or_path:  # built in memory, not loaded
        return []
    path = Path(tokenizer.name_or_path) / "generation_config.json"
    if not path.is_file():
        return []
    ids = read_json(path).get("eos_token_id")
    ids = [] if ids is None else [ids] if isinstance(ids, int) else ids
    if not (isinstance(ids, list) and all(type(i) is int and 0 <= i < len(tokenizer) for i in ids)):
        raise ConfigError(f"{path}: field 'eos_token_id' must be a token id or a list of them, each below the "
                          f"vocabulary's {len(tokenizer)}, got {ids!r}")
    return ids


def align_eos(tokenizer: PreTrainedTokenizerBase) -> None:
    """Sets eos to the end-of-turn token when the chat template never writes the labelled eos.

    A chat model stops by emitting the token that closes its turn, and generation loops, padding and
    `generate` read `eos_token_id`. Checkpoints may label an unused token as eos (transformers versions
    have read SmolLM2's GGUF with eos `<|endoftext|>`, which its template never writes, instead of
    `<|im_end|>`); such an eos would never be produced. A label the template does write (Mistral closes
    turns with `</s>`; some templates end the conversation with eos) is kept.
    """
    eot = end_of_turn_id(tokenizer)
    if eot is None or eot == tokenizer.eos_token_id:
        return
    text, _ = _render_sentinel(tokenizer)
    if tokenizer.eos_token_id not in tokenizer(text, add_special_tokens=False).input_ids:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eot)


def _render_sentinel(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """(The template's text of [user "x", assistant SENTINEL], the text after the sentinel)."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if SENTINEL not in text:
        raise ValueError("the chat template does not write the assistant's message content")
    return text, text[text.rindex(SENTINEL) + len(SENTINEL) :]
