"""lockstep/data/chat_files.py: ChatML files of each shape (.jsonl, .json object or array, folder, glob) read
into conversations with their file:line, and every malformed one refused with the file, the line and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep.data.chat_files import load_conversations
from lockstep.errors import DataError

from .chats import MULTI, PARTS, SINGLE, TOOL  # the conversations the tokenizer tests read too


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_load_jsonl_json_folder_and_glob(tmp_path):
    d = tmp_path / "chats"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"messages": SINGLE}, "", "   ", {"messages": PARTS, "id": 7}])
    (d / "b.json").write_text(
        "[\n  " + json.dumps({"messages": MULTI}) + ",\n\n  " + json.dumps(TOOL) + "\n]\n"
    )
    (d / "c.json").write_text("\n" + json.dumps({"messages": SINGLE}, indent=2))
    (d / "notes.txt").write_text("not chat data")

    got = load_conversations(str(d))
    assert [c.source for c in got] == [
        f"{d / 'a.jsonl'}:1",
        f"{d / 'a.jsonl'}:4",
        f"{d / 'b.json'}:2",
        f"{d / 'b.json'}:4",
        f"{d / 'c.json'}:2",
    ]
    assert [c.messages for c in got] == [SINGLE, PARTS, MULTI, TOOL, SINGLE]
    assert [c.source for c in load_conversations(str(d / "*.json"))] == [
        f"{d / 'b.json'}:2",
        f"{d / 'b.json'}:4",
        f"{d / 'c.json'}:2",
    ]
    assert len(load_conversations(str(d), max_files=1)) == 2
    assert len(load_conversations(str(d / "a.jsonl"))) == 2


def bad(tmp_path: Path, lines: list, name: str = "bad.jsonl") -> str:
    """The DataError message for a file of `lines` (a JSON line or a Python object per line)."""
    write_jsonl(tmp_path / name, lines)
    with pytest.raises(DataError) as e:
        load_conversations(str(tmp_path / name))
    return str(e.value)


def test_bad_json_line_names_file_and_line(tmp_path):
    msg = bad(tmp_path, [{"messages": SINGLE}, "", '{"messages": [oops]}'])
    assert (
        f"{tmp_path / 'bad.jsonl'}:3: not valid JSON" in msg
        and "column 15" in msg
        and "line 3" in msg
    )


def test_bad_json_file_names_file_and_line(tmp_path):
    (tmp_path / "bad.json").write_text('[\n  {"messages": []},\n  {"messages": [}\n]')
    with pytest.raises(DataError, match=r"bad\.json:3: not valid JSON \(.* at line 3, column 17\)"):
        load_conversations(str(tmp_path / "bad.json"))
    (tmp_path / "bad.json").write_text('"just a string"')
    with pytest.raises(
        DataError, match=r"bad\.json: holds a JSON str; a \.json file must hold a list"
    ):
        load_conversations(str(tmp_path / "bad.json"))


def test_object_without_messages(tmp_path):
    msg = bad(tmp_path, [{"messages": SINGLE}, {"conversation": SINGLE}])
    assert "bad.jsonl:2: object has no 'messages' key (keys: conversation)" in msg
    msg = bad(tmp_path, [{"role": "user", "content": "hi"}])
    assert "bad.jsonl:1:" in msg and "looks like a single message" in msg
    assert "bad.jsonl:1: 'messages' is a str" in bad(tmp_path, [{"messages": "hi"}])


def test_unknown_role_names_role_and_valid_roles(tmp_path):
    msg = bad(
        tmp_path,
        [{"messages": SINGLE}, {"messages": [{"role": "human", "content": "hi"}, *SINGLE[2:]]}],
    )
    assert "bad.jsonl:2 message 0: unknown role 'human'" in msg
    assert "valid roles: system, user, assistant, tool" in msg and "rename it to 'user'" in msg
    msg = bad(tmp_path, [{"messages": [{"from": "gpt", "value": "hi"}]}])
    assert "unknown role None" in msg and "ShareGPT" in msg


def test_empty_conversation(tmp_path):
    assert "bad.jsonl:2: conversation has no messages" in bad(
        tmp_path, [{"messages": SINGLE}, {"messages": []}]
    )


@pytest.mark.parametrize(
    "content, what",
    [
        (42, "content 42 is neither a string nor a list of parts"),
        ([{"text": "no type"}], 'is neither a string nor a list of parts with a "type"'),
        (["plain string part"], "is neither a string nor a list of parts"),
        ([{"type": "text"}], 'has no string "text"'),
    ],
)
def test_bad_content(tmp_path, content, what):
    msg = bad(tmp_path, [{"messages": [SINGLE[1], {"role": "assistant", "content": content}]}])
    assert "bad.jsonl:1 message 1 (assistant)" in msg and what in msg


def test_tool_call_without_content_is_allowed(tmp_path):
    call = {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
    }
    write_jsonl(tmp_path / "ok.jsonl", [{"messages": [SINGLE[1], call, *TOOL[1:]]}])
    assert load_conversations(str(tmp_path / "ok.jsonl"))[0].messages[1] == call


def test_no_assistant_turn(tmp_path):
    msg = bad(tmp_path, [{"messages": SINGLE[:2]}])
    assert "bad.jsonl:1: conversation has no assistant message (roles: system, user)" in msg
    assert "nothing in it is trained" in msg


def test_message_not_an_object_and_empty_file(tmp_path):
    assert "bad.jsonl:1 message 0 is a str" in bad(tmp_path, [{"messages": ["hello"]}])
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="holds no conversations"):
        load_conversations(str(tmp_path / "empty.jsonl"))
