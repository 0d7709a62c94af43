"""ChatML files -> validated conversations: what lockstep.data.chatml tokenizes.

data.path is a .jsonl file (one conversation per line), a .json file (one conversation, or an array of
them), a folder or a glob of such files. Each conversation is {"messages": [{"role", "content", ...}]}
with roles system / user / assistant / tool; a refusal names the file, the line and the fix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.data.files import list_data_files
from lockstep.errors import DataError

VALID_ROLES = ("system", "user", "assistant", "tool")
# names other chat formats (ShareGPT, Gemini) use for the same roles: suggested in the error
_ROLE_ALIASES = {
    "human": "user",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "function": "tool",
    "ipython": "tool",
}
_WS = re.compile(r"\s*")
_EXAMPLE = (
    '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
)


@dataclass
class Conversation:
    # {"role", "content", ...}; extra keys (tool_calls, name) reach the template
    messages: list[dict[str, Any]]
    source: str  # "file:line" where the conversation starts, for error messages


def load_conversations(path: str, max_files: int | None = None) -> list[Conversation]:
    """Every conversation in a .json / .jsonl file, a folder or a glob of them, validated, in file order."""
    conversations: list[Conversation] = []
    for file in list_data_files(path, (".json", ".jsonl"), max_files, what="ChatML"):
        text = file.read_text(encoding="utf-8-sig")  # -sig: editors on Windows write a BOM
        items = (
            _jsonl_items(text, file) if file.suffix.lower() == ".jsonl" else _json_items(text, file)
        )
        conversations.extend(_conversation(obj, f"{file}:{line}") for line, obj in items)
    if not conversations:
        raise DataError(
            f"data.path {path!r} holds no conversations (its files are empty); "
            f"add .json/.jsonl files with one {_EXAMPLE} per conversation"
        )
    return conversations


def _jsonl_items(text: str, file: Path) -> list[tuple[int, Any]]:
    items = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(
                f"{file}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); each line of a .jsonl "
                f"file must be one object like {_EXAMPLE}: fix or delete line {lineno}"
            ) from None
    return items


def _json_items(text: str, file: Path) -> list[tuple[int, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{file}:{e.lineno}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); a .json "
            "file must hold a list of conversations or one conversation object: fix the file"
        ) from None
    first_line = text.count("\n", 0, _WS.match(text).end()) + 1
    if isinstance(data, dict):
        return [(first_line, data)]
    if not isinstance(data, list):
        raise DataError(
            f"{file}: holds a JSON {type(data).__name__}; a .json file must hold a list of "
            f"conversations like [{_EXAMPLE}, ...] or one such object"
        )
    return list(zip(_array_item_lines(text), data))


def _array_item_lines(text: str) -> list[int]:
    """The line on which each element of a (valid) top-level JSON array starts: json.loads keeps no positions."""
    decoder = json.JSONDecoder()
    lines, line, counted = [], 1, 0
    i = _WS.match(text).end() + 1  # past the "["
    while True:
        i = _WS.match(text, i).end()
        if text[i] == "]":
            return lines
        line += text.count("\n", counted, i)
        counted = i
        lines.append(line)
        _, i = decoder.raw_decode(text, i)
        i = _WS.match(text, i).end()
        i += text[i] == ","


def _conversation(obj: Any, source: str) -> Conversation:
    if isinstance(obj, dict):
        if "messages" not in obj:
            hint = (
                " (this looks like a single message: wrap each conversation's messages in that key)"
                if "role" in obj
                else ""
            )
            raise DataError(
                f"{source}: object has no 'messages' key (keys: {', '.join(map(str, obj)) or 'none'}); "
                f"each conversation must look like {_EXAMPLE}{hint}"
            )
        messages = obj["messages"]
    else:
        messages = obj  # a bare list of messages is a conversation too
    if not isinstance(messages, list):
        raise DataError(
            f"{source}: 'messages' is a {type(messages).__name__}; it must be a list of "
            '{"role": ..., "content": ...} objects'
        )
    if not messages:
        raise DataError(f"{source}: conversation has no messages; add its messages or delete it")
    for j, msg in enumerate(messages):
        _check_message(msg, f"{source} message {j}")
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
        raise DataError(
            f"{source}: conversation has no assistant message (roles: {roles}), so nothing in it is "
            "trained (only assistant tokens carry labels); add the assistant reply or delete it"
        )
    return Conversation(messages, source)


def _check_message(msg: Any, where: str) -> None:
    if not isinstance(msg, dict):
        raise DataError(
            f'{where} is a {type(msg).__name__}; a message must be an object {{"role": ..., '
            '"content": ...}'
        )
    role = msg.get("role")
    if role not in VALID_ROLES:
        if "from" in msg and "value" in msg:
            fix = 'this looks like ShareGPT ("from"/"value"): convert each message to "role"/"content"'
        elif role in _ROLE_ALIASES:
            fix = f"rename it to {_ROLE_ALIASES[role]!r}"
        else:
            fix = "use one of those"
        raise DataError(
            f"{where}: unknown role {role!r}; valid roles: {', '.join(VALID_ROLES)}; {fix}"
        )
    content = msg.get("content")
    if content is None and msg.get("tool_calls"):
        return  # an assistant turn that only calls tools: the template renders tool_calls
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str) for p in content
    ):
        bad = next(
            (p for p in content if p["type"] == "text" and not isinstance(p.get("text"), str)), None
        )
        if bad is None:
            return
        raise DataError(
            f'{where} ({role}): text part {bad!r} has no string "text"; write {{"type": "text", '
            '"text": "..."}'
        )
    shown = repr(content) if len(repr(content)) < 80 else repr(content)[:77] + "..."
    raise DataError(
        f'{where} ({role}): content {shown} is neither a string nor a list of parts with a "type", '
        'like [{"type": "text", "text": "..."}] (other part types, e.g. {"type": "audio", ...}, '
        "are passed to the chat template as they are); fix that message"
    )
