"""Training with tools (rollout.tools): the options (TRL's names), their errors, the tool mask in the
loss and the dapo token count, and the tools/* metrics. A tiny random Qwen2 checkpoint with TRL's
Qwen2.5 chat template; the fixed-rollout runs replace sampling with turns that call a tool, ended
by the real ToolTurns, so the counts and the appended tool results are the loop's own."""

import json
from pathlib import Path

import pytest
import torch
import trl

import rlcore.rollout
import rlcore.rollout.completions
import rlcore.train
from rlcore import ConfigError
from rlcore.cli import DEFAULT_CONFIG
from rlcore.config import load_config
from rlcore.data.datasets import load_examples
from rlcore.config.options import RolloutArgs
from rlcore.run.setup import load_toolbox
from rlcore.models.tokenizer import Tokenizer
from rlcore.train import train

from conftest import fixed_rollout, make_hf_model
from test_tokenizer import qwen_checkpoint

TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 over a small BPE vocabulary, whose prompts with the tool schema are ~700 tokens."""
    path = qwen_checkpoint(tmp_path_factory.mktemp("qwen") / "qwen2_5", TEMPLATE)
    tok = Tokenizer.from_dir(path)
    model = make_hf_model("qwen2", vocab_size=512, max_position_embeddings=1024)
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(path)
    return path


def config(model_dir, run, *overrides):
    return load_config(DEFAULT_CONFIG, [
        f"model.path={model_dir}", "train.device=cpu", "data.num_train=64", "data.num_eval=4",
        "data.max_prompt_length=1000",
        "rollout.num_generations=4", "rollout.max_completion_length=48", "train.per_device_train_batch_size=8",
        "train.max_steps=1", "train.eval_steps=0", "train.save_steps=0", "train.eval_max_completion_length=4",
        "loss.reward_funcs=['conftest:token_reward']", f"rollout.tools=['{__name__}:add']",
        f"train.output_dir={run}", *overrides])


def call(name: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": 2, "b": 3}}}}\n</tool_call>'


def tool_calling_generate(tok: Tokenizer, record: list):
    """A stand-in for rollout.generate: row i's first turn calls `add` (i % 4 == 2), an unknown tool
    (i % 4 == 0) or nothing (odd i); a row that called gets end_of_turn's ids, then a second turn
    "5" + EOS. The held-out evaluation's calls (greedy) go to the engine. Records (completion, the
    model's own token count, the tool-result ids, the tool mask) per row."""
    eos, real = tok.eos_token_ids[0], rlcore.rollout.generate

    def generate(model, prompts, *args, end_of_turn=None, max_turns=None, **kwargs):
        if kwargs["temperature"] == 0.0:  # the held-out evaluation decodes for real
            return real(model, prompts, *args, end_of_turn=end_of_turn, max_turns=max_turns, **kwargs)
        completions, masks = [], []
        for row in range(len(prompts)):
            text = {0: call("subtract"), 2: call("add")}.get(row % 4, "no call")
            first = tok.encode(text, add_special_tokens=False) + [eos]
            suffix = end_of_turn(row, first) or []
            second = tok.encode("5", add_special_tokens=False) + [eos] if suffix else []
            completions.append(first + suffix + second)
            masks.append([1] * len(first) + [0] * len(suffix) + [1] * len(second))
            record.append((completions[-1], len(first) + len(second), suffix, masks[-1]))
        ro = fixed_rollout(prompts, completions, eos, tok.pad_token_id)
        width = ro.completion_ids.shape[1]
        ro.tool_mask = torch.tensor([m + [1] * (width - len(m)) for m in masks])
        return ro

    return generate


