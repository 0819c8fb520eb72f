"""Tools and environments (rlcore.tools.schema, rlcore.tools.calls, rlcore.tools) against their
references: transformers' get_json_schema and apply_chat_template(tools=...) for the schemas and
the rendered prompts, and TRL 1.16's GRPOTrainer for parsing calls (parse_response with its
response templates), running them (`_tool_call_loop`: tool results, error texts, counts, the
appended ids and the tool mask) and rendering tool results (`_get_tool_suffix_ids`). TRL's methods
run on a stand-in for the trainer that holds only what they read.

The templates are tests/chat_templates' (Qwen2.5, Llama 3, Llama 3.1) and, from TRL's package,
Llama 3.2's, Qwen3's and TRL's prefix-preserving Qwen3 training template.
"""

import enum
import threading
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlcore.models.tokenizer import Tokenizer
from rlcore.tools.calls import ToolCall, parse_tool_calls, tool_call_format, typed_value
from rlcore.tools.schema import ToolSchemaError, tool_schema
from rlcore.tools.toolbox import Toolbox, environment_tools, load_environment_factory, load_tool, reset_environment, run_tool_calls, tool_messages
from rlcore.tools.turns import ToolTurns, tool_suffix_ids
from test_tokenizer import TEMPLATES, llama_checkpoint, qwen_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is the reference")
trl = pytest.importorskip("trl", reason="TRL is the reference")
from transformers.utils import get_json_schema  # noqa: E402
from trl.chat_template_utils import add_response_schema, parse_response  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"


# ---- tools used throughout ------------------------------------------------------------------

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def describe(x: int) -> dict:
    """Facts about a number.

    Args:
        x: The number.
    """
    return {"number": x, "even": x % 2 == 0, "name": "zéro" if x == 0 else None}


# ---- schemas: the same JSON as transformers' get_json_schema --------------------------------

class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


def basic(count: int, ratio: float, name: str, flag: bool):
    """Basic JSON types.

    Args:
        count: How many.
        ratio: A fraction.
        name: A name.
        flag: Yes or no.
    """


def optional_and_defaults(query: str, limit: typing.Optional[int] = None, unit: str | None = "km",
                          strict: bool = False) -> list[str]:
    """Optional values and defaults: only `query` is required.

    Args:
        query: What to look for.
        limit: At most this many (None: all).
        unit (str): The unit, with a "(type)" after the name.
        strict: Match exactly.

    Returns:
        The matches, one per line.
    """


def containers(values: list[int], grid: list[list[float]], table: dict[str, int], pair: tuple[int, str],
               anything: typing.Any, bare: list, mapping: dict) -> None:
    """Lists, nested lists, dicts, tuples and Any.

    Args:
        values: Integers.
        grid: A matrix
            of floats, described over two lines.
        table: Counts by name.
        pair: A number and a label.
        anything: Whatever you like.
        bare: A list of anything.
        mapping: An object.
    """


def unions(either: typing.Union[int, str], mixed: list[int] | str, maybe: int | str | None,
           same: list | tuple) -> None:
    """Unions of simple types, of complex ones, and with None.

    Args:
        either: A number or a word.
        mixed: Numbers or a word.
        maybe: A number, a word or nothing.
        same: Two hints that are both arrays.
    """


def choices(mode: typing.Literal["fast", "slow"], mixed: typing.Literal[1, "two", None], color: Color, level: Level,
            drink: str, size: int):
    """Literal and Enum choices, and choices written in the docstring.

    Args:
        mode: How to run.
        mixed: Values of several JSON types.
        color: A color.
        level: A level.
        drink: What to drink (choices: ["tea", " coffee "])
        size: How big (Choices: [1, 2, 3])
    """


def sections(path: str, mode: str = "r", retries: int = 3) -> bytes:
    """Read a file.

    A second paragraph of the description,
    over two lines.

    Args:
        path: Where the file is.

        mode (str, optional): How to open it: the line after
            continues the description,
              even indented deeper.
        retries: How often to try.
    Returns:
        The bytes read.

    Raises:
        OSError: When it cannot be read.
    """


