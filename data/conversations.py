"""Conversation files -> normalized conversations, `[{"role": "system"|"user"|"assistant", "content": str}, ...]`.

    report = ReadReport()
    for messages in read_conversations("ShareGPT_V3.json", report=report):
        ...
    print(report.summary())  # "...: 17545 conversations from 17671 records; skipped 126 ...; file ended mid-record"

Files are recognised by content: a JSON array (ShareGPT's layout), JSON lines, or one record spread over lines
(a single pretty-printed conversation); one named *.gz, *.bz2, *.xz or *.lzma is read decompressed. Each record's
layout is recognised by its keys (or forced with `format=`):
  "sharegpt":  {"conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}  (or role/content turns)
  "messages":  {"messages": [{"role", "content"}, ...]}   OpenAI chat JSONL (content a string or text parts),
                                                           HF ultrachat_200k rows
  "ultrachat": {"data": [user, assistant, user, ...]}     the original UltraChat release
A bad record (unknown role, empty or non-string content, a lone surrogate in it, no assistant turn, roles out of
order, a malformed JSON line) is skipped and counted with its file and place ("line 3" in JSONL, "record 3"
elsewhere; both count from 1); `strict=True` raises `ConversationError` instead. Malformed JSON inside a JSON array,
or text after its closing bracket, is a `ConversationError` either way: no record after it could be read.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import json
import logging
import lzma
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

Conversation = list[dict[str, str]]
FORMATS = ("sharegpt", "messages", "ultrachat")

# ShareGPT speaker names -> roles. V3 also names some assistant turns after the product that wrote them.
ROLES = {
    "system": "system",
    "developer": "system",  # OpenAI's newer name for it
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}


class ConversationError(ValueError):
    """A record is bad (strict mode); the message names the file and the record's number or line."""


@dataclass
class ReadReport:
    """What reading one file found: filled in while `read_conversations` iterates."""

    path: str = ""
    records: int = 0  # complete records read (good or bad, malformed JSON included)
    conversations: int = 0  # yielded
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (place, reason), e.g. ("record 12", "...")
    truncated: bool = False  # the file ended inside a record (a cut download or a deliberately short copy)

    def summary(self) -> str:
        text = f"{self.path}: {self.conversations} conversations from {self.records} records"
        if self.skipped:
            place, reason = self.skipped[0]
            text += f"; skipped {len(self.skipped)} bad record(s), first at {place}: {reason}"
        if self.truncated:
            text += f"; file ended mid-record, kept the {self.records} complete records before it"
        return text


def read_conversations(path: str | Path, **options) -> Iterator[Conversation]:
    """`read_placed_conversations`' conversations alone."""
    for _, messages in read_placed_conversations(path, **options):
        yield messages


def read_placed_conversations(
    path: str | Path,
    format: str | None = None,
    strict: bool = False,
    max_bytes: int | None = None,
    report: ReadReport | None = None,
) -> Iterator[tuple[str, Conversation]]:
    """Yields (place, conversation) for the normalized conversations of a file, place being "line 3" or "record 3",
    skipping (or, if `strict`, raising on) bad records.

    `format`: one of FORMATS to force every record's layout; None recognises each record by its keys.
    `max_bytes`: read only the file's first bytes (a cut JSON array then reads as truncated).
    `report`: filled in as the file is read; a one-line summary is also logged at the end.
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS} or None, got {format!r}")
    path = Path(path)
    report = report if report is not None else ReadReport()
    report.path = str(path)
    text, cut = _read_text(path, max_bytes)

    def bad(place: str, reason: str) -> None:
        if strict:
            raise ConversationError(f"{path}: {place}: {reason}")
        report.skipped.append((place, reason))

    body = text.lstrip()
    records = _json_array(text) if body.startswith("[") else _json_object(body, cut) or _json_lines(text, cut)
    for place, record in records:
        if record is _CUT:
            report.truncated = True
            if strict:
                raise ConversationError(f"{path}: {place}: file ended mid-record")
            break
        report.records += 1
        if isinstance(record, _UnreadableRest):  # not a record to skip: every record after it would be lost
            raise ConversationError(f"{path}: {place}: {record}")
        if isinstance(record, _MalformedJSON):
            bad(place, str(record))
            continue
        try:
            messages = normalize(record, format)
        except ValueError as e:
            bad(place, str(e))
            continue
        report.conversations += 1
        yield place, messages
    (logger.warning if report.skipped or report.truncated else logger.info)(report.summary())


_CUT = object()  # in place of a record: the file (or the part read) ended inside it

# Compressed conversation files, by suffix: read decompressed (`max_bytes` counts decompressed bytes).
DECOMPRESSORS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".lzma": lzma.open}


def _read_text(path: Path, max_bytes: int | None) -> tuple[str, bool]:
    """The file's (decompressed) text, up to `max_bytes` bytes, and whether the read stopped inside the file; bytes
    that are not UTF-8 raise a ConversationError naming the file and the line."""
    data, cut = _read_bytes(path, max_bytes)
    # A read cut inside the file may split a multi-byte character at its end: the decoder keeps that one back (not
    # final), and only that one. A byte-order mark is not data.
    try:
        return codecs.getincrementaldecoder("utf-8-sig")().decode(data, final=not cut), cut
    except UnicodeDecodeError as e:  # its message names neither the file nor the line
        at = e.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)  # counted past a BOM
        line = data.count(b"\n", 0, at) + 1
        raise ConversationError(f"{path}: line {line} (byte {at}): not UTF-8 ({e.reason}); convert the file, "
                                "e.g. `iconv -f latin1 -t utf-8`") from None


def _read_bytes(path: Path, max_bytes: int | None) -> tuple[bytes, bool]:
    """The file's (decompressed) bytes, up to `max_bytes`, and whether the read stopped inside the file."""
    decompress = DECOMPRESSORS.get(path.suffix.lower())
    with open(path, "rb") as f:  # a missing or unreadable file raises as it is
        if decompress is None:
            return f.read(max_bytes if max_bytes is not None else -1), bool(f.read(1))
        try:
            return _decompressed(decompress(f, "rb"), max_bytes)
        except (OSError, lzma.LZMAError) as e:
            raise ConversationError(f"{path}: not a readable {path.suffix} file ({e})") from None