def test_tool_results_are_out_of_the_loss_and_the_dapo_token_count(model_dir, tmp_path, monkeypatch):
    tok, record, seen = Tokenizer.from_dir(model_dir), [], {}
    monkeypatch.setattr(rlcore.rollout.completions, "generate", tool_calling_generate(tok, record))
    real_loss, real_aggregate = rlcore.train.policy_loss, rlcore.train.aggregate_loss

    def policy_loss(logp, old, adv, mask, **kwargs):
        seen.setdefault("masks", []).append(mask.clone())
        return real_loss(logp, old, adv, mask, **kwargs)

    def aggregate_loss(per_token, mask, loss_type, **kwargs):
        seen["step_tokens"] = kwargs["step_tokens"]
        return real_aggregate(per_token, mask, loss_type, **kwargs)

    monkeypatch.setattr(rlcore.train, "policy_loss", policy_loss)
    monkeypatch.setattr(rlcore.train, "aggregate_loss", aggregate_loss)
    train(config(model_dir, tmp_path / "run"))
    own = sum(count for _, count, *_ in record)
    assert seen["step_tokens"] == own  # the tool results' tokens are not counted
    mask = torch.cat(seen["masks"])  # the rows in the micro-batches' shuffled order
    width = mask.shape[1]
    assert sorted(tuple(tool_mask + [0] * (width - len(tool_mask))) for *_, tool_mask in record) == \
        sorted(tuple(row) for row in mask.long().tolist())
    tool_results = sum(len(suffix) for _, _, suffix, _ in record)
    assert tool_results > 0 and sum(len(c) for c, *_ in record) == own + tool_results


def test_tool_metrics_count_calls_failures_turns_and_users(model_dir, tmp_path, monkeypatch):
    tok, record = Tokenizer.from_dir(model_dir), []
    monkeypatch.setattr(rlcore.rollout.completions, "generate", tool_calling_generate(tok, record))
    run = tmp_path / "run"
    train(config(model_dir, run))
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    # half the rows call once, and half of those name a tool that does not exist
    assert row["tools/call_frequency"] == 0.5 and row["tools/failure_frequency"] == 0.5
    assert row["tools/turns"] == 0.5 and row["tools/used_frac"] == 0.5
    assert row["completion/len_mean"] == sum(count for _, count, *_ in record) / len(record)
    unknown = tok.decode(record[0][2])
    assert "Tool subtract not found." in unknown and "5" in tok.decode(record[2][2])


def test_tool_options_load_from_trls_flat_names(tmp_path):
    path = tmp_path / "trl.toml"
    path.write_text(f'tools = ["{__name__}:add"]\nenvironment_factory = "envs:Game"\n'
                    f'max_tool_calling_iterations = 3\n')
    rollout = load_config(str(path)).rollout
    assert (rollout.tools, rollout.environment_factory, rollout.max_tool_calling_iterations) == \
        ([f"{__name__}:add"], "envs:Game", 3)


@pytest.mark.parametrize("name, message", [("no_such_module_xyz:add", "cannot be imported"),
                                           (f"{__name__}:subtract", "has no"),
                                           ("add", "is not 'module:name'")])
def test_a_bad_tool_name_is_an_error_naming_it(model_dir, name, message):
    with pytest.raises(ValueError, match=message) as err:
        load_toolbox(RolloutArgs(tools=[name]), Tokenizer.from_dir(model_dir), model_dir)
    assert name in str(err.value)


def test_tools_without_a_chat_template_are_an_error_naming_the_fix(tmp_path):
    path = qwen_checkpoint(tmp_path / "plain")
    with pytest.raises(ValueError, match="needs a chat template"):
        load_toolbox(RolloutArgs(tools=[f"{__name__}:add"]), Tokenizer.from_dir(path), path)


def test_tools_need_chat_prompts_and_a_sane_iteration_limit(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="data.use_chat_template = true") as err:
        config(model_dir, tmp_path / "run", "data.use_chat_template=false")
    with pytest.raises(ConfigError, match="max_tool_calling_iterations = -1"):
        config(model_dir, tmp_path / "run", "rollout.max_tool_calling_iterations=-1")
    assert "rollout.tools" in str(err.value)


