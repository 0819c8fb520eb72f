"""Dataset rows in, completions out: what a training round and the held-out evaluation share.

`sample_completions` gives each row one completion from the engine (`generate`): its prompt ids,
or with tools the prompt its environment's reset made and a `ToolTurns` that runs the calls of
each turn (tools/turns.py). `completion_token_ids` and `completion_texts` are the completions as
the reward functions get them: token ids, and text (with tools, TRL's list of messages), and
`completion_tool_masks` which of their tokens the model wrote.
"""

from __future__ import annotations

from collections.abc import Callable

from rlcore.models.tokenizer import Tokenizer
from rlcore.models.transformer import Transformer
from rlcore.rollout.engine import Rollout, generate
from rlcore.tools.turns import ToolTurns

ToolRows = Callable[[list[dict]], tuple[list[list[int]], ToolTurns]]
"""`tool_turns(rows)`: the rows' prompts and the rollout's end_of_turn (Run.tool_turns)."""


def sample_completions(model: Transformer, tok: Tokenizer, rows: list[dict], max_new_tokens: int, *,
                       tool_turns: ToolRows | None = None, max_turns: int | None = None,
                       **sampling) -> tuple[Rollout, ToolTurns | None]:
    """One completion of at most `max_new_tokens` for each of `rows` (a prompt sampled G times is G
    rows), ended by the tokenizer's EOS; `sampling` is `generate`'s (temperature, top_k, ...,
    stop_sequences, generator, dtype, progress). With `tool_turns`, over up to `max_turns`
    tool-calling turns (None: until max_new_tokens), and the ToolTurns that counted the calls
    (else None)."""
    prompts, turns = tool_turns(rows) if tool_turns else ([row["prompt_ids"] for row in rows], None)
    rollout = generate(model, prompts, 1, max_new_tokens, eos_token_ids=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id, **sampling,
                       **({"end_of_turn": turns, "max_turns": max_turns} if turns else {}))
    if turns:  # as TRL: the calls of a last turn the length limit cut still run
        turns.run_cut_turns(completion_token_ids(rollout), rollout.truncated.tolist(), max_turns)
    return rollout, turns


def completion_token_ids(rollout: Rollout) -> list[list[int]]:
    """Each completion's token ids, without its padding."""
    return [ids[:n].tolist() for ids, n in zip(rollout.completion_ids, rollout.lengths.tolist())]


def completion_texts(tok: Tokenizer, completion_ids: list[list[int]], turns: ToolTurns | None = None) -> list:
    """Each completion as the reward functions get it (training itself uses the token ids): its
    text, or with tools its messages."""
    if turns:
        return turns.conversations(completion_ids)
    return [tok.decode(ids, skip_special_tokens=True) for ids in completion_ids]


def completion_tool_masks(rollout: Rollout) -> list[list[int]] | None:
    """Each completion's tool mask, without its padding: 1 for a token the model wrote, 0 for a tool
    result's (None without tools)."""
    if rollout.tool_mask is None:
        return None
    return [mask[:n].tolist() for mask, n in zip(rollout.tool_mask, rollout.lengths.tolist())]


def tool_reward_kwargs(rollout: Rollout, turns: ToolTurns | None) -> dict:
    """What a rollout with tools adds to the reward functions' keywords: `tool_mask`
    (`completion_tool_masks`) and, with an environment factory, TRL's `environments`; {} without tools."""
    if turns is None:
        return {}
    kwargs = {"tool_mask": completion_tool_masks(rollout)}
    if turns.environments and turns.environments[0] is not None:
        kwargs["environments"] = turns.environments
    return kwargs
