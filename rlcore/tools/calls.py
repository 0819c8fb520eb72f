"""Tool calls in the model's text, in the format its chat template renders them.

Two formats, those of the supported families' templates:
- "qwen" (Qwen2.5, Qwen3): one or more `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`;
- "llama3" (Llama 3.1, 3.2): a bare JSON object `{"name": ..., "parameters": {...}}`.
`tool_call_format` finds a template's format by rendering a tool call with it. `parse_tool_calls`
reads the calls out of a turn's text, decoded with skip_special_tokens=True (Llama's `<|eot_id|>`
and `<|python_tag|>` are special, Qwen's `<tool_call>` is not). A call that cannot be read
(invalid JSON, no name, arguments that are not an object, a `<tool_call>` never closed) is kept
with its `error`, so the model gets that error back as the call's result and the call counts as
a failure. Where TRL differs: a text that is no call at all (invalid JSON, no name, unclosed)
makes TRL read the whole turn as plain text (no call, the turn's valid calls dropped too), which
ends the conversation there; a call whose arguments are not an object TRL runs, and it fails.

String arguments are typed by the tool's schema as transformers' response parser does with
`tools=` (TRL passes them): "7" becomes 7 for an integer parameter and stays "7" for a string one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

FORMATS = ("qwen", "llama3")
QWEN_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
LLAMA_CALL_START = re.compile(r'\{\s*"name"\s*:')
NAME, KEY, VALUE, CONTENT = "tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2"


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and its arguments, or why it could not be read."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    """what is wrong with the call's text (None for a call that reads)"""