def test_a_sampled_run_with_tools_decodes_through_end_of_turn(model_dir, tmp_path, monkeypatch):
    calls, real = [], rlcore.rollout.generate

    def generate(*args, **kwargs):
        calls.append(kwargs.get("end_of_turn"))
        return real(*args, **kwargs)

    monkeypatch.setattr(rlcore.rollout.completions, "generate", generate)
    run = tmp_path / "run"
    train(config(model_dir, run, "rollout.max_tool_calling_iterations=2"))
    # the held-out evaluation before and after training, and the round, each with tool turns
    assert len(calls) == 3 and all(isinstance(turns, rlcore.train.ToolTurns) for turns in calls)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert {"tools/call_frequency", "tools/failure_frequency", "tools/turns", "tools/used_frac"} <= set(row)
    evaluations = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert all({"eval/tools/used_frac", "eval/tools/call_frequency"} <= set(e) for e in evaluations)


class Counter:
    """An environment: reset appends a line to the prompt; `bump` is its tool."""

    def reset(self, **row) -> str:
        self.total = 0
        return " Use the counter."

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.total += by
        return self.total


def chat_data(tmp_path) -> Path:
    """A JSONL dataset of chat prompts (an environment needs messages)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Count to {i}."}], "answer": str(i)})
                            + "\n" for i in range(12)))
    return data


REWARDED = []  # the environments environment_reward was given, per call


def environment_reward(completions, environments, **kwargs):
    """The environments' counters."""
    REWARDED.append(list(environments))
    return [float(environment.total) for environment in environments]


def test_each_completion_gets_a_reset_environment_and_its_prompt(model_dir, tmp_path, monkeypatch):
    data = chat_data(tmp_path)
    REWARDED.clear()
    tok, record, seen = Tokenizer.from_dir(model_dir), [], []
    fake = tool_calling_generate(tok, record)

    def generate(model, prompts, *args, end_of_turn=None, **kwargs):
        if kwargs["temperature"] != 0.0:  # the round, not a held-out evaluation
            seen.append((prompts, end_of_turn))
        return fake(model, prompts, *args, end_of_turn=end_of_turn, **kwargs)

    monkeypatch.setattr(rlcore.rollout.completions, "generate", generate)
    train(config(model_dir, tmp_path / "run", "data.task=jsonl", f"data.path={data}",
                 f"rollout.environment_factory={__name__}:Counter",
                 f"loss.reward_funcs=['conftest:token_reward', '{__name__}:environment_reward']"))
    (prompts, turns), = seen
    environments = turns.environments
    assert len({id(environment) for environment in environments}) == len(prompts) == 8
    assert all(isinstance(environment, Counter) for environment in environments)
    text = tok.decode(prompts[0])
    assert "Use the counter." in text and '"name": "bump"' in text and '"name": "add"' in text
    # the reward functions get the rows' environments (TRL's environments=); each held-out evaluation
    # gets its 4 prompts' own, from the same pool, reset for them
    assert REWARDED == [environments[:4], environments, environments[:4]]


class Scored(Counter):
    """An environment that scores its rollouts (TRL's get_reward): the number its prompt counts to."""

    def reset(self, **row) -> None:
        self.total, self.target = 0, float(row["answer"])

    def get_reward(self) -> float:
        return self.target + self.total


def test_an_environment_s_get_reward_is_one_more_reward_of_weight_1_named_after_its_class(
        model_dir, tmp_path, monkeypatch):
    """As TRL: get_reward's scores are a reward column named after the class, weighted 1 after
    loss.reward_weights, in the advantages, the metrics and the held-out evaluation."""
    monkeypatch.setattr(rlcore.rollout.completions, "generate", tool_calling_generate(Tokenizer.from_dir(model_dir), []))
    run = tmp_path / "run"
    cfg = config(model_dir, run, "data.task=jsonl", f"data.path={chat_data(tmp_path)}", "train.log_completions=true",
                 f"rollout.environment_factory={__name__}:Scored", "loss.reward_weights=[2.0]")
    held_out = [float(row["answer"]) for row in load_examples(cfg.data)[1]]
    train(cfg)
    records = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    for record in records:  # the prompt "Count to i." scores i; no row calls bump
        assert record["rewards"]["Scored"] == float(record["prompt"][0]["content"].split()[-1].rstrip("."))
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    weighted = [2.0 * record["rewards"]["conftest:token_reward"] + record["rewards"]["Scored"] for record in records]
    assert row["reward/Scored/mean"] == pytest.approx(sum(r["rewards"]["Scored"] for r in records) / len(records))
    assert row["reward/mean"] == pytest.approx(sum(weighted) / len(weighted))
    evaluation = json.loads((run / "eval.jsonl").read_text().splitlines()[0])
    assert evaluation["eval/reward/Scored/mean"] == pytest.approx(sum(held_out) / len(held_out))


