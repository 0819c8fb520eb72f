"""An option's value: its type check (with the error that names the key, the value and an
example), TOML literals and TOML text, and the table of every option (`rlcore options`)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from typing import Literal

from rlcore import ConfigError
from rlcore.config.options import SECTIONS, LossArgs, field_docs

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib


def accepts(hint, value_type: type) -> bool:
    """Whether a value of `value_type` can be stored in a field annotated `hint` (choices aside)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(accepts(a, value_type) for a in args)
    if origin is Literal:
        return any(type(a) is value_type for a in args)
    if origin is list:
        return value_type is list
    if origin is dict:
        return value_type is dict
    if hint is float:
        return value_type in (int, float)
    return hint is value_type


def describe(hint) -> str:
    """A field's type in words, for errors and the options table ("a float or none")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {describe(args[0]).split(' ', 1)[1]}s"
    if origin is dict:
        return "a table of names to strings, numbers or bools"
    return {int: "an int", float: "a float", str: "a string", bool: "a bool (true/false)"}[hint]


def check_type(key: str, value, hint):
    """`value` converted for a field annotated `hint` (int -> float, "none" -> None), or ConfigError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    union = origin in (typing.Union, types.UnionType)
    if union and type(None) in args and (value is None or str(value).lower() in ("none", "null")):
        return None
    base = [a for a in args if a is not type(None)] if union else [hint]
    for candidate in base:
        ok, converted = _convert(value, candidate)
        if ok:
            return converted
    for candidate in base:
        if typing.get_origin(candidate) is Literal and any(type(a) is type(value) for a in typing.get_args(candidate)):
            choices = typing.get_args(candidate)
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            if key == "train.device" and str(value).lower().startswith("gpu"):
                close = ["cuda"]  # torch's name for the GPU; difflib would suggest 'cpu'
            suggestion = f"; did you mean {close[0]!r}?" if close else ""
            if key == "loss.loss_type" and value in typing.get_args(typing.get_type_hints(LossArgs)["policy_loss"]):
                suggestion = f"; {value!r} is a policy loss: set loss.policy_loss = {value!r} (loss_type aggregates it)"
            if key == "loss.loss_type" and str(value).lower() == "gspo":
                suggestion = ("; GSPO is a sequence-level ratio, not an aggregation: set loss.importance_sampling_level = "
                        "'sequence' with loss.loss_type = 'grpo' (TRL's GSPO recipe)")
            also = ", or true / false" if bool in base else ""
            raise ConfigError(f"{key} = {value!r} is not a valid choice; valid: "
                              f"{', '.join(repr(c) for c in choices)}{also}{suggestion}")
    quoted, literal = "", toml_literal(value) if isinstance(value, str) else None
    if literal is not None and _convert(literal, hint)[0]:
        quoted = f" (in quotes, {value} is a string in TOML: write {key.split('.')[-1]} = {value})"
    elif isinstance(value, str) and accepts(hint, float) and (number := _python_float(value)) is not None:
        quoted = (f" (TOML writes a number with a digit on each side of the point: "
                  f"{key.split('.')[-1]} = {number!r})")  # .9 and 1. are Python's, not TOML's
    raise ConfigError(f"{key} = {value!r} has type {type(value).__name__}, expected "
                      f"{describe(hint)}{quoted}; e.g. {shell_set(f'{key}={_example(hint, key)}')}")


def _python_float(text: str) -> float | None:
    """`text` as Python reads a finite float (".9", "1."), or None."""
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _convert(value, hint) -> tuple[bool, object]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return any(type(a) is type(value) and a == value for a in args), value
    if origin is list:
        if not isinstance(value, list):
            return False, value
        items = [_convert(v, args[0]) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict:
        scalar = (str, int, float, bool)
        return isinstance(value, dict) and all(type(v) in scalar for v in value.values()), value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return True, float(value)
    return type(value) is hint, value


def _example(hint, key: str = "") -> str:
    """A value for a field annotated `hint`: the default of option `key` ("section.name") when it has
    one of that type (a learning rate's example is its default, not 0.5), else a placeholder."""
    section, _, name = key.partition(".")
    default = next((f.default for f in dataclasses.fields(SECTIONS[section]) if f.name == name), None) \
        if section in SECTIONS else None
    if default not in (None, dataclasses.MISSING, "") and not isinstance(default, bool) and _convert(default, hint)[0]:
        return toml_value(default) if not isinstance(default, str) else default
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _example(args[0])
    if origin is Literal:
        return str(args[0])
    if origin is list:
        return "[" + _example(args[0]) + "]" if args[0] is not str else '["a","b"]'
    if origin is dict:
        return "{enable_thinking=false}"
    return {int: "1", float: "0.5", str: "text", bool: "true"}[hint]


def toml_literal(raw: str, default=None):
    """`raw` read as a TOML value (`0.04`, `true`, `["a"]`, `{k = 1}`), or `default` when it is not one."""
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return default


def shell_set(assignment: str) -> str:
    """`--set key=value` as a shell takes it: quoted when the value holds quotes, brackets or spaces."""
    return f"--set '{assignment}'" if any(c in assignment for c in "[]{}\"' ") else f"--set {assignment}"


def toml_value(value) -> str:
    """`value` written as TOML (what config.toml records and what an error's `--set` example shows)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_string(key)} = {toml_value(item)}" for key, item in value.items()) + "}"
    return "[" + ", ".join(toml_value(item) for item in value) + "]"


def _toml_string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return '"' + "".join(escapes.get(c, c if c.isprintable() else f"\\u{ord(c):04x}") for c in text) + '"'


def options_table() -> str:
    """A Markdown table of every option: key, type, default, description (`rlcore options`, docs)."""
    rows = ["| option | type | default | description |", "|---|---|---|---|"]
    for section, cls in SECTIONS.items():
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            type_text = describe(hints[f.name]).replace("|", "\\|")
            rows.append(f"| `{section}.{f.name}` | {type_text} | `{default!r}` | {docs.get(f.name, '')} |")
    return "\n".join(rows)