def no_arguments() -> str:
    """Takes nothing and returns the time."""


async def fetch(url: str) -> str:
    """Fetch a page (an async tool).

    Args:
        url: The address.
    """
    return url


class Calculator:
    def multiply(self, x: float, y: float) -> float:
        """Multiply two numbers (a method: `self` is left out).

        Args:
            x: The first factor.
            y: The second factor.
        """
        return x * y


SCHEMA_CASES = [add, divide, describe, basic, optional_and_defaults, containers, unions, choices, sections,
                no_arguments, fetch,
                Calculator().multiply, Calculator.multiply]


@pytest.mark.parametrize("fn", SCHEMA_CASES, ids=lambda fn: fn.__qualname__)
def test_schema_equals_transformers_get_json_schema(fn):
    """The schema the chat template shows the model is the one TRL hands it (transformers')."""
    assert tool_schema(fn) == get_json_schema(fn)


def no_docstring(x: int):
    return x


def undescribed_argument(x: int, y: int):
    """Only x is described.

    Args:
        x: A number.
    """


def unannotated(x, y: int):
    """A missing type hint.

    Args:
        x: Anything.
        y: A number.
    """


def custom_class(x: Calculator):
    """A hint with no JSON type.

    Args:
        x: A calculator.
    """


def one_item_tuple(x: tuple[int]):
    """A one-item tuple.

    Args:
        x: A tuple.
    """


@pytest.mark.parametrize("fn, message", [
    (no_docstring, "has no docstring"),
    (undescribed_argument, "describes no parameter 'y'"),
    (unannotated, "parameter 'x' has no type hint"),
    (custom_class, "parameter 'x': type hint"),
    (one_item_tuple, "no fixed length"),
], ids=lambda case: getattr(case, "__name__", ""))
def test_a_function_transformers_cannot_describe_is_an_error_naming_the_problem(fn, message):
    with pytest.raises(Exception):
        get_json_schema(fn)
    with pytest.raises(ToolSchemaError, match=message):
        tool_schema(fn)


def forward_reference(x: "Undefined"):  # noqa: F821
    """A hint naming nothing.

    Args:
        x: Something.
    """


def test_a_type_hint_that_cannot_be_resolved_is_an_error_naming_the_tool():
    with pytest.raises(ToolSchemaError, match="tool forward_reference: its type hints cannot be resolved"):
        tool_schema(forward_reference)


def test_a_tensor_argument_is_refused_where_transformers_calls_it_audio():
    """The one difference from transformers: the model writes JSON, which cannot be a tensor."""
    import torch

    def listen(clip: torch.Tensor):
        """Listen.

        Args:
            clip: The audio.
        """

    assert get_json_schema(listen)["function"]["parameters"]["properties"]["clip"]["type"] == "audio"
    with pytest.raises(ToolSchemaError, match="no JSON schema"):
        tool_schema(listen)


# ---- chat templates: the schemas as `tools`, the call format --------------------------------

def checkpoint(tmp_path, template: str):
    """(rlcore's Tokenizer, transformers' tokenizer) of a tiny checkpoint with `template`:
    Llama 3's special tokens for Llama templates, Qwen2.5's for the others."""
    text = (TRL_TEMPLATES / f"{template}.jinja").read_text()
    path = (llama_checkpoint if template.startswith("llama") else qwen_checkpoint)(tmp_path / template, text)
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


TOOL_TEMPLATES = ["qwen2_5", "qwen3_training", "llama3_1", "llama3_2"]
PROMPT = [{"role": "system", "content": "You can use tools."}, {"role": "user", "content": "What is 7 + 2?"}]


@pytest.mark.parametrize("template", TOOL_TEMPLATES)
def test_schemas_as_tools_render_the_prompt_transformers_renders_for_the_functions(tmp_path, template):
    ours, ref = checkpoint(tmp_path, template)
    tools = [add, describe, Calculator().multiply]
    prompt = PROMPT[1:] if template.startswith("llama") else PROMPT  # Llama puts the tools in the first user turn
    text = ours.apply_chat_template(prompt, tools=[tool_schema(tool) for tool in tools])
    assert text == ref.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "multiply"' in text