def _decompressed(stream, max_bytes: int | None, chunk: int = 1 << 16) -> tuple[bytes, bool]:
    """`_read_bytes` of a decompressing `stream`, read a `chunk` at a time: a stream cut short (a partial download)
    reads as a truncated file, its complete records kept but for those in the chunk being decompressed (or a bz2
    file's last block), which the EOFError takes with it."""
    chunks, size = [], 0
    try:
        while max_bytes is None or size < max_bytes:
            part = stream.read(chunk if max_bytes is None else min(chunk, max_bytes - size))
            if not part:
                return b"".join(chunks), False
            chunks.append(part)
            size += len(part)
        return b"".join(chunks), bool(stream.read(1))
    except EOFError:  # the stream ends before its end marker
        return b"".join(chunks), True


class _MalformedJSON(ValueError):
    """In place of a record: its text is not JSON."""


class _UnreadableRest(_MalformedJSON):
    """In place of a record of a JSON array: malformed JSON, or text after the array, past which no record can be
    read (an element's end is unknown)."""


def _json_array(text: str) -> Iterator[tuple[str, object]]:
    """(place, record) for each element of a JSON array, parsed one at a time so that a file cut inside
    a record still yields every complete record before the cut; the cut yields (place, _CUT)."""
    decoder = json.JSONDecoder()
    i, index = text.index("[") + 1, 1  # counted from 1, as JSONL's lines are
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i == len(text):  # ended between records, before the closing bracket
            yield f"record {index}", _CUT
            return
        if text[i] == "]":
            if text[i + 1 :].strip():  # e.g. two arrays concatenated: their records would go unread
                yield f"record {index}", _UnreadableRest(
                    f"text after the array's closing ']' (character {i}): {text[i + 1 :].strip()[:40]!r}; join the "
                    "records into one array")
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            # A record that stops parsing at the text's end was cut off (its last string may hold a ']', so the
            # text's last character does not tell a closed array); anything else is broken JSON that we cannot
            # resynchronise within (an element's end is unknown): an error.
            if _stops_at_the_end(text, e):
                yield f"record {index}", _CUT
            else:
                yield f"record {index}", _UnreadableRest(
                    f"malformed JSON: {e}; the records after it (from character {e.pos}) cannot be read")
            return
        yield f"record {index}", record
        index += 1


# What follows the place where a cut JSON value stops parsing: nothing, or a string, number, literal or \u escape cut.
_CUT_TOKEN = re.compile(r'"[^\n]*|[\w.+-]*')


def _stops_at_the_end(text: str, error: json.JSONDecodeError) -> bool:
    """Whether a JSON value failed to parse because `text` ends inside it, not because of a mistake before that."""
    return bool(_CUT_TOKEN.fullmatch(text[error.pos :].rstrip()))


def _json_object(text: str, cut: bool = False) -> list[tuple[str, object]] | None:
    """[("record 1", record)] if `text` (stripped of leading blanks) is one JSON value spread over lines, a single
    pretty-printed record; [("record 1", _CUT)] if `cut` stopped the text inside one; else None: JSON lines.
    JSONL costs one line's parse here: its first value ends at its first line's end."""
    try:
        record, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as e:
        # A value spread over lines and cut by the read stops parsing at the text's end or in its last string,
        # number or literal; any other failure, and any failure of a text not cut, is a bad first JSONL line.
        if cut and e.lineno > 1 and _stops_at_the_end(text, e):
            return [("record 1", _CUT)]
        return None
    # A one-line value is a JSONL line; `and` spares copying the rest of a big JSONL text.
    return [("record 1", record)] if text.find("\n", 0, end) >= 0 and not text[end:].strip() else None


