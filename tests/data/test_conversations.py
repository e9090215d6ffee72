"""Conversation readers: every format normalizes alike; bad records are skipped and reported, or raise."""

import bz2
import gzip
import json
import lzma
import re

import pytest

from eyas.common.assets import asset_path
from eyas.data.conversations import ConversationError, ReadReport, read_conversations, read_json_lines

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
SHAREGPT_NAMES = {"system": "system", "user": "human", "assistant": "gpt"}


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def read(path, **kwargs):
    report = ReadReport()
    return list(read_conversations(path, report=report, **kwargs)), report


def test_formats_normalize_alike(tmp_path):
    turns = [{"from": SHAREGPT_NAMES[m["role"]], "value": m["content"]} for m in CHAT]
    sharegpt = [{"id": "a", "conversations": turns}]
    files = {
        "sharegpt.json": json.dumps(sharegpt, indent=2),
        "messages.jsonl": json.dumps({"messages": CHAT}) + "\n",
        "ultrachat_200k.jsonl": json.dumps({"prompt": "Hi", "prompt_id": "x", "messages": CHAT[1:]}) + "\n",
        "ultrachat.jsonl": json.dumps({"id": "0", "data": [m["content"] for m in CHAT[1:]]}) + "\n",
    }
    for name, text in files.items():
        convs, report = read(write(tmp_path / name, text))
        assert convs == [CHAT if "ultrachat" not in name else CHAT[1:]], name
        assert (report.records, report.conversations, report.skipped, report.truncated) == (1, 1, [], False)
    # Forcing the wrong layout makes every record bad.
    _, report = read(tmp_path / "messages.jsonl", format="ultrachat")
    assert report.conversations == 0 and len(report.skipped) == 1


def test_leading_assistant_and_trailing_user_turns_are_dropped(tmp_path):
    turns = [{"from": "gpt", "value": "...rest of an answer"}] + [
        {"from": SHAREGPT_NAMES[m["role"]], "value": m["content"]} for m in CHAT[1:]
    ] + [{"from": "human", "value": "thanks"}, {"from": "human", "value": "bye"}]
    convs, _ = read(write(tmp_path / "a.json", json.dumps([{"conversations": turns}])))
    assert convs == [CHAT[1:]]



def test_an_empty_system_prompt_is_no_system_prompt(tmp_path):
    for empty in ("", "  \n"):
        turns = [{"from": "system", "value": empty}] + [
            {"from": SHAREGPT_NAMES[m["role"]], "value": m["content"]} for m in CHAT[1:]]
        convs, report = read(write(tmp_path / "a.json", json.dumps([{"conversations": turns}])))
        assert convs == [CHAT[1:]] and not report.skipped
    # An empty turn elsewhere still spoils its record.
    convs, report = read(write(tmp_path / "b.jsonl", json.dumps({"messages": [*CHAT[1:3], {**CHAT[3], "content": ""},
                                                                              CHAT[4]]}) + "\n"))
    assert convs == [] and "turn 3: empty" in report.skipped[0][1]
    # Turns keep their numbers in the record when an empty system prompt before them is dropped.
    _, report = read(write(tmp_path / "c.jsonl", json.dumps({"messages": [{"role": "system", "content": ""}, CHAT[1],
                                                                          {**CHAT[2], "content": ""}]}) + "\n"))
    assert "turn 3: empty" in report.skipped[0][1]


def test_openai_text_parts_and_the_developer_role(tmp_path):
    """OpenAI chat JSONL may give content as a list of text parts and the system prompt as a developer message."""
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
             CHAT[2]]
    convs, report = read(write(tmp_path / "parts.jsonl", json.dumps({"messages": parts}) + "\n"))
    assert convs == [[CHAT[0], {"role": "user", "content": "Hi\nthere"}, CHAT[2]]] and not report.skipped
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, CHAT[2]]
    _, report = read(write(tmp_path / "image.jsonl", json.dumps({"messages": image}) + "\n"))
    assert "turn 1: empty or non-string user content" in report.skipped[0][1]


def test_a_lone_surrogate_is_a_bad_record(tmp_path):
    """Half of a \\u escape pair (a cut emoji) parses as JSON but cannot be written as UTF-8 (the dataset's Arrow
    files failed on it, naming no record): its record is skipped and named."""
    broken = {"messages": [CHAT[1], {**CHAT[2], "content": "ok \ud83d"}]}
    text = json.dumps({"messages": CHAT}) + "\n" + json.dumps(broken) + "\n"
    convs, report = read(write(tmp_path / "cut_emoji.jsonl", text))
    assert convs == [CHAT] and report.skipped[0][0] == "line 2"
    assert "turn 2: assistant content holds a lone surrogate ('\\ud83d' at character 3)" in report.skipped[0][1]

