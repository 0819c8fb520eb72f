"""The JSON schema of a tool, a plain Python function, from its type hints and Google-style docstring.

`tool_schema(fn)` gives the same JSON as transformers' `get_json_schema(fn)` (the schema TRL hands
the chat template as `tools`), written out here so rlcore does not import transformers at run time;
tests/test_tools.py checks the two agree. The rules, as transformers applies them:
- the docstring is required; its text before `Args:` / `Returns:` / `Raises:` is the description;
- every parameter needs a type hint and a line under `Args:` (`name: text`, or `name (type): text`);
  a line ending in `(choices: [...])` (a JSON list) gives the parameter an "enum";
- a parameter without a default is "required"; `self` / `cls` without a hint is left out;
- int, float, str, bool, None, Any, list[X], tuple[X, Y], dict[str, X], Optional / Union, Literal
  and Enum classes map to JSON types; a return hint with a `Returns:` text adds a "return" entry.
One difference: transformers maps `torch.Tensor` to "audio" and PIL images to "image"; a tool
called from the model's text receives JSON, so rlcore refuses those hints.
"""

from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

# transformers' regexes (chat_template_utils.py): the same text must split the same way
DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
ARGS_BLOCK = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
ONE_ARG = re.compile(
    r"""
(?:^|\n)  # start of the block, or a newline
([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*  # indentation and name, then an optional "(type)"
(.*?)\s*  # the description, possibly over several lines
(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)  # up to the next "name:" not indented deeper
""",
    re.DOTALL | re.VERBOSE,
)
RETURNS_BLOCK = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

JSON_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
BARE_TYPES = {int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"},
              bool: {"type": "boolean"}, type(None): {"type": "null"}, list: {"type": "array"},
              tuple: {"type": "array"}, dict: {"type": "object"}, Any: {}}


class ToolSchemaError(ValueError):
    """A tool's signature or docstring cannot be turned into a JSON schema."""


def tool_schema(fn: Callable) -> dict:
    """{"type": "function", "function": {"name", "description", "parameters"[, "return"]}} for `fn`,
    as transformers' get_json_schema builds it."""
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ToolSchemaError(f"tool {name} has no docstring; the model learns what a tool does from it: write one "
                              f"with a line per parameter under 'Args:' (Google style)")
    doc = doc.strip()
    found = DESCRIPTION.search(doc)
    description = found.group(1).strip() if found else None
    args_block = ARGS_BLOCK.search(doc)
    arg_docs = {}
    if args_block:
        lines = "\n".join(line for line in args_block.group(1).split("\n") if line.strip())
        arg_docs = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in ONE_ARG.findall(lines)}
    returns = RETURNS_BLOCK.search(doc)

    parameters = parameters_schema(fn, name)
    return_schema = parameters["properties"].pop("return", None)
    if return_schema is not None and returns:
        return_schema["description"] = returns.group(1).strip()
    for arg, schema in parameters["properties"].items():
        if arg not in arg_docs:
            raise ToolSchemaError(f"tool {name}: the docstring describes no parameter {arg!r}; add a line "
                                  f"'{arg}: what it is' under 'Args:'")
        text = arg_docs[arg]
        if choices := CHOICES.search(text):
            try:
                values = json.loads(choices.group(1))
            except json.JSONDecodeError as err:
                raise ToolSchemaError(f"tool {name}, parameter {arg!r}: (choices: {choices.group(1)}) is not a JSON "
                                      f"list ({err}); write it as (choices: [\"a\", \"b\"])") from None
            schema["enum"] = [v.strip() if isinstance(v, str) else v for v in values]
            text = text[:choices.start()].strip()
        schema["description"] = text
    function = {"name": name, "description": description, "parameters": parameters}
    if return_schema is not None:
        function["return"] = return_schema
    return {"type": "function", "function": function}


def parameters_schema(fn: Callable, name: str) -> dict:
    """{"type": "object", "properties": ..., "required": [...]} from the type hints; a "return"
    property holds the return hint when it converts (it is dropped silently when it does not)."""
    try:
        hints = get_type_hints(fn)
    except Exception as err:  # a forward reference to a name the module does not define, say
        raise ToolSchemaError(f"tool {name}: its type hints cannot be resolved ({type(err).__name__}: {err}); "
                              f"use types defined where the tool is") from None
    params = inspect.signature(fn).parameters
    first = next(iter(params), None)
    receiver = first if first in ("self", "cls") and params[first].annotation is inspect.Parameter.empty else None
    required = []
    for param in params.values():
        if param.name == receiver:
            continue
        if param.annotation is inspect.Parameter.empty:
            raise ToolSchemaError(f"tool {name}: parameter {param.name!r} has no type hint; the schema tells the "
                                  f"model its JSON type: annotate it (e.g. {param.name}: int)")
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    properties = {}
    for arg, hint in hints.items():
        if arg == receiver:
            continue
        try:
            properties[arg] = hint_schema(hint)
        except ToolSchemaError as err:
            if arg != "return":  # the model never writes the return value
                raise ToolSchemaError(f"tool {name}, parameter {arg!r}: {err}") from None
    schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def hint_schema(hint: Any) -> dict:
    """The JSON schema of one type hint."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, Enum):
        return enum_schema([member.value for member in hint], f"Enum {hint.__name__}")
    if origin is None:
        if hint in BARE_TYPES:
            return dict(BARE_TYPES[hint])
        raise ToolSchemaError(f"type hint {hint!r} has no JSON schema; use int, float, str, bool, list, tuple, "
                              f"dict, Optional, Union, Literal or an Enum of these (the model writes JSON)")
    if origin is Union or origin is types.UnionType:
        options = [hint_schema(arg) for arg in args if arg is not type(None)]
        if len(options) == 1:
            schema = options[0]
        elif all(option.keys() == {"type"} and isinstance(option["type"], str) for option in options):
            names = sorted({option["type"] for option in options})
            schema = {"type": names[0] if len(names) == 1 else names}
        else:
            schema = {"anyOf": options}
        if type(None) in args:
            schema["nullable"] = True
        return schema
    if origin is Literal and args:
        return enum_schema(list(args), "Literal")
    if origin is list:
        return {"type": "array", "items": hint_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise ToolSchemaError(f"{hint} has no fixed length of several items; use list[...]")
        return {"type": "array", "prefixItems": [hint_schema(arg) for arg in args]}
    if origin is dict:
        return {"type": "object", "additionalProperties": hint_schema(args[1])} if len(args) == 2 else {"type": "object"}
    raise ToolSchemaError(f"type hint {hint!r} has no JSON schema; use basic types, list, tuple, dict, Optional, Union, "
                          f"Literal or an Enum")


def enum_schema(values: list, what: str) -> dict:
    """{"type": ..., "enum": values}: the JSON types of the values, in order of first appearance."""
    if not values or any(type(value) not in JSON_SCALARS for value in values):
        raise ToolSchemaError(f"{what} must list at least one value, each an int, float, str, bool or None "
                              f"(JSON scalars), got {values!r}")
    names = list(dict.fromkeys(JSON_SCALARS[type(value)] for value in values))
    return {"type": names[0] if len(names) == 1 else names, "enum": values}
