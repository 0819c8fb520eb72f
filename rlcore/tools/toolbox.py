"""Tools and environments the model calls during a rollout, with TRL's GRPOTrainer semantics.

A tool is a plain function (sync or async) with type hints and a Google-style docstring; its JSON
schema (schema.py) is what the chat template shows the model as `tools`. A config names tools as
"module:function", as reward functions are named. An environment factory, named "module:Class"
(or a function that returns an instance), gives one environment per rollout: its public methods,
except `reset` and `get_reward`, are tools bound to that instance; `reset(**row)` starts an
episode from the dataset row (prompt and every column) and may return text that is appended to
the last prompt message; an optional `get_reward()` scores the finished rollout (TRL adds it as
one more reward function, weight 1, named after the class). Instances are pooled: built once,
reset for every rollout.

Each call (calls.py parses them) gives one tool message {"role": "tool", "name", "content"}, the
content being `str(result)` as in TRL. A call that fails gets TRL's error result instead,
`str({"error": message})`: "Tool <name> not found." for an unknown tool, the exception's text for
bad arguments or a tool that raises, the parse error for a malformed call, and a timeout message
for a call that ran past `timeout` seconds. turns.py appends the results to the conversation.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass

from rlcore.rewards.scoring import _call, missing_attribute
from rlcore.tools.calls import ToolCall
from rlcore.tools.schema import tool_schema

NOT_TOOLS = ("reset", "get_reward")  # environment methods that are never tools (TRL's)


def load_named(name: str, option: str) -> object:
    """The object a config entry "module:attribute" names (`option` names the config field in errors)."""
    module_name, colon, attr = (part.strip() for part in name.partition(":"))
    if not colon or not all(part.isidentifier() for part in (*module_name.split("."), attr)):
        raise ValueError(f"{option} entry {name!r} is not 'module:name' with Python names; name a function or class "
                         f"defined in an importable module (my_tools.py's def add is 'my_tools:add'), with the "
                         f"module's directory the current one or on PYTHONPATH")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or any error the module raises while it loads
        raise ValueError(f"{option} entry {name!r}: module {module_name} cannot be imported ({type(err).__name__}: "
                         f"{err}); make it importable from the current directory or PYTHONPATH") from err
    if not hasattr(module, attr):
        raise ValueError(f"{option} entry {name!r}: " + missing_attribute(module, module_name, attr))
    return getattr(module, attr)


def load_tool(name: str) -> Callable:
    """The tool a "module:function" config entry names, its schema checked now rather than mid-run."""
    tool = load_named(name, "tools")
    if not (inspect.isfunction(tool) or inspect.ismethod(tool)):
        kind = "class" if inspect.isclass(tool) else f"{type(tool).__name__} object"
        raise ValueError(f"tools entry {name!r} names a {kind}, not a function; a tool is a def with type hints and "
                         f"a docstring (transformers and TRL take functions and methods only; an environment's "
                         f"methods are tools through environment_factory)")
    try:
        tool_schema(tool)
    except ValueError as err:
        raise ValueError(f"tools entry {name!r}: {err}") from None
    return tool


def load_environment_factory(name: str) -> Callable[[], object]:
    """The environment factory a "module:Class" config entry names: a class, or a function that
    returns a new environment."""
    factory = load_named(name, "environment_factory")
    if not callable(factory):
        raise ValueError(f"environment_factory {name!r} names a {type(factory).__name__} object, which cannot make "
                         f"environments; name the environment's class (or a function that returns a new environment)")
    return factory


def environment_tools(environment: object) -> list[Callable]:
    """The tools of an environment: its class's public functions but reset and get_reward, bound
    to it, in name order (TRL's inspect.getmembers order). Properties are never evaluated."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


class Toolbox:
    """A run's tools: the standalone ones and, with an environment factory, a pool of environments
    whose methods are tools too. `schemas` go to the chat template as `tools`."""

    def __init__(self, tools: list[Callable], environment_factory: Callable[[], object] | None = None):
        self.tools = list(tools)
        self.environment_factory = environment_factory
        self.pool = [self.new_environment()] if environment_factory is not None else []
        methods = environment_tools(self.pool[0]) if self.pool else []
        self.schemas = [tool_schema(tool) for tool in self.tools + methods]
        names = [schema["function"]["name"] for schema in self.schemas]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"two tools are named {', '.join(repeated)} (tools and the environment's methods); the "
                             f"model calls a tool by name, so rename one")
        # the reward column's name (TRL's): the environment's class, when it scores rollouts with get_reward
        self.reward_name = (type(self.pool[0]).__name__
                            if self.pool and callable(getattr(self.pool[0], "get_reward", None)) else None)

    def new_environment(self) -> object:
        environment = self.environment_factory()
        if not callable(getattr(environment, "reset", None)):
            raise ValueError(f"environment_factory made a {type(environment).__name__}, which has no reset method; an "
                             f"environment defines reset(self, **row) to start an episode (it may return text to "
                             f"append to the prompt)")
        return environment

    def environments(self, count: int) -> list[object]:
        """`count` environments, one per rollout, from the pool (grown when it is smaller)."""
        while len(self.pool) < count:
            self.pool.append(self.new_environment())
        return self.pool[:count]

    def retire(self, environment: object) -> None:
        """Drop `environment` from the pool: a call on it timed out and may still be running."""
        self.pool = [kept for kept in self.pool if kept is not environment]

    def tools_for(self, environment: object | None = None) -> dict[str, Callable]:
        """Tool name -> function for one rollout: the standalone tools and `environment`'s methods."""
        methods = environment_tools(environment) if environment is not None else []
        return {tool.__name__: tool for tool in self.tools + methods}

    def get_reward(self, environments: list[object]) -> list[float | None]:
        """get_reward() of each rollout's environment (awaited when async)."""
        return [_call(environment.get_reward, {}) for environment in environments]