def tool_call_format(tokenizer, chat_template: str | None = None) -> str:
    """"qwen" or "llama3": how `tokenizer`'s chat template (or `chat_template`) writes a tool call.
    A template that drops the call or the tool's result (Llama 3 Instruct's, which reads only
    `content`) is an error, as is a format other than these two."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": NAME, "arguments": {KEY: VALUE}}}]},
                {"role": "tool", "name": NAME, "content": CONTENT}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, chat_template=chat_template)
    lost = [what for what, sentinel in (("the call's name", NAME), ("its arguments", VALUE),
                                        ("the tool's result", CONTENT)) if sentinel not in text]
    if lost:
        raise ValueError(f"the chat template does not render tool calls: it drops {' and '.join(lost)} when it "
                         f"renders a user -> assistant (tool_calls) -> tool conversation; use the model family's "
                         f"instruct template with tool support (Qwen2.5 / Qwen3, Llama 3.1 / 3.2)")
    if f"<tool_call>\n{{\"name\": \"{NAME}\", \"arguments\": " in text:
        return "qwen"
    if f'{{"name": "{NAME}", "parameters": ' in text:
        return "llama3"
    start = text.index(NAME)
    raise ValueError(f"the chat template writes tool calls as {text[max(start - 40, 0):start + 80]!r}, which rlcore "
                     f"cannot parse; it reads Qwen's <tool_call> JSON and Llama 3.1's {{\"name\", \"parameters\"}} JSON")


def parse_tool_calls(text: str, format: str, schemas: list[dict] | None = None) -> list[ToolCall]:
    """The calls in one assistant turn's `text`, in order ([] for a turn without any). `schemas`
    (tool_schema's, of the tools offered) type string arguments as transformers does."""
    if format == "qwen":
        calls = [qwen_call(body, closed) for body, closed in QWEN_CALL.findall(text)]
    elif format == "llama3":
        calls = llama_calls(text)
    else:
        raise ValueError(f"unknown tool call format {format!r}; expected one of {FORMATS}")
    properties = {schema["function"]["name"]: schema["function"]["parameters"].get("properties", {})
                  for schema in schemas or []}
    for call in calls:
        if call.error is None and call.name in properties:
            call.arguments = typed_arguments(call.arguments, properties[call.name])
    return calls


def assistant_message(text: str, format: str, calls: list[ToolCall]) -> dict:
    """One assistant turn as TRL's parse_response gives it to reward functions: the text outside
    the calls as `content` (Qwen's, stripped; Llama's turn is a call or text, not both) and the
    calls that read as `tool_calls`."""
    content = (QWEN_CALL.sub("", text).strip() if format == "qwen" else "") if calls else text
    message = {"role": "assistant", "content": content}
    if readable := [call for call in calls if call.error is None]:
        message["tool_calls"] = [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in readable]
    return message


def qwen_call(body: str, closed: str) -> ToolCall:
    """The call in one `<tool_call>` block: JSON {"name": ..., "arguments": {...}}."""
    if not closed:
        return ToolCall("unknown", error=f"<tool_call> is never closed by </tool_call>: {short(body)}")
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("unknown", error=f"the tool call is not valid JSON ({err}): {short(body)}")
    return call_from_json(value, "arguments", body)


def llama_calls(text: str) -> list[ToolCall]:
    """Every JSON object {"name": ..., "parameters": {...}} in `text`."""
    calls, position = [], 0
    decoder = json.JSONDecoder()
    while found := LLAMA_CALL_START.search(text, position):
        try:
            value, position = decoder.raw_decode(text, found.start())
        except json.JSONDecodeError as err:
            calls.append(ToolCall("unknown", error=f"the tool call is not valid JSON ({err}): "
                                                   f"{short(text[found.start():])}"))
            break  # the rest of the turn is that broken call: a "name" inside it is no call of its own
        calls.append(call_from_json(value, "parameters", text[found.start():position]))
    return calls


def call_from_json(value, arguments_key: str, source: str) -> ToolCall:
    """A ToolCall from the decoded JSON of a call, its arguments under `arguments_key`; a missing
    or null one is {} (no arguments), as in TRL."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall("unknown", error=f'a tool call must be a JSON object with a string "name": {short(source)}')
    arguments = value.get(arguments_key)
    if arguments is None:
        other = next((key for key in ("arguments", "parameters") if key != arguments_key and key in value), None)
        if other is not None:
            return ToolCall(value["name"], error=f'the tool call gives "{other}"; write the arguments as '
                                                 f'"{arguments_key}": {{...}}')
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], error=f'"{arguments_key}" must be a JSON object of argument names and '
                                             f'values, got {short(json.dumps(arguments))}')
    return ToolCall(value["name"], arguments)


def typed_arguments(arguments: dict, properties: dict) -> dict:
    """`arguments` with each string value cast to its parameter's schema type (transformers'
    response parser, with `tools=`); values that do not cast stay as they are."""
    typed = dict(arguments)
    for key, value in arguments.items():
        types = schema_types(properties.get(key))
        if not types:
            continue
        if isinstance(value, str):
            typed[key] = typed_value(value, types)
        elif isinstance(value, list) and "array" not in types:
            typed[key] = [typed_value(item, types) if isinstance(item, str) else item for item in value]
    return typed


def schema_types(schema) -> list[str]:
    """The JSON types a parameter's schema allows, unions and "nullable" included."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or [] if isinstance(t, str)]
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or []:
            types += schema_types(choice)
    if schema.get("nullable") and "null" not in types:
        types.append("null")
    return types


def typed_value(raw: str, types: list[str]):
    """`raw` as the first of `types` it reads as; else `raw` itself."""
    for name in types:
        try:
            if name == "integer":
                try:
                    return int(raw)
                except ValueError:  # a whole number written as a float, "3.0", is an integer too
                    if float(raw).is_integer():
                        return int(float(raw))
            elif name == "number":
                number = float(raw)
                if number == number and abs(number) != float("inf"):  # NaN and inf are not JSON numbers
                    return int(number) if number.is_integer() and "." not in raw else number
            elif name == "boolean" and raw.strip().lower() in ("true", "1", "false", "0"):
                return raw.strip().lower() in ("true", "1")
            elif name == "null" and raw.strip() in ("null", "None"):
                return None
            elif name in ("object", "array"):
                decoded = json.loads(raw)
                if isinstance(decoded, dict if name == "object" else list):
                    return decoded
        except (ValueError, OverflowError):
            continue
    return raw


def short(text: str, limit: int = 200) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."
