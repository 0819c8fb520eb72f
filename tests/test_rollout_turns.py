"""Multi-turn rollouts: `generate(..., end_of_turn=...)` appends ids (tool results and the next
assistant header) after a row's turn and decodes on. Checked against a cache-free training forward
over the whole sequence, against the same rollout without `end_of_turn`, and against the limits
its docstring states."""

import pytest
import torch

from conftest import make_hf_model
import rlcore.rollout.engine as engine
from rlcore.rollout import generate
from test_rollout import PAD, decoder, random_prompts, rlcore_model, training_logprobs, use_static_step  # noqa: F401

EOS = list(range(1, 9))  # ~6% of the vocabulary: turns end at many lengths
SUFFIX = [100, 3, 101, 102]  # 3 is an EOS id: an appended id never stops the row


def first_turn_only(rows=None, suffix=SUFFIX):
    """A fake end_of_turn: `suffix` after the first turn of the rows in `rows` (all when None), None
    after any other turn; `calls` records (row, completion so far) of every call."""
    calls = []

    def end_of_turn(row, completion):
        calls.append((row, completion))
        first = sum(r == row for r, _ in calls) == 1
        return suffix if first and (rows is None or row in rows) else None

    end_of_turn.calls = calls
    return end_of_turn


def first_turns(calls) -> dict[int, list[int]]:
    """Row -> its completion when end_of_turn was first called for it (its first turn)."""
    first = {}
    for row, completion in calls:
        first.setdefault(row, completion)
    return first


def rollout(model, end_of_turn=None, max_new_tokens=40, **kwargs):
    return generate(model, random_prompts([6, 3, 11, 6], seed=1), 4, max_new_tokens, eos_token_ids=EOS,
                    pad_token_id=PAD, temperature=0.8, generator=torch.Generator().manual_seed(0),
                    end_of_turn=end_of_turn, **kwargs)


