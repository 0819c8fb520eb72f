"""A multi-turn rollout's turns: after a turn that ends in tool calls, the ids to append.

`tool_suffix_ids` renders the tool messages as the chat template renders them between turns,
with the next assistant header after them: the token ids to append to a sequence whose turn
ended in tool calls. `ToolTurns` puts the toolbox and these together as the `end_of_turn` of a
multi-turn rollout (rlcore.rollout.generate). A template that is not prefix-preserving (Qwen3's
own) renders the earlier turn differently once tool messages follow, so no suffix can be cut
from it; `training_chat_template` is the template TRL swaps in for it, as a run with tools does
(rlcore.run.setup.load_toolbox).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlcore.tools.calls import ToolCall, assistant_message, parse_tool_calls, tool_call_format
from rlcore.tools.toolbox import Toolbox, run_tool_calls, tool_messages

# TRL's files, byte for byte (README.md there)
CHAT_TEMPLATES = Path(__file__).parents[1] / "models" / "chat_templates"
TRAINING_TEMPLATES = {"qwen3.jinja": "qwen3_training.jinja"}  # a stock template -> the one TRL trains it with


def call_turn(name: str) -> list[dict]:
    """TRL's minimal conversation ending in an assistant turn that calls tool `name`."""
    return [{"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]


def is_prefix_preserving(tokenizer) -> bool:
    """Whether the chat template renders an assistant turn with tool calls the same once a tool
    message follows it: TRL's is_chat_template_prefix_preserving, which decides the swap."""
    turn = tokenizer.apply_chat_template(call_turn("dummy"), add_generation_prompt=False, tokenize=True)
    full = tokenizer.apply_chat_template(call_turn("dummy") + [{"role": "tool", "name": "dummy", "content": "dummy"}],
                                         add_generation_prompt=True, tokenize=True)
    return full[:len(turn)] == turn


def training_chat_template(tokenizer) -> str | None:
    """TRL's training template for the tokenizer's chat template (get_training_chat_template, for
    the templates rlcore ships), or None where there is none."""
    for stock, training in TRAINING_TEMPLATES.items():
        if tokenizer.chat_template == (CHAT_TEMPLATES / stock).read_text(encoding="utf-8"):
            return (CHAT_TEMPLATES / training).read_text(encoding="utf-8")
    return None


def tool_suffix_ids(tokenizer, messages: list[dict], chat_template: str | None = None, **template_kwargs) -> list[int]:
    """Token ids to append after an assistant turn that ended in tool calls (with an EOS): the
    tool `messages` as the chat template renders them between turns, then the generation prompt.

    As TRL's `_get_tool_suffix_ids`: a minimal conversation (a user message, then an assistant
    turn calling the first message's tool) is rendered alone and with the tool messages and the
    generation prompt; the suffix is what the second adds after the first's last EOS (the
    template may write more after the EOS, e.g. Qwen's "\\n", which belongs to the suffix).
    `template_kwargs` reach the template (e.g. enable_thinking).
    """
    conversation = call_turn(messages[0]["name"])
    turn = tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=True,
                                         chat_template=chat_template, **template_kwargs)
    full = tokenizer.apply_chat_template(conversation + messages, add_generation_prompt=True, tokenize=True,
                                         chat_template=chat_template, **template_kwargs)
    ends = [i for i, token in enumerate(turn) if token in tokenizer.eos_token_ids]
    if ends:
        turn = turn[:ends[-1] + 1]
    if full[:len(turn)] != turn:
        raise ValueError(f"the chat template renders an assistant turn differently once tool messages follow it "
                         f"({tokenizer.decode(turn)[-80:]!r} is not the start of {tokenizer.decode(full)[-160:]!r}), "
                         f"so tool results cannot be appended to a sequence; a run with tools swaps in TRL's "
                         f"training template for the templates in rlcore/chat_templates (Qwen3's); for another, "
                         f"write a prefix-preserving one (as TRL's trl/chat_templates/*_training.jinja, e.g. "
                         f"qwen3_training.jinja) into the checkpoint's chat_template.jinja")
    return full[len(turn):]


class ToolTurns:
    """The `end_of_turn` of a multi-turn rollout (rlcore.rollout.generate) over N rows: it reads
    the calls in the turn that just ended, runs them with the row's tools and returns the ids to
    append (`tool_suffix_ids`), or None for a turn without calls, which ends the row. Per row it
    counts `calls`, `failures` and `turns` (the turns whose calls ran; the engine still drops results
    that do not fit in max_new_tokens, as TRL does after running the calls).

    `environments` holds each row's environment (None for a toolbox without one); an environment
    whose call timed out leaves the toolbox's pool. `template_kwargs` reach the chat template.
    `run_cut_turns` runs the calls of turns the length limit cut, and `conversations` gives the
    finished completions as the reward functions get them (both as TRL's).
    """

    def __init__(self, toolbox: Toolbox, tokenizer, rows: int, environments: list[object] | None = None,
                 timeout: float | None = None, chat_template: str | None = None, **template_kwargs):
        self.toolbox, self.tokenizer, self.timeout = toolbox, tokenizer, timeout
        self.chat_template, self.template_kwargs = chat_template, template_kwargs
        self.format = tool_call_format(tokenizer, chat_template)
        self.environments = environments if environments is not None else [None] * rows
        self.tools = [toolbox.tools_for(environment) for environment in self.environments]
        self.calls, self.failures, self.turns = [0] * rows, [0] * rows, [0] * rows
        self.turn_start = [0] * rows  # where each row's current turn begins in its completion
        self.messages = [[] for _ in range(rows)]  # each row's finished turns: assistant, then tool messages

    def __getstate__(self) -> dict:
        """What a sampler rank sends with its round (rlcore.parallel.sampler_ranks): the rows'
        messages, counters and environments, without the toolbox and tokenizer, which the trainer
        has (`attach`)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("toolbox", "tokenizer", "tools")}

    def attach(self, toolbox: Toolbox, tokenizer) -> ToolTurns:
        """This rank's toolbox and tokenizer, for turns that came from another rank."""
        self.toolbox, self.tokenizer = toolbox, tokenizer
        self.tools = [toolbox.tools_for(environment) for environment in self.environments]
        return self

    def turn(self, row: int, completion_ids: list[int]) -> tuple[str, list[ToolCall]]:
        """The text of the row's current turn and the calls in it."""
        text = self.tokenizer.decode(completion_ids[self.turn_start[row]:], skip_special_tokens=True)
        return text, parse_tool_calls(text, self.format, self.toolbox.schemas)

    def __call__(self, row: int, completion_ids: list[int]) -> list[int] | None:
        text, calls = self.turn(row, completion_ids)
        if not calls:
            return None
        results = run_tool_calls(calls, self.tools[row], self.timeout)
        if any(result.timed_out for result in results) and self.environments[row] is not None:
            self.toolbox.retire(self.environments[row])
        self.calls[row] += len(results)
        self.failures[row] += sum(result.failed for result in results)
        self.turns[row] += 1
        messages = tool_messages(results)
        self.messages[row] += [assistant_message(text, self.format, calls), *messages]
        suffix = tool_suffix_ids(self.tokenizer, messages, self.chat_template, **self.template_kwargs)
        self.turn_start[row] = len(completion_ids) + len(suffix)
        return suffix

    def run_cut_turns(self, completion_ids: list[list[int]], truncated: list[bool], max_turns: int | None) -> None:
        """After the rollout, as TRL does: a last turn that max_completion_length cut still has its
        calls run and counted when every call in it reads (their results are dropped: no room is
        left); one with a call the cut left unclosed (or unreadable) is plain text, and none runs.
        Rows past `max_turns` tool-calling turns run nothing."""
        for row, (ids, cut) in enumerate(zip(completion_ids, truncated)):
            if not cut or len(ids) <= self.turn_start[row] or (max_turns is not None and self.turns[row] >= max_turns):
                continue
            _, calls = self.turn(row, ids)
            if calls and all(call.error is None for call in calls):
                self(row, ids)

    def conversations(self, completion_ids: list[list[int]]) -> list[list[dict]]:
        """Each row's completion as TRL hands it to reward functions: its assistant and tool
        messages, then the last turn's assistant message (none when that turn is empty: its tool
        results took the last of max_completion_length; calls it holds past the turn limit are
        listed, not run). Results the engine dropped for want of room are left out, as in TRL."""
        out = []
        for row, ids in enumerate(completion_ids):
            messages = self.messages[row]
            if self.turn_start[row] > len(ids):  # the engine dropped the latest results: the trailing tool messages
                while messages[-1]["role"] == "tool":
                    messages = messages[:-1]
            elif len(ids) > self.turn_start[row]:
                text, calls = self.turn(row, ids)
                messages = messages + [assistant_message(text, self.format, calls)]
            out.append(messages)
        return out


@dataclass
class ToolCounts:
    """A ToolTurns' counters alone, per row: `calls`, `failures` and `turns` (what the round's tool
    metrics read), for rows taken from several rollouts (dynamic sampling's round)."""
    calls: list[int]
    failures: list[int]
    turns: list[int]