BAD_LINES = [
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}, "empty"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 3}]}, "non-string"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant"),
    ({"messages": CHAT[1:3] + CHAT[2:3]}, "out of order"),
]


def test_bad_records_are_skipped_and_reported(tmp_path):
    lines = [json.dumps({"messages": CHAT})] + [json.dumps(r) for r, _ in BAD_LINES] + ["{not json", ""]
    lines.append(json.dumps({"messages": CHAT}))
    path = write(tmp_path / "mixed.jsonl", "\n".join(lines) + "\n")
    convs, report = read(path)
    assert convs == [CHAT, CHAT]
    reasons = [reason for _, reason in BAD_LINES] + ["malformed JSON"]
    assert [place for place, _ in report.skipped] == [f"line {n}" for n in range(2, 8)]
    assert all(want in got for want, (_, got) in zip(reasons, report.skipped, strict=True))
    assert "mixed.jsonl" in report.summary() and "skipped 6" in report.summary()

    with pytest.raises(ConversationError, match=r"mixed\.jsonl: line 2: turn 1: unknown role"):
        read(path, strict=True)


def test_bad_record_in_json_array_names_its_number_from_1(tmp_path):
    records = [{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}] * 2
    records.insert(1, {"conversations": [{"from": "human", "value": "x"}, {"from": "alien", "value": "y"}]})
    path = write(tmp_path / "a.json", json.dumps(records))
    convs, report = read(path)
    assert len(convs) == 2 and report.skipped[0][0] == "record 2"
    with pytest.raises(ConversationError, match=r"a\.json: record 2: turn 2: unknown role 'alien'"):
        read(path, strict=True)
    _, report = read(write(tmp_path / "b.json", json.dumps([None, records[0]])))
    assert report.skipped[0][0] == "record 1"


def test_truncated_json_array(tmp_path):
    record = {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}
    text = json.dumps([record] * 3)
    convs, report = read(write(tmp_path / "cut.json", text[: text.rindex("gpt")]))
    assert len(convs) == 2 and report.truncated and "file ended mid-record" in report.summary()
    with pytest.raises(ConversationError, match="record 3: file ended mid-record"):
        read(tmp_path / "cut.json", strict=True)