def reset_environment(environment: object, row: dict) -> list[dict]:
    """Start an episode: environment.reset(**row); the prompt (a list of messages) with the text
    reset returns, if any, appended to its last message, as TRL does."""
    prompt = row["prompt"]
    if not isinstance(prompt, list):
        raise ValueError(f"an environment needs chat prompts (lists of messages) to show its tools, got the prompt "
                         f"{str(prompt)[:80]!r}; give the dataset's prompts as messages")
    observation = _call(environment.reset, row)
    if observation is None:
        return prompt
    return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]


@dataclass
class ToolResult:
    """The outcome of one call: the tool message's name and content, and whether it failed."""

    name: str
    content: str
    failed: bool
    timed_out: bool = False


class ToolTimeout(Exception):
    """A tool call ran past its timeout."""


def run_tool_calls(calls: list[ToolCall], tools: dict[str, Callable], timeout: float | None) -> list[ToolResult]:
    """Run a turn's calls in order, each stopped after `timeout` seconds (None: no limit).

    A timed-out call is abandoned, not killed: Python cannot stop a thread, so it runs on in the
    background until it returns (a daemon thread, ended when the process exits), still holding
    what it holds and still able to change its environment's state; retire that environment.
    """
    results = []
    for call in calls:
        if call.error is not None:
            results.append(ToolResult(call.name, str({"error": call.error}), failed=True))
        elif call.name not in tools:
            results.append(ToolResult(call.name, str({"error": f"Tool {call.name} not found."}), failed=True))
        else:
            try:
                content = str(call_with_timeout(tools[call.name], call.arguments, timeout))
                results.append(ToolResult(call.name, content, failed=False))
            except ToolTimeout:
                message = f"Tool {call.name} did not return within {timeout:g} seconds."
                results.append(ToolResult(call.name, str({"error": message}), failed=True, timed_out=True))
            except Exception as err:  # bad arguments or the tool's own error: the model reads it
                results.append(ToolResult(call.name, str({"error": str(err)}), failed=True))
    return results


def call_with_timeout(tool: Callable, arguments: dict, timeout: float | None):
    """tool(**arguments) on a daemon thread, raising ToolTimeout after `timeout` seconds; what
    the tool raises is raised here."""
    if timeout is None:
        return _call(tool, arguments)
    outcome = {}

    def target():
        try:
            outcome["value"] = _call(tool, arguments)
        except BaseException as err:  # re-raised on the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=target, name=f"tool {tool.__name__}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ToolTimeout
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def tool_messages(results: list[ToolResult]) -> list[dict]:
    """The chat messages of a turn's results, as TRL builds them."""
    return [{"role": "tool", "name": result.name, "content": result.content} for result in results]