def test_the_templates_in_tests_are_trls_byte_for_byte():
    """TRL recognises a template by its text (add_response_schema), so the references below need these."""
    for name in ("qwen2_5", "llama3_1", "llama3"):
        assert (TEMPLATES / f"{name}.jinja").read_text() == (TRL_TEMPLATES / f"{name}.jinja").read_text()


@pytest.mark.parametrize("template, expected", [("qwen2_5", "qwen"), ("qwen3", "qwen"), ("qwen3_training", "qwen"),
                                                ("llama3_1", "llama3"), ("llama3_2", "llama3")])
def test_the_call_format_is_read_from_how_the_template_renders_a_call(tmp_path, template, expected):
    assert tool_call_format(checkpoint(tmp_path, template)[0]) == expected


def test_a_template_that_drops_tool_calls_is_an_error_as_in_trl(tmp_path):
    """Llama 3 Instruct's template reads only `content`; TRL's supports_tool_calling refuses it too."""
    from trl.chat_template_utils import supports_tool_calling

    ours, ref = checkpoint(tmp_path, "llama3")
    assert not supports_tool_calling(ref)
    with pytest.raises(ValueError, match="drops the call's name and its arguments when"):
        tool_call_format(ours)


# ---- parsing calls: TRL's parse_response on the same turn -----------------------------------

def trl_parse(ref, text: str, tools: list) -> list[tuple]:
    """(name, arguments) of each call TRL's parse_response reads from `text` after the prompt."""
    add_response_schema(ref)
    prompt_ids = ref.apply_chat_template(PROMPT[1:], tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    parsed = parse_response(ref, ref.encode(text, add_special_tokens=False), prefix=prompt_ids, tools=tools)
    return [(call["function"]["name"], call["function"]["arguments"]) for call in parsed.get("tool_calls", [])]


def ours_parse(ours, text: str, tools: list) -> list[tuple]:
    """(name, arguments) of each call rlcore reads from the turn's text, as the engine decodes it."""
    turn = ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=True)
    calls = parse_tool_calls(turn, tool_call_format(ours), [tool_schema(tool) for tool in tools])
    assert all(call.error is None for call in calls)
    return [(call.name, call.arguments) for call in calls]


QWEN_TURNS = [
    'The answer needs a tool.\n<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 2}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "add", "arguments": {"a": "7", "b": "2.0"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "describe", "arguments": {"x": "12"}}\n</tool_call><|im_end|>',
    '<tool_call>{"name": "no_arguments"}</tool_call><|im_end|>',
    '<tool_call>\n{"name": "divide", "arguments": {"a": "1e3", "b": "nan"}}\n</tool_call><|im_end|>',
    'No tool this time: 9.<|im_end|>',
]
LLAMA_TURNS = [
    '{"name": "add", "parameters": {"a": 7, "b": "2"}}<|eot_id|>',
    '{"name": "describe", "parameters": {"x": 3}}<|eot_id|>',
    'The answer is 9.<|eot_id|>',
]


@pytest.mark.parametrize("template, text", [("qwen2_5", t) for t in QWEN_TURNS] + [("qwen3", QWEN_TURNS[1])]
                         + [("llama3_1", t) for t in LLAMA_TURNS] + [("llama3_2", LLAMA_TURNS[0])])
def test_calls_parse_as_trl_parses_them(tmp_path, template, text):
    """Names, arguments, and string arguments typed by the tool's schema ("7" -> 7 for an int)."""
    ours, ref = checkpoint(tmp_path, template)
    tools = [add, divide, describe, no_arguments]
    assert ours_parse(ours, text, tools) == trl_parse(ref, text, tools)


@pytest.mark.parametrize("raw", ["7", " 7 ", "-3", "3.0", "3.5", "1e3", "1e400", "nan", "inf", "true", "False", "0",
                                 "None", "null", "[1, 2]", '{"a": 1}', "word", ""])
