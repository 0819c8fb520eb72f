"""The chat template of a run with tools, against TRL 1.16's GRPOTrainer: where the model's template
is not prefix-preserving (Qwen3's drops an earlier assistant turn's empty <think> block once a tool
message follows), GRPOTrainer.__init__ renders with get_training_chat_template's instead, and so
does rlcore (rlcore/models/chat_templates, run.setup.load_toolbox): the tool results, the prompts, the
held-out prompts. The checkpoints are tiny ones with TRL's stock templates (test_tools.checkpoint).
"""

import json
from types import SimpleNamespace

import pytest

import rlcore.rollout
import rlcore.rollout.completions
from rlcore.data.datasets import format_prompt
from rlcore.config.options import RolloutArgs
from rlcore.run.setup import load_toolbox
from rlcore.models.tokenizer import Tokenizer
from rlcore.tools.turns import CHAT_TEMPLATES, tool_suffix_ids
from rlcore.train import train

from conftest import make_hf_model
from test_tokenizer import qwen_checkpoint
from test_tools import TRL_TEMPLATES, add, checkpoint, describe
import test_train_tools
from test_train_tools import config, tool_calling_generate

from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving  # after
from trl.trainer.grpo_trainer import GRPOTrainer  # test_tools' importorskip, which skips without TRL

TOOLS = [f"{__name__}:add", f"{__name__}:describe"]
# a history turn: Qwen3's own template renders it without <think></think>, the training template with
HISTORY = [{"role": "user", "content": "What is 7 + 2?"}, {"role": "assistant", "content": "Let me add."},
           {"role": "user", "content": "Go on."}]


def trl_chat_template(ref) -> str | None:
    """The template GRPOTrainer.__init__ renders with when it has tools (None: the tokenizer's own)."""
    return get_training_chat_template(ref) if not is_chat_template_prefix_preserving(ref) else None


def trl_suffix_ids(ref, messages: list[dict], **chat_template_kwargs) -> list[int]:
    """GRPOTrainer._get_tool_suffix_ids on a stand-in holding the attributes it reads."""
    trainer = SimpleNamespace(processing_class=ref, _is_vlm=False, _tokenizer=ref, chat_template=trl_chat_template(ref),
                              chat_template_kwargs=chat_template_kwargs)
    return GRPOTrainer._get_tool_suffix_ids(trainer, messages)


def trl_prompt_ids(ref, prompt: list[dict], tools: list, **chat_template_kwargs) -> list[int]:
    """A prompt as GRPOTrainer tokenizes it (_generate's apply_chat_template)."""
    return ref.apply_chat_template(conversation=[prompt], tools=tools, chat_template=trl_chat_template(ref),
                                   add_generation_prompt=True, tokenize=True, return_dict=True,
                                   **chat_template_kwargs)["input_ids"][0]


def test_the_shipped_templates_are_trls_byte_for_byte():
    """TRL recognises a template by its exact text; so does rlcore, with TRL's files."""
    shipped = sorted(CHAT_TEMPLATES.glob("*.jinja"))
    assert [path.name for path in shipped] == ["qwen3.jinja", "qwen3_training.jinja"]
    for path in shipped:
        assert path.read_bytes() == (TRL_TEMPLATES / path.name).read_bytes()


@pytest.mark.parametrize("template", ["qwen3", "qwen3_training", "qwen3_instruct_2507", "qwen2_5", "llama3_1",
                                      "llama3_2"])
def test_a_run_with_tools_renders_with_the_template_trl_chooses(tmp_path, capsys, template):
    """Qwen3's own template is swapped for TRL's training template, with one line saying so; the
    prefix-preserving ones are kept, as GRPOTrainer keeps them."""
    ours, ref = checkpoint(tmp_path, template)
    load_toolbox(RolloutArgs(tools=TOOLS), ours, tmp_path)
    chosen = trl_chat_template(ref)
    assert ours.chat_template == (chosen or ref.chat_template)
    assert (chosen is None) is (template != "qwen3")  # the case the swap is for is among them
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == (0 if chosen is None else 1)


def test_qwen3s_template_in_tokenizer_config_json_is_recognised_too(tmp_path):
    """Qwen3 checkpoints on the Hub keep it there rather than in chat_template.jinja."""
    path = qwen_checkpoint(tmp_path / "qwen3", (TRL_TEMPLATES / "qwen3.jinja").read_text(), template_in_config=True)
    assert not (path / "chat_template.jinja").exists()
    ours, ref = Tokenizer.from_dir(path), pytest.importorskip("transformers").AutoTokenizer.from_pretrained(path)
    load_toolbox(RolloutArgs(tools=TOOLS), ours, path)
    assert ours.chat_template == trl_chat_template(ref) == (TRL_TEMPLATES / "qwen3_training.jinja").read_text()