def test_an_environment_that_scores_is_reward_enough_and_one_that_does_not_is_an_error(
        model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(rlcore.rollout.completions, "generate", tool_calling_generate(Tokenizer.from_dir(model_dir), []))
    data = chat_data(tmp_path)
    run = tmp_path / "run"
    train(config(model_dir, run, "data.task=jsonl", f"data.path={data}", f"rollout.environment_factory={__name__}:Scored",
                 "loss.reward_funcs=[]"))
    assert "reward/Scored/mean" in json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    with pytest.raises(ValueError, match="has no get_reward method: nothing scores the completions"):
        train(config(model_dir, tmp_path / "other", "data.task=jsonl", f"data.path={data}",
                     f"rollout.environment_factory={__name__}:Counter", "loss.reward_funcs=[]"))


def test_reward_functions_get_a_completion_of_several_turns_as_its_messages(model_dir, tmp_path, monkeypatch):
    """TRL's shape: the assistant turn with its tool_calls, the tool message, the final turn."""
    monkeypatch.setattr(rlcore.rollout.completions, "generate", tool_calling_generate(Tokenizer.from_dir(model_dir), []))
    run = tmp_path / "run"
    train(config(model_dir, run, "train.log_completions=true"))
    records = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    called = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    assert records[2]["completion"] == [{"role": "assistant", "content": "", "tool_calls": [called]},
                                        {"role": "tool", "name": "add", "content": "5"},
                                        {"role": "assistant", "content": "5"}]
    assert records[1]["completion"] == [{"role": "assistant", "content": "no call"}]


class Verbose(Counter):
    def reset(self, **row) -> str:
        return " many words" * 200


def test_a_prompt_that_reset_makes_too_long_is_an_error_naming_the_limit(model_dir, tmp_path):
    data = chat_data(tmp_path)
    with pytest.raises(ValueError, match="Verbose.reset appended, over data.max_prompt_length = 1000"):
        train(config(model_dir, tmp_path / "run", "data.task=jsonl", f"data.path={data}",
                     f"rollout.environment_factory={__name__}:Verbose"))


def test_the_overlong_punishment_counts_the_models_tokens_and_dynamic_sampling_keeps_the_tool_counts(
        model_dir, tmp_path, monkeypatch):
    """soft_overlong_punishment with tools gets the tool mask and scores the model's own tokens (the
    length the trainer counts, completions.jsonl's `length`), not the tool results in completion_ids;
    through dynamic sampling's round the tools/* metrics are the rows' own."""
    from rlcore.rewards.lengths import overlong_punishment

    tok, record = Tokenizer.from_dir(model_dir), []
    monkeypatch.setattr(rlcore.rollout.completions, "generate", tool_calling_generate(tok, record))
    run = tmp_path / "run"
    train(config(model_dir, run, "loss.reward_funcs=['soft_overlong_punishment']", "loss.soft_punish_cache=40",
                 "loss.soft_punish_max_completion_len=100", "rollout.filter_groups=true", "train.log_completions=true",
                 "train.num_completions_to_print=0"))
    logged = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["length"] for r in logged] == [own for _, own, *_ in record]
    assert [r["rewards"]["soft_overlong_punishment"] for r in logged] == \
        pytest.approx([overlong_punishment(own, 100, 40) for _, own, *_ in record])
    assert any(overlong_punishment(len(ids), 100, 40) != overlong_punishment(own, 100, 40) for ids, own, *_ in record)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["dynamic_sampling/groups_kept"] == 2 and row["dynamic_sampling/gen_batches"] == 1
    assert row["tools/call_frequency"] == 0.5 and row["tools/failure_frequency"] == 0.5 and row["tools/turns"] == 0.5