@pytest.mark.parametrize("types", [["integer"], ["number"], ["boolean"], ["null"], ["array"], ["object"], ["string"],
                                   ["integer", "string"], ["number", "null"]])
def test_string_arguments_are_typed_as_transformers_types_them(raw, types):
    from transformers.utils.chat_parsing.response_parser import _coerce

    assert repr(typed_value(raw, types)) == repr(_coerce(raw, tuple(types)))


@pytest.mark.parametrize("text, error, trl_calls", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1 "b": 2}}\n</tool_call>', "not valid JSON", 0),
    ('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', 'string "name"', 0),
    ('<tool_call>\n["add", 1, 2]\n</tool_call>', 'string "name"', 0),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "never closed", 0),
    ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', '"arguments" must be a JSON object', 2),
    ('<tool_call>\n{"name": "add", "parameters": {"a": 1}}\n</tool_call>', 'gives "parameters"', 2),
])
def test_a_malformed_qwen_call_is_kept_with_its_error(tmp_path, text, error, trl_calls):
    """rlcore answers a malformed call with its error, after the turn's valid calls. Where the text
    is not a call at all, TRL's parse_response reads the whole turn as plain text (no call, the
    conversation ends); where it is a call with bad arguments, TRL runs it and it fails."""
    ours, ref = checkpoint(tmp_path, "qwen2_5")
    valid = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    calls = parse_tool_calls(valid + text, "qwen")
    assert [call.error is None for call in calls] == [True, False]
    assert error in calls[1].error
    assert len(trl_parse(ref, valid + text + "<|im_end|>", [add])) == trl_calls


@pytest.mark.parametrize("text, error", [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}', "not valid JSON"),
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', 'gives "arguments"'),
    ('{"name": 7, "parameters": {}}', 'string "name"'),
])
def test_a_malformed_llama_call_is_kept_with_its_error(text, error):
    (call,) = parse_tool_calls(text, "llama3")
    assert error in call.error


def test_llama_calls_are_read_anywhere_in_the_turn_and_may_be_several():
    """Text around the calls and a second call (which Llama 3.1's template cannot render in one
    turn, but a model may write) do not hide them; a nested {"name" inside arguments is not a call."""
    text = ('Let me check. {"name": "add", "parameters": {"a": 1, "b": 2}}; '
            '{"name": "describe", "parameters": {"x": {"name": "not a call"}}}')
    assert [(c.name, c.arguments) for c in parse_tool_calls(text, "llama3")] == [
        ("add", {"a": 1, "b": 2}), ("describe", {"x": {"name": "not a call"}})]


# ---- running calls: TRL's _tool_call_loop on the same turn ----------------------------------

def trl_tool_round(ref, text: str, tools: list, chat_template: str | None, after: str = "") -> dict:
    """One round of TRL's tool loop on a completion `text` whose calls it parses itself: the tool
    messages it appends, its call and failure counts, the completion ids with the tool results
    appended, the tool mask, and the completion as the reward functions get it. Generation after
    the tools is replaced by the turn `after` ("": an empty one). `chat_template` is the one TRL
    swaps in for training (None: the tokenizer's)."""
    add_response_schema(ref)
    prompt = list(PROMPT[1:])
    prompt_ids = ref.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, chat_template=chat_template)
    completion_ids = ref.encode(text, add_special_tokens=False)
    parsed = parse_response(ref, completion_ids, prefix=prompt_ids, tools=tools)
    trainer = SimpleNamespace(
        max_tool_calling_iterations=1, _sync_tool_dicts=[{tool.__name__: tool for tool in tools}],
        _async_tool_dicts=[{}], use_vllm=False, _is_vlm=False, max_completion_length=10**6,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=10**6)), tools=tools,
        environment_factories=None, _tokenizer=ref, processing_class=ref, chat_template=chat_template,
        chat_template_kwargs={})
    trainer._get_tool_suffix_ids = lambda messages: GRPOTrainer._get_tool_suffix_ids(trainer, messages)
    after_ids = ref.encode(after, add_special_tokens=False)
    trainer._generate_single_turn = lambda ids, *args, **kwargs: ([list(after_ids) for _ in ids], None)
    mask, completions, ids, _, calls, failures, _ = GRPOTrainer._tool_call_loop(
        trainer, [prompt], [prompt_ids], [completion_ids], [[parsed]], None, None, {})
    return {"messages": completions[0][1:], "calls": calls, "failures": failures, "ids": ids[0], "mask": mask[0],
            "completion": completions[0]}


