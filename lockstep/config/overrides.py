"""Dotted-key overrides onto the config dataclasses: `train.batch_size=64` from a YAML file, a flag or `--set`.

Works on any tree of dataclasses (a Config), so the config module's sections stay a list of fields:
values are coerced to each field's annotated type, and an unknown key names the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

from lockstep.errors import ConfigError


def flatten(tree: dict[str, Any], source: str, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, source, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def all_keys(cfg: Any) -> list[str]:
    """`section.field` for every field of every section of a Config."""
    return [
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(cfg)
        for f in dataclasses.fields(getattr(cfg, s.name))
    ]


class Overrides(dict):
    """Dotted key -> value (as typed), and `labels`: what the user typed for each (`--global-batch-size 64`).

    A dict, so code that only needs the values reads it as one; load_config records the labels in cfg.sources.
    """

    def __init__(
        self, values: dict[str, Any] | None = None, labels: dict[str, str] | None = None
    ) -> None:
        super().__init__(values or {})
        self.labels: dict[str, str] = dict(labels or {})


def parse_sets(items: list[str]) -> Overrides:
    """`--set KEY=VALUE` items as overrides (values still text: apply_overrides coerces them), each labelled as typed."""
    out = Overrides()
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} is not KEY=VALUE; e.g. --set train.batch_size=64")
        out[key.strip()] = value
        out.labels[key.strip()] = f"--set {item}"
    return out


def apply_overrides(
    cfg: Any, overrides: dict[str, Any], source: str, labels: dict[str, str] | None = None
) -> None:
    """Set dotted keys (`train.batch_size`) on cfg, coercing strings to the field's type.

    Records each key in cfg.set_keys and where its value came from in cfg.sources: labels[key] when given
    (the flag as typed), else `source` (the YAML file's path, "command line").
    """
    keys = all_keys(cfg)
    labels = labels if labels is not None else getattr(overrides, "labels", {})
    for key, raw in overrides.items():
        if key not in keys:
            hint = _unknown_key_hint(key, keys)
            raise ConfigError(f"unknown config key {key!r} (from {source}){hint}")
        section, name = key.split(".")
        sub = getattr(cfg, section)
        ftype = typing.get_type_hints(type(sub))[name]
        setattr(sub, name, _coerce(raw, ftype, key, source))
        cfg.set_keys.add(key)  # a Config's record of what the user set (not a field)
        cfg.sources[key] = labels.get(key, source)


# what lockstep supports of quantized bases: the one line every 4-bit or 8-bit name gets
QLORA_SUPPORT = (
    "lockstep's one quantized base is model.load_in_4bit (QLoRA: LoRA adapters on a frozen NF4 "
    "base with double quantization, by bitsandbytes; built, runs on CUDA only, its tests run in "
    "the GPU tier): pass --load-in-4bit with --use-lora"
)
# field names of other libraries' quantization settings (transformers' BitsAndBytesConfig, TRL)
QUANTIZATION_NAMES = (
    "quantization",
    "quantization_config",
    "load_in_8bit",
    "load_in_4bit",
    "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant",
    "use_bnb_nested_quant",
    "bnb_4bit_compute_dtype",
    "bnb_4bit_quant_storage",
    "llm_int8_threshold",
)


def _unknown_key_hint(key: str, keys: list[str]) -> str:
    """What to say after "unknown config key": lockstep's quantization, the same field in another
    section, or a close spelling; never a key that merely looks alike but means something else."""
    field = key.split(".")[-1]
    if field in QUANTIZATION_NAMES or field.startswith(("bnb_", "llm_int8")):
        return f": {QLORA_SUPPORT}"
    same_field = [k for k in keys if k.split(".")[1] == field]
    if same_field:  # `model.batch_size` -> `train.batch_size`: same name, same meaning
        return f"; did you mean {same_field[0]!r}?"
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(keys)}"


def _coerce(raw: Any, ftype: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(ftype)
    args = typing.get_args(ftype)
    if origin in (typing.Union, types.UnionType):
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        # int | Literal["auto"]: the word first
        words = [a for a in inner if typing.get_origin(a) is Literal]
        if words and isinstance(raw, str) and any(raw in typing.get_args(w) for w in words):
            return raw
        plain = [a for a in inner if typing.get_origin(a) is not Literal] or inner
        try:
            return _coerce(raw, plain[0], key, source)
        except ConfigError:
            if not words:
                raise
            named = ", ".join(repr(v) for w in words for v in typing.get_args(w))
            raise ConfigError(
                f"{key} = {raw!r} (from {source}) is neither an integer nor {named}; "
                f"give a number or {named}"
            ) from None
    if origin is Literal:
        if isinstance(raw, str) and raw in args:
            return raw
        if isinstance(raw, bool) and "no" in args and not raw:  # YAML reads `no` as False
            return "no"
        if isinstance(raw, bool) and str(raw).lower() in args:  # YAML reads `true` as True
            return str(raw).lower()
        raise ConfigError(
            f"{key} = {raw!r} (from {source}) is not one of {', '.join(map(repr, args))}; pick one of those"
        )
    want = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[ftype]
    if ftype is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in (
            "true",
            "1",
            "yes",
            "on",
            "false",
            "0",
            "no",
            "off",
        ):
            return raw.lower() in ("true", "1", "yes", "on")
    elif ftype is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw.replace("_", ""))
            except ValueError:
                pass
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
    elif ftype is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
    elif ftype is str:
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            return str(raw)
    raise ConfigError(f"{key} = {raw!r} (from {source}) must be {want}; got {type(raw).__name__}")