def test_jsonl_cut_by_max_bytes(tmp_path):
    """A JSONL read cut inside a line ends with the complete lines, as a cut JSON array does; cut at a line's end,
    it is not truncated at all."""
    text = "".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(3))
    path = write(tmp_path / "chats.jsonl", text)
    convs, report = read(path, max_bytes=len(text) - 5)
    assert len(convs) == 2 and report.truncated and not report.skipped
    with pytest.raises(ConversationError, match="line 3: file ended mid-record"):
        read(path, max_bytes=len(text) - 5, strict=True)
    convs, report = read(path, max_bytes=text.index("\n") + 1)
    assert len(convs) == 1 and not report.truncated and not report.skipped


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)])
def test_compressed_files_read_as_their_text(tmp_path, suffix, compress):
    """A compressed file reads as its text does (conversations and JSON lines alike); one cut short (a partial
    download) keeps its complete conversations and reads as truncated, and as JSON lines raises; one that is not
    what its suffix says raises, naming the file. Past a bz2 block of 900 kB, so that a cut stream still holds a
    whole block."""
    n = 12000
    text = "".join(json.dumps({"messages": CHAT[:2] + [{"role": "assistant", "content": f"#{i}"}]}) + "\n"
                   for i in range(n))
    plain, _ = read(write(tmp_path / "chats.jsonl", text))
    packed = compress(text.encode())
    (tmp_path / f"chats.jsonl{suffix}").write_bytes(packed)
    convs, report = read(tmp_path / f"chats.jsonl{suffix}")
    assert convs == plain and len(convs) == n and not report.truncated
    assert [row for _, row in read_json_lines(tmp_path / f"chats.jsonl{suffix}")] == [json.loads(line) for line in
                                                                                      text.splitlines()]
    convs, report = read(tmp_path / f"chats.jsonl{suffix}", max_bytes=len(text) - 5)
    assert convs == plain[:-1] and report.truncated
    (tmp_path / f"cut.jsonl{suffix}").write_bytes(packed[: len(packed) * 4 // 5])
    convs, report = read(tmp_path / f"cut.jsonl{suffix}")
    assert 0 < len(convs) < n and convs == plain[: len(convs)] and report.truncated and not report.skipped
    with pytest.raises(ConversationError, match=rf"cut\.jsonl\{suffix}: its compressed stream stops short"):
        list(read_json_lines(tmp_path / f"cut.jsonl{suffix}"))  # a benchmark's questions are all read, or none
    with pytest.raises(ConversationError, match=rf"junk\.jsonl\{suffix}: not a readable \{suffix} file"):
        read(write(tmp_path / f"junk.jsonl{suffix}", text))
    with pytest.raises(FileNotFoundError):
        read(tmp_path / f"missing.jsonl{suffix}")


def test_null_records_are_bad_records_not_the_end_of_the_file(tmp_path):
    good = {"messages": CHAT}
    for name, text in {"a.json": json.dumps([good, None, good]), "a.jsonl": f"{json.dumps(good)}\nnull\n"
                       f"{json.dumps(good)}\n"}.items():
        convs, report = read(write(tmp_path / name, text))
        assert len(convs) == 2 and not report.truncated and report.records == 3, name
        place = "record 2" if name == "a.json" else "line 2"  # the same record, numbered alike
        assert report.skipped == [(place, "expected a JSON object, got NoneType")]


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 unescaped (`ensure_ascii=False` writes them so): a record
    holding them is one line, and the lines after it keep their numbers."""
    odd = [{"role": "user", "content": "a\u2028b\u2029c\x85d"}, {"role": "assistant", "content": "e"}]
    lines = [json.dumps({"messages": odd}, ensure_ascii=False), "{not json", json.dumps({"messages": CHAT})]
    convs, report = read(write(tmp_path / "odd.jsonl", "\r\n".join(lines) + "\r\n"))
    assert convs == [odd, CHAT] and report.records == 3 and [p for p, _ in report.skipped] == ["line 2"]


def test_a_byte_order_mark_is_not_data(tmp_path):
    files = {"bom.json": json.dumps([{"messages": CHAT}]), "bom.jsonl": json.dumps({"messages": CHAT})}
    for name, text in files.items():
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
        convs, report = read(tmp_path / name)
        assert convs == [CHAT] and not report.skipped, name


def test_broken_json_in_a_closed_array_is_an_error_saying_the_rest_is_unread(tmp_path):
    """Not a bad record to skip: no record after it can be read (a 1,000-record file broken at record 10 trained
    on 9), strict or not."""
    good = json.dumps({"messages": CHAT})
    path = write(tmp_path / "broken.json", f'[{good}, {{"messages": ::}}, {good}]')
    for strict in (False, True):
        with pytest.raises(ConversationError, match=r"broken\.json: record 2: malformed JSON.*the records after it"):
            read(path, strict=strict)


def test_a_file_cut_after_a_bracket_inside_a_string_is_truncated(tmp_path):
    """Its last character is a ']' of the string the cut split, not the array's: the records before it are read and
    the file reads as cut, not as malformed (now an error)."""
    good = json.dumps({"messages": CHAT})
    convs, report = read(write(tmp_path / "cut.json", f'[{good}, {{"messages": [{{"role": "user", "content": "a[0]'))
    assert len(convs) == 1 and report.truncated and not report.skipped


def test_text_after_a_closed_array_is_an_error(tmp_path):
    """Two arrays concatenated (`cat part1.json part2.json`): the second's records are not silently lost."""
    records = json.dumps([{"messages": CHAT}] * 2)
    write(tmp_path / "cat.json", records + "\n" + records)
    for strict in (False, True):
        with pytest.raises(ConversationError, match=r"cat\.json: record 3: text after the array's closing"):
            read(tmp_path / "cat.json", strict=strict)
    assert len(read(write(tmp_path / "blank.json", records + "\n\n"))[0]) == 2


def test_a_file_not_in_utf8_names_its_line(tmp_path):
    latin1 = json.dumps({"messages": [{"role": "user", "content": "café"}, {"role": "assistant", "content": "oui"}]},
                        ensure_ascii=False).encode("latin-1")
    (tmp_path / "latin1.jsonl").write_bytes((json.dumps({"messages": CHAT}) + "\n").encode() + latin1)
    with pytest.raises(ConversationError, match=r"latin1\.jsonl: line 2 \(byte \d+\): not UTF-8"):
        read(tmp_path / "latin1.jsonl")
    first = (json.dumps({"messages": CHAT}) + "\n").encode()
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + first + latin1)  # the byte counted in the file, BOM too
    at = 3 + len(first) + latin1.index("é".encode("latin-1"))
    with pytest.raises(ConversationError, match=rf"bom\.jsonl: line 2 \(byte {at}\): not UTF-8"):
        read(tmp_path / "bom.jsonl")


@pytest.mark.parametrize("turn, reason", [
    ({"value": "yo"}, "turn 2 has no 'from' key (its keys: ['value'])"),
    ({"from": "gpt"}, "turn 2 has no 'value' key"),
    ({"from": ["gpt"], "value": "yo"}, "turn 2: unknown role ['gpt']"),
    ({"from": "gpt", "value": None}, "turn 2: empty or non-string assistant content"),
])
def test_a_bad_turn_is_named_by_number_and_key(tmp_path, turn, reason):
    record = {"conversations": [{"from": "human", "value": "hi"}, turn]}
    with pytest.raises(ConversationError, match=re.escape(f"record 1: {reason}")):
        read(write(tmp_path / "a.json", json.dumps([record])), strict=True)


def test_sharegpt_records_of_role_content_turns_read(tmp_path):
    """SpecForge's ShareGPT-layout files hold role/content turns under `conversations`."""
    convs, report = read(write(tmp_path / "specforge.jsonl", json.dumps({"id": "a", "conversations": CHAT}) + "\n"))
    assert convs == [CHAT] and not report.skipped


def test_one_record_spread_over_lines(tmp_path):
    """A file of one pretty-printed conversation (a user's single example) is that record, not lines of bad JSON."""
    turns = [{"from": SHAREGPT_NAMES[m["role"]], "value": m["content"]} for m in CHAT]
    for name, record in {"sharegpt.json": {"conversations": turns}, "messages.json": {"messages": CHAT}}.items():
        convs, report = read(write(tmp_path / name, "\n" + json.dumps(record, indent=2) + "\n"))
        assert convs == [CHAT] and (report.records, report.skipped, report.truncated) == (1, [], False), name
    _, report = read(write(tmp_path / "bad.json", json.dumps({"messages": CHAT[1:2]}, indent=2)))
    assert [place for place, _ in report.skipped] == ["record 1"]


def test_one_record_spread_over_lines_cut_by_max_bytes(tmp_path):
    text = json.dumps({"messages": CHAT}, indent=2)
    path = write(tmp_path / "one.json", text)
    for cut_at in (2, text.index("Hello"), len(text) - 2):  # after the "{" line, inside a string, before the "}"
        convs, report = read(path, max_bytes=cut_at)
        assert convs == [] and report.truncated and report.records == 0 and not report.skipped, cut_at
    with pytest.raises(ConversationError, match="record 1: file ended mid-record"):
        read(path, max_bytes=len(text) - 2, strict=True)


def test_jsonl_with_a_bad_first_line_stays_jsonl(tmp_path):
    """Only a text that is one JSON object is read whole: a bad first line of JSONL is one bad line, cut or not."""
    good = json.dumps({"messages": CHAT})
    for first in ("{not json", '{"messages": ['):
        text = f"{first}\n{good}\n{good}\n"
        path = write(tmp_path / "a.jsonl", text)
        for max_bytes, want in ((None, (2, False)), (len(text) - 5, (1, True))):  # whole; cut inside line 3
            convs, report = read(path, max_bytes=max_bytes)
            assert (len(convs), report.truncated) == want and [p for p, _ in report.skipped] == ["line 1"], first


def test_broken_json_in_a_cut_array_is_broken_json(tmp_path):
    """A read cut inside the file is truncated only where a record stops parsing at the cut: a malformed record
    before it is reported as such."""
    good = json.dumps({"messages": CHAT})
    text = f'[{good}, {{"messages": ::}}, {good}, {good}]'
    with pytest.raises(ConversationError, match=r"record 2: malformed JSON"):
        read(write(tmp_path / "broken.json", text), max_bytes=len(text) - 20)


def test_max_bytes_drops_only_the_character_its_cut_splits(tmp_path):
    """A cut inside a multi-byte character at the read's end drops that character alone; bytes that are not UTF-8
    elsewhere are an error, as without max_bytes (they were silently dropped)."""
    line = json.dumps({"messages": [CHAT[1], {**CHAT[2], "content": "café"}]}, ensure_ascii=False) + "\n"
    data = (line * 2).encode()
    path = tmp_path / "accents.jsonl"
    path.write_bytes(data)
    convs, report = read(path, max_bytes=len(data) - len('"}]}\n') - 1)  # inside the last "é"
    assert [c[1]["content"] for c in convs] == ["café"] and report.truncated
    path.write_bytes(data.replace("é".encode(), "é".encode("latin-1"), 1))
    with pytest.raises(ConversationError, match=r"line 1 \(byte \d+\): not UTF-8"):
        read(path, max_bytes=len(data) - 5)


def test_json_array_cut_by_max_bytes_after_an_inner_bracket(tmp_path):
    """A read cut right after a record's inner `]` (its turns' list) is a cut, not broken JSON."""
    text = json.dumps([{"messages": CHAT}] * 3)
    convs, report = read(write(tmp_path / "a.json", text), max_bytes=text.index("]") + 1)
    assert convs == [] and report.truncated and not report.skipped


def test_packaged_sharegpt_is_truncated():
    convs, report = read(asset_path("sharegpt"))
    assert report.truncated and report.records == 17671  # the asset's documented count
    assert len(convs) == report.conversations > 17000
    assert all(m["role"] in ("system", "user", "assistant") and m["content"].strip() for c in convs for m in c)