def ours_tool_round(ours, text: str, tools: list, chat_template: str | None) -> dict:
    """The same round with rlcore's pieces, as the engine is to run them."""
    completion_ids = ours.encode(text, add_special_tokens=False)
    turn = ours.decode(completion_ids, skip_special_tokens=True)
    calls = parse_tool_calls(turn, tool_call_format(ours, chat_template), [tool_schema(tool) for tool in tools])
    results = run_tool_calls(calls, {tool.__name__: tool for tool in tools}, timeout=10.0)
    messages = tool_messages(results)
    suffix = tool_suffix_ids(ours, messages, chat_template=chat_template)
    return {"messages": messages, "calls": len(results), "failures": sum(r.failed for r in results),
            "ids": completion_ids + suffix, "mask": [1] * len(completion_ids) + [0] * len(suffix)}


QWEN_ROUNDS = {
    "results of several types": '<tool_call>\n{"name": "add", "arguments": {"a": "7", "b": 2}}\n</tool_call>\n'
                                '<tool_call>\n{"name": "describe", "arguments": {"x": 0}}\n</tool_call>\n'
                                '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 4}}\n</tool_call><|im_end|>',
    "unknown tool, bad arguments, a tool that raises":
        '<tool_call>\n{"name": "subtract", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "c": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call><|im_end|>',
}
LLAMA_ROUNDS = {
    "a result": '{"name": "add", "parameters": {"a": 7, "b": "2"}}<|eot_id|>',
    "a tool that raises": '{"name": "divide", "parameters": {"a": 1, "b": 0}}<|eot_id|>',
}


ROUNDS = {f"qwen2_5-{name}": ("qwen2_5", text) for name, text in QWEN_ROUNDS.items()}
ROUNDS["qwen3 with TRL's training template"] = ("qwen3", QWEN_ROUNDS["results of several types"])
ROUNDS.update({f"{template}-{name}": (template, text) for template in ("llama3_1", "llama3_2")
               for name, text in LLAMA_ROUNDS.items()})


@pytest.mark.parametrize("case", ROUNDS)
def test_a_tool_round_gives_trls_messages_counts_ids_and_tool_mask(tmp_path, case):
    """Tool results (str() of the value, TRL's {'error': ...} text for an unknown tool, bad
    arguments and a raising tool), the calls and failures counted, the ids appended after the
    turn (tool messages as the template renders them, then the next assistant header), and the
    tool mask (0 on those ids). For Qwen3 both render with the template TRL swaps in."""
    template, text = ROUNDS[case]
    ours, ref = checkpoint(tmp_path, template)
    chat_template = (TRL_TEMPLATES / "qwen3_training.jinja").read_text() if template == "qwen3" else None
    tools = [add, divide, describe]
    trl_round = trl_tool_round(ref, text, tools, chat_template)
    del trl_round["completion"]
    assert ours_tool_round(ours, text, tools, chat_template) == trl_round


@pytest.mark.parametrize("template, text", [("qwen2_5", QWEN_ROUNDS["results of several types"]),
                                            ("qwen2_5", "Adding.\n" + QWEN_ROUNDS["unknown tool, bad arguments, a tool that raises"]),
                                            ("llama3_1", LLAMA_ROUNDS["a result"])])