@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("contents", [["9"], ["9", "{'error': 'Tool subtract not found.'}"]])
def test_with_qwen3s_template_tool_suffix_ids_equal_trls(tmp_path, enable_thinking, contents):
    ours, ref = checkpoint(tmp_path, "qwen3")
    load_toolbox(RolloutArgs(tools=TOOLS), ours, tmp_path)
    messages = [{"role": "tool", "name": "add", "content": content} for content in contents]
    suffix = tool_suffix_ids(ours, messages, enable_thinking=enable_thinking)
    assert suffix == trl_suffix_ids(ref, messages, enable_thinking=enable_thinking)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_with_qwen3s_template_prompts_with_tools_are_trls(tmp_path, enable_thinking):
    ours, ref = checkpoint(tmp_path, "qwen3")
    toolbox = load_toolbox(RolloutArgs(tools=TOOLS), ours, tmp_path)
    kwargs = {"enable_thinking": enable_thinking}
    ids = format_prompt({"prompt": HISTORY}, ours, chat_template_kwargs=kwargs, tools=toolbox.schemas)
    assert ids == trl_prompt_ids(ref, HISTORY, [add, describe], **kwargs)
    own = ref.apply_chat_template(HISTORY, tools=[add, describe], add_generation_prompt=True, tokenize=True,
                                  return_dict=False, **kwargs)
    assert ids != own  # the history turn tells the two templates apart


def test_a_template_that_is_not_prefix_preserving_and_not_trls_is_an_error_before_the_model_loads(tmp_path):
    """Qwen3's template with a local edit: TRL has no training template for it, nor has rlcore."""
    path = qwen_checkpoint(tmp_path / "edited", "{#- a local edit -#}\n" + (TRL_TEMPLATES / "qwen3.jinja").read_text())
    ref = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(path)
    with pytest.raises(ValueError, match="not training-compatible"):
        trl_chat_template(ref)
    with pytest.raises(ValueError, match="qwen3_training.jinja") as err:
        load_toolbox(RolloutArgs(tools=TOOLS), Tokenizer.from_dir(path), path)
    assert "rollout.tools" in str(err.value)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 with Qwen3's own chat template."""
    path = qwen_checkpoint(tmp_path_factory.mktemp("qwen3") / "qwen3", (TRL_TEMPLATES / "qwen3.jinja").read_text())
    tok = Tokenizer.from_dir(path)
    model = make_hf_model("qwen3", vocab_size=512, max_position_embeddings=1024)
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(path)
    return path


def test_a_run_with_tools_on_qwen3_renders_prompts_and_tool_results_as_trl(qwen3_dir, tmp_path, monkeypatch, capsys):
    """One step: the prompts (the held-out evaluation's too) and the tool results appended are
    what GRPOTrainer renders with its training template; Qwen3's own could not render the results."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [*HISTORY[:2], {"role": "user", "content": f"Now add {i}."}],
                                        "answer": str(i)}) + "\n" for i in range(12)))
    ours, record, seen = Tokenizer.from_dir(qwen3_dir), [], []
    fake = tool_calling_generate(ours, record)

    def generate(model, prompts, *args, **kwargs):
        seen.append(prompts)
        return fake(model, prompts, *args, **kwargs)

    monkeypatch.setattr(rlcore.rollout.completions, "generate", generate)
    run = tmp_path / "run"
    train(config(qwen3_dir, run, "data.task=jsonl", f"data.path={data}"))
    assert sum("not prefix-preserving" in line for line in capsys.readouterr().out.splitlines()) == 1

    ref = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(qwen3_dir)
    rows = [json.loads(line)["prompt"] for line in data.read_text().splitlines()]
    rendered = {tuple(trl_prompt_ids(ref, prompt, [test_train_tools.add])) for prompt in rows}  # config's tool
    prompts = [tuple(prompt) for batch in seen for prompt in batch]
    assert len(seen) >= 2 and set(prompts) <= rendered  # the training rollout's and the evaluations'
    assert [suffix for _, _, suffix, _ in record if suffix] == \
        [trl_suffix_ids(ref, [{"role": "tool", "name": name, "content": content}])
         for name, content in [("subtract", str({"error": "Tool subtract not found."})), ("add", "5")] * 2]
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["tools/call_frequency"] == 0.5 and row["tools/failure_frequency"] == 0.5
    # the checkpoint keeps the model's own template, as GRPOTrainer saves its processing_class's
    (saved,) = run.glob("checkpoint-*/model/chat_template.jinja")
    assert saved.read_text() == ref.chat_template == (TRL_TEMPLATES / "qwen3.jinja").read_text()
