"""What each config key means, read from the one-line comment beside its field in lockstep/config/__init__.py.

The dataclass fields are documented once, where they are declared; `--help` and other listings read that text
here instead of keeping a second copy that drifts. A comment on the lines right above a field (when the field's
own line has none) counts too.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import io
import tokenize
from pathlib import Path

import lockstep.config.schema as config_module


@functools.cache
def field_comments() -> dict[str, str]:
    """`section.field` -> its comment, for every field of every section of Config."""
    source = Path(config_module.__file__).read_text()
    comments: dict[int, str] = {}  # line -> comment; negative line: a line holding only a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = tok.line.strip().startswith("#")
            comments[-tok.start[0] if alone else tok.start[0]] = tok.string.lstrip("#").strip()
    section_of = {
        f.type if isinstance(f.type, str) else f.type.__name__: f.name
        for f in dataclasses.fields(config_module.Config)
    }
    out: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and node.name in section_of):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                out[f"{section_of[node.name]}.{item.target.id}"] = _comment_for(item, comments)
    return out


def _comment_for(item: ast.AnnAssign, comments: dict[int, str]) -> str:
    if item.end_lineno in comments:
        return comments[item.end_lineno]
    above, line = [], item.lineno - 1
    while -line in comments:  # a comment block right above the field
        above.insert(0, comments[-line])
        line -= 1
    return " ".join(above)


def field_help(key: str) -> str:
    """The comment of `key` (`optim.learning_rate`), or "" when the field has none."""
    return field_comments().get(key, "")


def field_default(key: str) -> object:
    """The default value of `key` on a fresh Config."""
    section, name = key.split(".")
    return getattr(getattr(config_module.Config(), section), name)