@pytest.mark.parametrize("after", ["", "The sum is 9.", "Once more.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>"])
def test_reward_functions_get_the_completion_as_trls_messages(tmp_path, template, text, after):
    """A completion of several turns reaches the reward functions as TRL gives it: the assistant
    turn (its text outside the calls as content, the calls as tool_calls), the tool messages, and
    the next turn's assistant message, none when that turn is empty; calls in a turn past the turn
    limit are listed, not run."""
    ours, ref = checkpoint(tmp_path, template)
    tools, eos = [add, divide, describe], {"qwen2_5": "<|im_end|>", "llama3_1": "<|eot_id|>"}[template]
    after = after + eos if after else ""
    if template == "llama3_1" and "<tool_call>" in after:
        after = '{"name": "add", "parameters": {"a": 1, "b": 2}}' + eos
    expected = trl_tool_round(ref, text, tools, None, after)["completion"]
    turns = ToolTurns(Toolbox(tools), ours, 1)
    ids = ours.encode(text, add_special_tokens=False)
    ids = ids + turns(0, ids) + ours.encode(after, add_special_tokens=False)
    assert turns.conversations([ids]) == [expected]


@pytest.mark.parametrize("turns_before, max_turns, runs", [(0, None, True), (0, 1, True), (1, 1, False)])
def test_a_turn_the_length_limit_cuts_runs_its_calls_within_the_turn_limit(tmp_path, turns_before, max_turns, runs):
    """run_cut_turns: a cut last turn whose calls all read runs and counts them, while the row is
    under max_turns; its results are dropped, so the completion ends with the calling turn."""
    ours, _ = checkpoint(tmp_path, "qwen2_5")
    turns = ToolTurns(Toolbox([add]), ours, 1)
    ids = ours.encode('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                      add_special_tokens=False)  # no EOS: cut
    turns.turns[0] = turns_before
    turns.run_cut_turns([ids], [True], max_turns)
    assert turns.calls == [1 if runs else 0]
    called = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    assert turns.conversations([ids]) == [[{"role": "assistant", "content": "", "tool_calls": [called]}]]


def test_a_malformed_call_is_answered_with_its_error_and_counted_as_a_failure():
    calls = [ToolCall("unknown", error="the tool call is not valid JSON (...)"), ToolCall("add", {"a": 1, "b": 2})]
    results = run_tool_calls(calls, {"add": add}, timeout=None)
    assert [(r.name, r.content, r.failed) for r in results] == [
        ("unknown", str({"error": "the tool call is not valid JSON (...)"}), True), ("add", "3", False)]


def test_a_tool_that_hangs_is_abandoned_after_the_timeout_and_counted_as_a_failure():
    release = threading.Event()

    def wait(seconds: float) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        release.wait(seconds)
        return "done"

    try:
        (hung, fine) = run_tool_calls([ToolCall("wait", {"seconds": 60.0}), ToolCall("add", {"a": 1, "b": 2})],
                                      {"wait": wait, "add": add}, timeout=0.05)
    finally:
        release.set()  # lets the abandoned thread finish
    assert (hung.failed, hung.timed_out) == (True, True)
    assert hung.content == str({"error": "Tool wait did not return within 0.05 seconds."})
    assert (fine.content, fine.failed, fine.timed_out) == ("3", False, False)


def test_a_tool_s_exception_is_its_result_with_or_without_a_timeout():
    with pytest.raises(ZeroDivisionError) as raised:
        divide(1, 0)
    for timeout in (None, 10.0):
        (result,) = run_tool_calls([ToolCall("divide", {"a": 1, "b": 0})], {"divide": divide}, timeout)
        assert (result.content, result.failed) == (str({"error": str(raised.value)}), True)


def test_an_async_tool_is_awaited():
    (result,) = run_tool_calls([ToolCall("fetch", {"url": "https://example.com"})], {"fetch": fetch}, timeout=10.0)
    assert (result.content, result.failed) == ("https://example.com", False)


# ---- rendering tool results -----------------------------------------------------------------

@pytest.mark.parametrize("template", TOOL_TEMPLATES)
@pytest.mark.parametrize("contents", [["9"], ["9", "{'error': 'Tool subtract not found.'}"]])
def test_tool_suffix_ids_equal_trls(tmp_path, template, contents):
    ours, ref = checkpoint(tmp_path, template)
    messages = [{"role": "tool", "name": "add", "content": content} for content in contents]
    trainer = SimpleNamespace(processing_class=ref, _is_vlm=False, chat_template=None, chat_template_kwargs={},
                              _tokenizer=ref)
    assert tool_suffix_ids(ours, messages) == GRPOTrainer._get_tool_suffix_ids(trainer, messages)


@pytest.mark.parametrize("template", TOOL_TEMPLATES)
def test_the_suffix_continues_the_conversation_as_transformers_renders_it(tmp_path, template):
    """The model's turn up to its EOS, then the suffix, is transformers' rendering of the whole
    conversation with the tool results and the next assistant header."""
    ours, ref = checkpoint(tmp_path, template)
    llama = template.startswith("llama")
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 2}}}]
    if not llama:  # Llama 3.1's template renders one call per turn
        calls.append({"type": "function", "function": {"name": "describe", "arguments": {"x": 9}}})
    messages = [{"role": "tool", "name": call["function"]["name"], "content": str(i + 9)}
                for i, call in enumerate(calls)]
    turn = PROMPT[1:] + [{"role": "assistant", "content": "" if llama else "Let me compute.", "tool_calls": calls}]
    tools = [add, describe]
    rendered = ref.apply_chat_template(turn, tools=tools, tokenize=False)
    eos = ref.eos_token
    before = rendered[:rendered.rindex(eos) + len(eos)]
    after = ref.apply_chat_template(turn + messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert before + ours.decode(tool_suffix_ids(ours, messages)) == after


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_template_kwargs_reach_the_suffix_as_trls_chat_template_kwargs(tmp_path, enable_thinking):
    ours, ref = checkpoint(tmp_path, "qwen3_training")
    messages = [{"role": "tool", "name": "add", "content": "9"}]
    trainer = SimpleNamespace(processing_class=ref, _is_vlm=False, chat_template=None, _tokenizer=ref,
                              chat_template_kwargs={"enable_thinking": enable_thinking})
    suffix = tool_suffix_ids(ours, messages, enable_thinking=enable_thinking)
    assert suffix == GRPOTrainer._get_tool_suffix_ids(trainer, messages)
    assert ("<think>" in ours.decode(suffix)) is not enable_thinking  # the template's empty think block


def test_a_template_that_is_not_prefix_preserving_is_an_error_naming_the_fix(tmp_path):
    """Qwen3's own template drops the empty <think> block of an assistant turn once a tool message
    follows; TRL's check agrees. The error names TRL's training template, which a run with tools
    swaps in for it (test_chat_templates.py) as GRPOTrainer does."""
    from trl.chat_template_utils import is_chat_template_prefix_preserving

    ours, ref = checkpoint(tmp_path, "qwen3")
    assert not is_chat_template_prefix_preserving(ref)
    with pytest.raises(ValueError, match="qwen3_training.jinja"):
        tool_suffix_ids(ours, [{"role": "tool", "name": "add", "content": "9"}])


# ---- loading from the config ----------------------------------------------------------------

MODULE = '''
import threading

def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: First.
        b: Second.
    """
    return a + b

def undocumented(a: int) -> int:
    return a

class Counter:
    """An environment: a counter the model increments and reads."""

    def __init__(self):
        self.value = 0
        self.resets = 0

    def reset(self, **row):
        self.value = row.get("start", 0)
        self.resets += 1
        return row.get("observation")

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.value += by
        return self.value

    def read(self) -> int:
        """The counter's value."""
        return self.value

    def get_reward(self) -> float:
        return float(self.value == 10)

    def _helper(self):
        return None

    @property
    def doubled(self) -> int:
        raise AssertionError("properties are never evaluated")

class NoReset:
    def act(self) -> int:
        """Act."""
        return 1

class Clash:
    def reset(self, **row):
        return None

    def add(self, a: int, b: int) -> int:
        """Add, again.

        Args:
            a: First.
            b: Second.
        """
        return a + b

NAMES = ["add", "read"]
'''


@pytest.fixture
def tool_module(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "my_tools", raising=False)
    return __import__("my_tools")


def test_importing_the_tool_modules_does_not_import_transformers_or_trl():
    import subprocess
    import sys

    code = ("import sys, rlcore.tools, rlcore.tools.calls, rlcore.tools.schema; "
            "print(sorted(m for m in ('transformers', 'trl') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_a_tool_is_named_module_colon_function(tool_module):
    assert load_tool("my_tools:add") is tool_module.add
    assert load_tool(" my_tools : add ") is tool_module.add


@pytest.mark.parametrize("name, message", [
    ("my_tools.add", "is not 'module:name'"),
    ("lambda a: a", "is not 'module:name'"),
    ("my_tools/x.py:add", "is not 'module:name'"),
    ("no_such_module:add", "module no_such_module cannot be imported"),
    ("my_tools:ad", "did you mean 'add'"),
    ("my_tools:Counter", "names a class, not a function"),
    ("my_tools:NAMES", "names a list object, not"),
    ("my_tools:undocumented", "tools entry 'my_tools:undocumented': tool undocumented has no docstring"),
])
def test_a_bad_tool_entry_is_an_error_naming_it(tool_module, name, message):
    with pytest.raises(ValueError, match=message):
        load_tool(name)


def test_an_environment_s_public_methods_are_its_tools_as_in_trl(tool_module):
    """reset, get_reward and _private methods are not tools; the order is TRL's (by name); the
    schemas of the bound methods are transformers'; standalone tools come first."""
    factory = load_environment_factory("my_tools:Counter")
    toolbox = Toolbox([tool_module.add], factory)
    environment = toolbox.pool[0]
    assert [tool.__name__ for tool in environment_tools(environment)] == ["increment", "read"]
    assert toolbox.schemas == [get_json_schema(tool) for tool in [tool_module.add, environment.increment,
                                                                  environment.read]]
    assert list(toolbox.tools_for(environment)) == ["add", "increment", "read"]
    assert toolbox.reward_name == "Counter"


def test_environments_are_pooled_and_each_rollout_s_tools_act_on_its_own(tool_module):
    toolbox = Toolbox([], load_environment_factory("my_tools:Counter"))
    first = toolbox.environments(2)
    second = toolbox.environments(3)
    assert second[:2] == first and len({id(e) for e in second}) == 3
    prompt = [{"role": "user", "content": "Count to ten."}]
    for environment, start in zip(second, (0, 4, 9)):
        reset_environment(environment, {"prompt": prompt, "start": start})
        run_tool_calls([ToolCall("increment", {"by": 1})], toolbox.tools_for(environment), timeout=None)
    assert [e.value for e in second] == [1, 5, 10]
    assert toolbox.get_reward(second) == [0.0, 0.0, 1.0]
    toolbox.retire(second[1])
    assert toolbox.environments(3)[:2] == [second[0], second[2]]


def test_reset_s_text_is_appended_to_the_last_prompt_message_as_in_trl(tool_module):
    environment = tool_module.Counter()
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count."}]
    row = {"prompt": prompt, "observation": " The counter starts at 3.", "start": 3}
    assert reset_environment(environment, row) == [prompt[0], {"role": "user",
                                                               "content": "Count. The counter starts at 3."}]
    assert reset_environment(environment, {"prompt": prompt}) == prompt
    assert prompt[1]["content"] == "Count."  # the dataset's row is left as it was
    with pytest.raises(ValueError, match="needs chat prompts"):
        reset_environment(environment, {"prompt": "Count."})


@pytest.mark.parametrize("name, message", [
    ("my_tools:NoReset", "has no reset method"),
    ("my_tools:Clash", "two tools are named add"),
])
def test_a_bad_environment_is_an_error_naming_it(tool_module, name, message):
    with pytest.raises(ValueError, match=message):
        Toolbox([tool_module.add], load_environment_factory(name))


def test_an_environment_factory_that_is_not_callable_is_an_error(tool_module):
    with pytest.raises(ValueError, match="environment_factory 'my_tools:NAMES' names a list object"):
        load_environment_factory("my_tools:NAMES")
