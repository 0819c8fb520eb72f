"""The embedded tool task (configs/calculator.toml): the multiplication problems, the calculator
tool, the tool model's chat template against transformers', its warm start's demonstrations
against what a rollout builds, and the config's run with tools in training and evaluation."""

import json
import random
from pathlib import Path

import pytest

from rlcore.config import load_config
from rlcore.data.datasets import format_prompt
from rlcore.models.embedded import build_embedded_model, cache_dir_name, calculator_demos, write_char_tokenizer
from rlcore.data.tasks import calculator, multiplication_problems, unique_problems
from rlcore.models.tokenizer import Tokenizer
from rlcore.tools.calls import tool_call_format
from rlcore.tools.schema import tool_schema
from rlcore.tools.toolbox import Toolbox
from rlcore.tools.turns import ToolTurns, is_prefix_preserving
from rlcore.train import train

transformers = pytest.importorskip("transformers")

CONFIG = str(Path(__file__).parent.parent / "configs" / "calculator.toml")


def test_the_problems_are_every_two_by_three_digit_product_of_five_digits():
    problems = multiplication_problems(random.Random(0))
    expected = {(a, b) for a in range(10, 100) for b in range(100, 1000) if a * b >= 10_000}  # 99*999 < 100,000
    assert {(p["a"], p["b"]) for p in problems} == expected and len(problems) == len(expected)
    assert all(p["prompt"] == f"{p['a']}*{p['b']}" and p["answer"] == str(p["a"] * p["b"]) for p in problems)


def test_the_calculator_computes_as_python_and_has_transformers_schema():
    from transformers.utils import get_json_schema

    assert calculator("37*482") == str(37 * 482) and calculator("(7+5)/8") == "3/2"
    assert tool_schema(calculator) == get_json_schema(calculator)
    with pytest.raises(ValueError, match="only integers"):
        calculator("__import__('os')")


def conversation() -> list[dict]:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*482"}}}
    return [{"role": "user", "content": "37*482"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": "17834"}, {"role": "assistant", "content": "=17834"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool-tokenizer")
    write_char_tokenizer(path, chat=True)
    return path


@pytest.mark.parametrize("cut", [1, 2, 4])
def test_the_tool_models_template_renders_as_transformers_renders_it(tokenizer_dir, cut):
    ours = Tokenizer.from_dir(tokenizer_dir)
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    tools = [tool_schema(calculator)]
    messages = conversation()[:cut]
    prompt = cut % 2 == 1  # ends with a user or tool message: the generation prompt follows
    assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt, tokenize=True) == \
        ref.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt, tokenize=True, return_dict=False)
    assert ours.decode(ref.encode("<tool_call>\n{\"name\"")) == "<tool_call>\n{\"name\""  # tags kept in text


def test_the_tool_models_template_writes_qwen_calls_and_is_prefix_preserving(tokenizer_dir):
    tok = Tokenizer.from_dir(tokenizer_dir)
    assert tool_call_format(tok) == "qwen" and is_prefix_preserving(tok)


def test_a_demonstration_that_calls_is_the_sequence_a_rollout_builds(tokenizer_dir):
    """The prompt as the loop renders it, the call's turn, then the ids ToolTurns appends after it
    (masked out of the SFT loss), then the answer."""
    tok = Tokenizer.from_dir(tokenizer_dir)
    examples = unique_problems("multiplication", 6, 0)
    prompts, completions, masks = calculator_demos(tok, examples, tool_every=3)
    for i, (ex, prompt, completion, mask) in enumerate(zip(examples, prompts, completions, masks)):
        assert prompt == format_prompt(ex, tok, tools=[tool_schema(calculator)])
        answer = tok.encode(f"={ex['answer']}") + [tok.eos_token_id]
        if i % 3:
            assert completion == answer and mask == [1] * len(answer)
            continue
        turn = completion[:completion.index(tok.eos_token_id) + 1]
        assert tok.decode(turn, skip_special_tokens=True) == \
            f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{ex["prompt"]}"}}}}\n</tool_call>'
        turns = ToolTurns(Toolbox([calculator]), tok, 1)
        appended = turns(0, turn)
        assert completion == turn + appended + answer
        assert mask == [1] * len(turn) + [0] * len(appended) + [1] * len(answer)
        assert f"<tool_response>\n{ex['answer']}\n</tool_response>" in tok.decode(appended)


def test_the_calculator_config_trains_and_evaluates_with_the_tool(tmp_path, monkeypatch):
    """configs/calculator.toml on a tool model of a few SFT steps: the rounds and the held-out
    evaluations decode through the calculator and log how often it was called."""
    cache, num_eval = tmp_path / "cache", 8
    pool = unique_problems("multiplication", 10**6, 0)[num_eval:]
    build_embedded_model(cache / cache_dir_name(0, num_eval, "multiplication"), pool, task="multiplication",
                         steps=2, batch_size=8, problems=64, threads=1)
    monkeypatch.setenv("RLCORE_CACHE", str(cache))
    run = tmp_path / "run"
    result = train(load_config(CONFIG, [f"data.num_eval={num_eval}", "train.max_steps=2", "train.eval_steps=1",
                                        "train.per_device_train_batch_size=16", f"train.output_dir={run}"]))
    assert result["before"] is not None and result["after"] is not None
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= row["tools/used_frac"] <= 1.0 for row in rows)
    evaluations = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evaluations] == [0, 1, 2]
    assert all("eval/tools/used_frac" in e for e in evaluations)