def _json_lines(text: str, cut: bool = False) -> Iterator[tuple[str, object]]:
    """(place, record) for each non-blank line; a malformed line yields a _MalformedJSON. With `cut` (the text
    stops inside the file), a last line without its newline is the record the cut split: (place, _CUT)."""
    # Lines end at \n, \r\n or \r only: JSON strings may hold U+2028, U+0085 ..., which `splitlines` would split at.
    lines = io.StringIO(text, newline="").readlines()
    for number, line in enumerate(lines, start=1):
        if cut and number == len(lines) and not line.endswith(("\n", "\r")):
            yield f"line {number}", _CUT
            return
        if line.strip():
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"line {number}", _MalformedJSON(f"malformed JSON: {e}")


def read_json_lines(path: Path) -> Iterator[tuple[str, dict]]:
    """(place, record) for each non-blank line of a JSONL file of objects (read as `read_placed_conversations` reads
    one: decompressed where its suffix says); a line that is not one raises a ValueError naming the file and the line,
    and so does a compressed stream cut short (a partial download), whose records would otherwise read as all."""
    text, cut = _read_text(path, None)
    if cut:
        raise ConversationError(f"{path}: its compressed stream stops short (a partial download?); fetch it again")
    for place, record in _json_lines(text):
        if not isinstance(record, dict):
            what = record if isinstance(record, Exception) else f"expected a JSON object, got {type(record).__name__}"
            raise ValueError(f"{path}, {place}: {what}")
        yield place, record


def normalize(record: object, format: str | None = None) -> Conversation:
    """One record -> a conversation: an optional system message, then user/assistant turns alternating
    from a user turn. Raises ValueError saying what is wrong with a bad record.

    Leading assistant turns are dropped: ShareGPT's split conversations often start mid-dialogue with the
    assistant (6,358 of the 17,671 records of the packaged copy), and there is no prompt to condition on.
    Trailing user turns are dropped too: nothing learns from them. OpenAI-style content given as a list of text
    parts is their texts joined by newlines (as the server reads a request's, and vLLM).
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    format = format or next((f for f, key in _KEYS.items() if key in record), None)
    if format is None or _KEYS[format] not in record:
        raise ValueError(f"no {format or 'known'} conversation key in record keys {sorted(record)[:8]}")
    turns = record[_KEYS[format]]
    if not isinstance(turns, list):
        raise ValueError(f"'{_KEYS[format]}' is not a list")
    if format == "ultrachat":
        messages = [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(turns)]
    else:
        messages = []
        for number, turn in enumerate(turns, start=1):
            if not isinstance(turn, dict):
                raise ValueError(f"turn {number} is {type(turn).__name__}, not an object")
            # ShareGPT's turns say from/value; SpecForge's ShareGPT-layout files and OpenAI's messages role/content.
            keys = ("from", "value") if format == "sharegpt" and "role" not in turn else ("role", "content")
            for key in keys:
                if key not in turn:
                    raise ValueError(f"turn {number} has no '{key}' key (its keys: {sorted(turn)[:8]})")
            role = turn[keys[0]]
            if not isinstance(role, str) or role not in ROLES:
                raise ValueError(f"turn {number}: unknown role {role!r}")
            messages.append({"role": ROLES[role], "content": text_of(turn[keys[1]])})
    # An empty system prompt is none given: dropped, the other turns keeping their numbers in the record.
    dropped = int(bool(messages) and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str)
                  and not messages[0]["content"].strip())
    messages = messages[dropped:]
    for number, m in enumerate(messages, start=1 + dropped):
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise ValueError(f"turn {number}: empty or non-string {m['role']} content: {str(m['content'])[:40]!r}")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: half of a character's \u escape pair
            raise ValueError(f"turn {number}: {m['role']} content holds a lone surrogate ({e.object[e.start]!r} at "
                             f"character {e.start}), half of a broken \\u escape pair") from None

    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    while turns and turns[0]["role"] == "assistant":
        turns = turns[1:]
    while turns and turns[-1]["role"] == "user":
        turns = turns[:-1]
    if not any(m["role"] == "assistant" for m in turns):
        raise ValueError("no assistant turn after a user turn")
    for i, m in enumerate(turns):
        expected = ("user", "assistant")[i % 2]
        if m["role"] != expected:
            raise ValueError(f"roles out of order: a {m['role']} turn where a {expected} turn belongs")
    return system + turns


_KEYS = {"sharegpt": "conversations", "messages": "messages", "ultrachat": "data"}


def text_of(content: object) -> object:
    """A turn's content: a list of OpenAI text parts (`[{"type": "text", "text": ...}, ...]`) joined by newlines;
    anything else as it is, for its reader (`normalize`, eval-eagle's questions) to check."""
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return content