def appended_runs(tool_mask_row: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each stretch of 0s in a row of the tool mask."""
    runs, start = [], None
    for i, bit in enumerate(tool_mask_row + [1]):
        if bit == 0 and start is None:
            start = i
        elif bit == 1 and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_appended_ids_follow_the_stop_token_masked_and_logprobs_equal_the_training_forward(decoder):
    """Row-by-row: the suffix sits right after the turn's stop token, with tool mask 0 and log-prob 0;
    on the model's own tokens, before and after it, the rollout's log-probs are the trainer's, from one
    forward pass without a cache over prompt + completion (appended ids included)."""
    model = rlcore_model(make_hf_model("qwen2"))
    end_of_turn = first_turn_only()
    out = rollout(model, end_of_turn)
    first = first_turns(end_of_turn.calls)
    continued = 0
    for row, (ids, tool_mask, n) in enumerate(zip(out.completion_ids.tolist(), out.tool_mask.tolist(),
                                                  out.lengths.tolist())):
        if row not in first or len(first[row]) + len(SUFFIX) > 40:  # truncated in its first turn, or no room
            assert (out.tool_mask[row] == 1).all()
            continue
        end = len(first[row])
        assert ids[:end] == first[row] and ids[end - 1] in EOS
        assert ids[end:end + len(SUFFIX)] == SUFFIX
        assert appended_runs(tool_mask) == [(end, end + len(SUFFIX))]
        assert (out.sampling_logprobs[row, end:end + len(SUFFIX)] == 0).all()
        assert out.completion_mask[row, :n].all()
        continued += n > end + len(SUFFIX)  # the model wrote a second turn
    assert continued >= 8
    own = (out.tool_mask * out.completion_mask).bool()
    ref = training_logprobs(model, out, 0.8)
    torch.testing.assert_close(out.sampling_logprobs[own], ref[own], rtol=0, atol=1e-5)
    assert (out.sampling_logprobs[out.completion_mask == 0] == 0).all()


def test_rows_that_call_no_tool_get_the_tokens_of_a_rollout_without_end_of_turn(decoder):
    """Sampling noise is per (row, step): a row whose turn gets nothing appended decodes exactly as
    without end_of_turn, and a row that gets a suffix decodes as without it up to its stop token."""
    model = rlcore_model(make_hf_model("qwen2"))
    plain = rollout(model)
    end_of_turn = first_turn_only(rows=set(range(0, 16, 2)))
    turns = rollout(model, end_of_turn)
    assert plain.tool_mask is None
    for row in range(16):
        if row % 2:
            assert torch.equal(turns.completion_ids[row], plain.completion_ids[row]), row
            assert torch.equal(turns.truncated[row], plain.truncated[row])
            torch.testing.assert_close(turns.sampling_logprobs[row], plain.sampling_logprobs[row], rtol=0, atol=1e-6)
        else:
            n = int(plain.lengths[row])
            assert turns.completion_ids[row, :n].tolist() == plain.completion_ids[row, :n].tolist()
    assert (turns.lengths[0::2] > plain.lengths[0::2]).sum() >= 4  # the even rows did go on


def test_end_of_turn_returning_none_stops_the_row_as_without_it():
    """Every turn answered with None: the rollout of plain decoding bit for bit, end_of_turn called once
    for each row that stopped (with the completion ending in its stop token) and never for one that
    ran out of tokens."""
    model = rlcore_model(make_hf_model("qwen2"))
    calls = []
    plain = rollout(model)
    got = rollout(model, lambda row, completion: calls.append((row, completion)))
    for field in ("completion_ids", "completion_mask", "lengths", "truncated", "sampling_logprobs"):
        assert torch.equal(getattr(got, field), getattr(plain, field)), field
    assert (got.tool_mask == 1).all()
    stopped = [row for row in range(16) if not plain.truncated[row]]
    assert 0 < len(stopped) < 16 and sorted(row for row, _ in calls) == stopped
    for row, completion in calls:
        assert completion == plain.completion_ids[row, :int(plain.lengths[row])].tolist()


def test_max_turns_limits_the_appends_per_row():
    """end_of_turn always answers; with max_turns=2 no row gets more than two suffixes, each row that
    ends a third turn stops there (not truncated), and end_of_turn is not asked after the limit."""
    model = rlcore_model(make_hf_model("qwen2"))

    def always(calls):
        return lambda row, completion: calls.append(row) or SUFFIX

    unlimited_calls, limited_calls = [], []
    unlimited = rollout(model, always(unlimited_calls), max_new_tokens=60)
    limited = rollout(model, always(limited_calls), max_new_tokens=60, max_turns=2)
    unlimited_runs = [len(appended_runs(row)) for row in unlimited.tool_mask.tolist()]
    limited_runs = [len(appended_runs(row)) for row in limited.tool_mask.tolist()]
    assert max(unlimited_runs) > 2 and max(limited_runs) == 2
    for row in range(16):
        assert limited_calls.count(row) <= 2
        if unlimited_runs[row] > 2:  # its third turn ended: with the limit, the row stops after it
            assert limited_runs[row] == 2 and not limited.truncated[row]
            n = int(limited.lengths[row])
            assert limited.completion_ids[row, n - 1] in EOS
            assert limited.completion_ids[row, :n].tolist() == unlimited.completion_ids[row, :n].tolist()
    assert (limited.lengths <= 60).all() and (unlimited.lengths <= 60).all()
    zero = rollout(model, always([]), max_turns=0)
    assert (zero.tool_mask == 1).all()


def test_ids_that_do_not_fit_in_max_new_tokens_are_dropped_and_the_row_stops():
    """A suffix fits when the turn's tokens plus the suffix are at most max_new_tokens (TRL's rule);
    otherwise the row keeps its turn, ends with its stop token, and is not truncated."""
    model = rlcore_model(make_hf_model("qwen2"))
    suffix = list(range(100, 112))
    end_of_turn = first_turn_only(suffix=suffix)
    out = rollout(model, end_of_turn, max_new_tokens=20)
    fits = dropped = 0
    for row, completion in first_turns(end_of_turn.calls).items():
        n = int(out.lengths[row])
        if len(completion) + len(suffix) > 20:
            dropped += 1
            assert n == len(completion) and not out.truncated[row] and (out.tool_mask[row] == 1).all()
        else:
            fits += 1
            assert out.completion_ids[row, len(completion):len(completion) + len(suffix)].tolist() == suffix
    assert fits and dropped
    assert (out.lengths <= 20).all()


def test_compacting_finished_rows_changes_no_multi_turn_result(monkeypatch):
    """The static step, its batch dropped to power-of-two buckets while rows are resumed, against the
    same step keeping every row: the same tokens and tool masks, log-probs to matmul rounding."""
    model = rlcore_model(make_hf_model("qwen3"))
    sizes = use_static_step(monkeypatch)

    def run():
        return generate(model, random_prompts([3, 5, 7, 9, 4, 6, 8, 2], seed=5), 2, 40, eos_token_ids=EOS,
                        pad_token_id=PAD, temperature=1.0, top_p=0.95, generator=torch.Generator().manual_seed(2),
                        end_of_turn=first_turn_only(rows=set(range(0, 16, 3))))

    compacted = run()
    assert len(sizes) >= 2 and sizes[-1] < 16
    sizes.clear()
    monkeypatch.setattr(engine, "COMPACT_FRACTION", 0)
    kept = run()
    assert sizes == []
    assert (kept.tool_mask == 0).any()
    for field in ("completion_ids", "completion_mask", "truncated", "tool_mask"):
        assert torch.equal(getattr(compacted, field), getattr(kept, field)), field
    torch.testing.assert_close(compacted.sampling_logprobs, kept.sampling_logprobs, rtol=0, atol=1e-6)


def test_max_turns_without_end_of_turn_is_an_error():
    model = rlcore_model(make_hf_model("qwen2"))
    with pytest.raises(ValueError, match="max_turns=2 needs end_of_turn"):
        generate(model, [[3, 4]], 2, 4, eos_token_ids=[1], pad_token_id=PAD, max_turns=2)


# ---- ToolTurns: the end_of_turn of tool calling, against TRL's tool loop -----------------------

@pytest.mark.parametrize("template", ["qwen2_5", "llama3_1"])
def test_tool_turns_append_what_trls_tool_loop_appends_and_count_per_row(tmp_path, template):
    """Two rows, each ending a turn with calls (one of them failing): the ids appended and the call
    and failure counts equal one round of TRL's _tool_call_loop on the same turn; a next turn without
    calls (the earlier calls are still in the completion) ends the row."""
    from test_tools import LLAMA_ROUNDS, QWEN_ROUNDS, add, checkpoint, describe, divide, trl_tool_round
    from rlcore.tools.toolbox import Toolbox
    from rlcore.tools.turns import ToolTurns

    ours, ref = checkpoint(tmp_path, template)
    texts = list((QWEN_ROUNDS if template == "qwen2_5" else LLAMA_ROUNDS).values())
    tools = [add, divide, describe]
    end_of_turn = ToolTurns(Toolbox(tools), ours, rows=3, timeout=10.0)
    expected = [trl_tool_round(ref, text, tools, None) for text in texts]
    for row, (text, trl_round) in enumerate(zip(texts, expected)):
        completion = ours.encode(text, add_special_tokens=False)
        assert completion + end_of_turn(row, completion) == trl_round["ids"]
    assert end_of_turn.calls[:2] == [trl_round["calls"] for trl_round in expected]
    assert end_of_turn.failures[:2] == [trl_round["failures"] for trl_round in expected]
    assert end_of_turn.failures[1] > 0 and end_of_turn.turns == [1, 1, 0]
    answer = ours.encode("The answer is 9." + ("<|im_end|>" if template == "qwen2_5" else "<|eot_id|>"),
                         add_special_tokens=False)
    assert end_of_turn(0, expected[0]["ids"] + answer) is None
    assert end_of_turn.calls[0] == expected[0]["calls"] and end_of_turn.turns[0] == 1
    assert end_of_turn(2, answer) is None and end_of_turn.calls[2] == 0


class Counter:
    """An environment: a counter the model increments."""

    def reset(self, **row):
        self.value = 0

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.value += by
        return self.value


def test_tool_turns_call_each_row_s_own_environment(tmp_path):
    from test_tools import checkpoint
    from rlcore.tools.toolbox import Toolbox
    from rlcore.tools.turns import ToolTurns

    ours, _ = checkpoint(tmp_path, "qwen2_5")
    toolbox = Toolbox([], environment_factory=Counter)
    environments = toolbox.environments(2)
    for environment in environments:
        environment.reset()
    end_of_turn = ToolTurns(toolbox, ours, rows=2, environments=environments)
    completions = [[], []]
    for row, by in ((0, 3), (1, 5), (0, 4)):  # row 0's second turn follows its first turn's tool result
        text = f'<tool_call>\n{{"name": "increment", "arguments": {{"by": {by}}}}}\n</tool_call><|im_end|>'
        completions[row] += ours.encode(text, add_special_tokens=False)
        suffix = end_of_turn(row, completions[row])
        completions[row] += suffix
        assert f"<tool_response>\n{environments[row].value}\n</tool_response>" in ours.decode(suffix)
    assert [environment.value for environment in environments] == [7, 5]
    assert end_of_turn.calls == [2, 1] and end_of_turn.failures == [0, 0]


def test_the_static_step_with_appended_ids_compiles_in_one_graph(monkeypatch):
    """What a CUDA graph needs of the multi-turn step: torch.compile(fullgraph=True) traces it with
    the forced-token lookup, and the compiled step gives the eager step's rollout bit for bit."""
    model = rlcore_model(make_hf_model("qwen3"))
    use_static_step(monkeypatch)

    def run():
        return generate(model, random_prompts([6, 3, 5], seed=1), 2, 24, eos_token_ids=EOS, pad_token_id=PAD,
                        temperature=0.8, top_k=20, repetition_penalty=1.2, generator=torch.Generator().manual_seed(0),
                        end_of_turn=first_turn_only())

    eager = run()
    assert (eager.tool_mask == 0).any()
    compiled = torch.compile(engine.decode_one_token, fullgraph=True, backend="aot_eager")
    compiled_steps = []
    monkeypatch.setattr(engine, "decode_one_token", lambda *a: compiled_steps.append(1) or compiled(*a))
    torch._dynamo.reset()
    got = run()
    assert len(compiled_steps) == 23
    for field in ("completion_ids", "completion_mask", "sampling_logprobs", "full_logprobs", "tool_mask"):
        assert torch.equal(getattr(got, field), getattr(eager, field)), field
