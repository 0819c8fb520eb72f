"""The loop with tools against TRL's GRPOTrainer with the same `tools`, step for step: the same
checkpoint, chat prompts and model outputs give the same sequences (prompt, the model's turns and
the tool results between them), the same tool mask, the same losses, gradient norms, learning rates
and trained weights, and the same tools/* metrics.

test_train_trl.py's harness, extended to several turns. Only the model's token choice is scripted:
each row of each round has a list of turns (token ids, each ended by EOS but a truncated one). On
rlcore's side the real engine decodes, ToolTurns parses the calls, runs the tools and appends their
results; the engine's sampling step emits the row's next scripted id wherever it would sample. On
TRL's side `_generate_single_turn` returns each row's next turn (cut after its EOS and at
max_completion_length, as transformers' generate is) and TRL's own `_tool_call_loop` does the rest.
TRL is given the prompts rlcore's rounds drew, in order, unshuffled, and tokenizes them itself with
the tools' schemas; the micro-batch order is rlcore's, as in test_train_trl.py.

The scripted rows: a correct call, then an answer; an answer without a call; a call to a tool that
does not exist; a call whose tool raises; two calls in one turn; a row that keeps calling past
max_tool_calling_iterations; a row whose answer after a call is cut at max_completion_length; a row
whose call ends its turn too close to max_completion_length for the result to fit, and one whose
result ends exactly there.

Where rlcore differs from TRL (docs/environments.md, "Differences from TRL") the script steps
around it: no row writes a malformed call (rlcore answers it with its error and counts a failure,
TRL reads the turn as plain text and the conversation ends: test_tools.py pins it), no turn is cut
by max_completion_length after a complete call (TRL still parses, runs and counts that call before
it drops the result; rlcore ends the row without running it), and the model's positions cover
every sequence (TRL drops a tool result that would reach max_position_embeddings; rlcore only warns
at setup). The last two tests pin these two.
"""

import json

import pytest
import torch

from conftest import make_hf_model, toml_value, token_reward
from rlcore.config import load_config
from rlcore.models.tokenizer import Tokenizer
from rlcore.tools.turns import tool_suffix_ids
from test_tokenizer import qwen2_pipeline_checkpoint
from test_train_trl import MARGIN, Thresholds, shuffle_as_rlcore

trl = pytest.importorskip("trl", reason="TRL is the reference")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

G, T = 4, 320  # group size; completion tokens at most (a call is ~65 tokens, its result ~50)
ITERATIONS = 2  # max_tool_calling_iterations
COMMON = {"num_generations": G, "max_completion_length": T, "learning_rate": 0.01, "seed": 7,
          "per_device_train_batch_size": 4, "max_tool_calling_iterations": ITERATIONS}

# TRL GRPOConfig keys, given to both; each runs the script's two rounds of 2 prompts x G.
CASES = {
    "trl defaults (dapo, on-policy, linear decay), clipping": dict(
        max_steps=2, gradient_accumulation_steps=2, lr_scheduler_type="linear", max_grad_norm=0.05),
    "grpo, mu = 2, beta, masked truncations": dict(
        max_steps=4, loss_type="grpo", gradient_accumulation_steps=2, num_iterations=2, beta=0.04,
        use_bias_correction_kl=False, epsilon=0.25, mask_truncated_completions=True, temperature=0.7,
        lr_scheduler_type="constant"),
}


CALLED = []  # the tools' calls that ran, either side's


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    CALLED.append(("add", a, b))
    return a + b


def divide(a: int, b: int) -> float:
    """Divide two integers.

    Args:
        a: The dividend.
        b: The divisor.
    """
    CALLED.append(("divide", a, b))
    return a / b


TOOLS = [add, divide]


Script = list[list[list[list[int]]]]  # [round][row][turn] -> the model's token ids in that turn


def call(name: str, a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


class Turns:
    """The model's turns as token ids (`tok`: rlcore's Tokenizer): text + EOS, or text cut at T without EOS."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]

    def cut(self, text: str, length: int = T) -> list[int]:
        """`text` as its last `length` ids, with filler before it: a turn max_completion_length cuts."""
        ids = self.tok.encode(text, add_special_tokens=False)
        return self.tok.encode("so " * length, add_special_tokens=False)[:length - len(ids)] + ids

    def script(self) -> Script:
        t = self
        long = t.cut("and the end")  # T ids, no EOS
        eos = self.tok.eos_token_id
        full = t.cut(call("add", 6, 7), T - 3) + [eos]  # ends 2 ids before T
        result = tool_suffix_ids(self.tok, [{"role": "tool", "name": "add", "content": "13"}])
        exact = t.cut(call("add", 6, 7), T - len(result) - 1) + [eos]  # its result ends at T exactly
        first = [
            [t(call("add", 2, 3)), t("It is 5.")],                            # a call, then the answer
            [t("Five.")],                                                     # no call
            [t(call("subtract", 2, 3)), t("Sorry.")],                         # an unknown tool
            [t(call("divide", 1, 0)), t("It cannot be done.")],               # the tool raises
            [t(call("add", 1, 1)), t(call("add", 2, 2)), t(call("add", 3, 3)), t("6.")],  # past the limit
            [t("No tool is needed: 4.")],                                     # no call
            [t(call("add", 4, 5)), long],                                     # the answer cut at T
            [full, t("13.")],                                                 # no room for the result
        ]
        second = [
            [t(call("add", 7, 2) + "\n" + call("divide", 9, 3)), t("9 and 3.")],  # two calls in one turn
            [t(call("add", 1, 2)), t(call("divide", 3, 0)), t("No.")],        # a call, then one that raises
            [t("Three.")],
            [t(call("multiply", 2, 2)), t(call("add", 2, 2)), t("4.")],       # unknown, then a good one
            [long],                                                           # cut at T, no call
            [t(call("add", 5, 5)), t("10.")],
            [exact, t("13.")],                                                # the result fills the rest
            [t(call("divide", 8, 2)), t("4.")],
        ]
        return [first, second]


# the tool results each row of Turns.script gets (runs of 0 in its tool mask), and whether T cut it
RESULTS = [[1, 0, 1, 1, 2, 0, 1, 0], [1, 2, 0, 2, 0, 1, 1, 1]]
CUT = [[False] * 6 + [True, False], [False] * 4 + [True, False, True, False]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 over a small BPE vocabulary with Qwen2's pipeline (transformers rebuilds it for a
    Qwen2 checkpoint, so both sides tokenize alike) and TRL's Qwen2.5 template (tests/chat_templates'); its
    positions cover the ~1000-token prompts (the two tools' schemas) + max_completion_length."""
    path = qwen2_pipeline_checkpoint(tmp_path_factory.mktemp("qwen") / "qwen2_5")
    tok = Tokenizer.from_dir(path)
    model = make_hf_model("qwen2", vocab_size=512, max_position_embeddings=1400)
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(path)
    return path


def chat_data(path, n: int = 8):
    """n chat prompts, as a JSONL dataset."""
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + {i + 1}?"}],
                                        "answer": str(2 * i + 1)}) + "\n" for i in range(n)))
    return path


def script_engine(monkeypatch, script: Script, pad: int):
    """Make rlcore's engine emit row r's next scripted id wherever it samples one (an appended
    tool-result id still takes its slot), with its log-prob under the step's logits. Returns the
    engine's generate, each call of which is the script's next round."""
    import rlcore.rollout.engine as engine

    real_record, real_generate, state = engine.sample_and_record, engine.generate, {"round": -1}

    def sample_and_record(logits, batch, decoding):
        step, todo, pos = int(batch.step), state["todo"], state["pos"]
        forced = (decoding.forced[batch.rows, step] >= 0).tolist()
        tokens = []
        for r, done, appended in zip(batch.rows.tolist(), batch.done.tolist(), forced):
            if done or appended or r >= len(todo):  # r = N: the scratch row of padding rows
                tokens.append(pad)
                continue
            assert pos[r] < len(todo[r]), f"row {r} decodes past its script"
            tokens.append(todo[r][pos[r]])
            pos[r] += 1
        state["tokens"] = torch.tensor(tokens, device=logits.device)
        return real_record(logits, batch, decoding)

    def sample(logits, temperature=1.0, *args, **kwargs):  # sampling.sample's returns
        tokens = state["tokens"]
        logprobs = (logits / (temperature or 1.0)).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        return tokens, logprobs, None

    def generate(*args, **kwargs):
        state["round"] += 1
        state["todo"] = [[i for turn in row for i in turn] for row in script[state["round"]]]
        state["pos"] = [0] * len(state["todo"])
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(engine, "sample_and_record", sample_and_record)
    monkeypatch.setattr(engine, "sample", sample)
    return generate


def run_rlcore(options: dict, model_dir, script: Script, tmp_path, monkeypatch, thresholds: Thresholds | None = None):
    """rlcore's loop on the script, over chat_data's prompts. Returns the prompts each round drew (as
    messages), each round's (prompt ids, completion ids, tool mask) per row, each micro-batch's
    loss, the metrics rows and the trained weights."""
    import rlcore.rollout
    import rlcore.rollout.completions
    import rlcore.run.setup
    import rlcore.train

    data = chat_data(tmp_path / "prompts.jsonl")
    drawn, rollouts, losses = [], [], []
    with monkeypatch.context() as spies:  # rlcore's calls only, not TRL's
        scripted = script_engine(spies, script, Tokenizer.from_dir(model_dir).pad_token_id)

        def generate(model, prompts, *args, **kwargs):
            ro = scripted(model, prompts, *args, **kwargs)
            n = ro.lengths.tolist()
            rollouts.append(([list(p) for p in prompts], [ids[:k].tolist() for ids, k in zip(ro.completion_ids, n)],
                             [m[:k].tolist() for m, k in zip(ro.tool_mask, n)]))
            return ro

        real_turns, real_aggregate = rlcore.run.setup.Run.tool_turns, rlcore.train.aggregate_loss

        def tool_turns(run, rows, **kwargs):
            drawn.append([row["prompt"] for row in rows[::G]])
            return real_turns(run, rows, **kwargs)

        def aggregate_loss(*args, **kwargs):
            loss = real_aggregate(*args, **kwargs)
            losses.append(loss.item())
            return loss

        spies.setattr(rlcore.rollout.completions, "generate", generate)
        spies.setattr(rlcore.run.setup.Run, "tool_turns", tool_turns)
        spies.setattr(rlcore.train, "aggregate_loss", aggregate_loss)
        if thresholds is not None:
            thresholds.watch(spies)
        run = tmp_path / "rlcore"
        tools = [f"{__name__}:{tool.__name__}" for tool in TOOLS]
        cfg = load_config(None, [f"{k}={toml_value(v)}" for k, v in {**COMMON, **options}.items()] + [
            f"model.path={model_dir}", "data.task=jsonl", f"data.path={data}", "data.num_eval=0",
            "data.max_prompt_length=1000", f"rollout.tools={tools}", "loss.reward_funcs=['conftest:token_reward']",
            "train.device=cpu", "train.bf16=false", f"train.output_dir={run}"])
        rlcore.train.train(cfg)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    trained = run / f"checkpoint-{options['max_steps']}" / "model"
    return drawn, rollouts, losses, rows, transformers.AutoModelForCausalLM.from_pretrained(trained).state_dict()


def run_trl(options: dict, model_dir, drawn: list, script: Script, tmp_path, monkeypatch):
    """TRL's GRPOTrainer with tools=TOOLS on the prompts rlcore drew, in its order (unshuffled: the
    sampler repeats each G times in a row, as rlcore does), and on the same script. Returns its
    rollouts and losses (as run_rlcore's), its log history and its trained weights."""
    from datasets import Dataset

    import trl.trainer.grpo_trainer as grpo

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                          use_vllm=False, logging_steps=1, save_strategy="no", shuffle_dataset=False,
                          **COMMON, **options)
    trainer = trl.GRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(model_dir),
                              reward_funcs=token_reward, args=args, processing_class=tok, tools=TOOLS,
                              train_dataset=Dataset.from_list([{"prompt": p} for prompts in drawn for p in prompts]))
    rollouts, losses, state = [], [], {"round": -1}

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Each row's next scripted turn, cut after EOS or at max_completion_length as transformers'
        generate cuts it. A round's first call has every row (num_generations = G); the tool loop's
        have the rows still calling, each a row's history so far + its tool results."""
        if num_generations == G:
            state["round"] += 1
            state["seen"] = [list(ids) for ids in prompt_ids]  # each row's history, as TRL last sent it
            state["turn"] = [0] * len(prompt_ids)
            rows = list(range(len(prompt_ids)))
        else:
            rows = [[r for r, seen in enumerate(state["seen"]) if ids[:len(seen)] == seen] for ids in prompt_ids]
            assert all(len(r) == 1 for r in rows), "a tool-loop sequence continues no row's history, or several"
            rows = [r for (r,) in rows]
            for r, ids in zip(rows, prompt_ids):
                state["seen"][r] = list(ids)
        out = []
        for r in rows:
            out.append(script[state["round"]][r][state["turn"][r]][:T])
            state["turn"][r] += 1
            state["seen"][r] += out[-1]
        return out, None

    real_generate, real_loss = trainer._generate, trainer.compute_loss

    def generate(prompts):
        prompt_ids, completion_ids, tool_mask, *rest = real_generate(prompts)
        rollouts.append(([list(p) for p in prompt_ids], [list(c) for c in completion_ids],
                         [list(m) for m in tool_mask]))
        return (prompt_ids, completion_ids, tool_mask, *rest)

    def compute_loss(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        losses.append(loss.item())
        return loss

    trainer._generate_single_turn, trainer._generate, trainer.compute_loss = single_turn, generate, compute_loss
    monkeypatch.setattr(grpo, "shuffle_sequence_dict", shuffle_as_rlcore(COMMON["seed"]))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    return rollouts, losses, logs, trainer.model.state_dict()


def tool_results(mask: list[int]) -> int:
    """The tool results appended to a completion: the runs of 0 in its tool mask."""
    return sum(m == 0 and (i == 0 or mask[i - 1] == 1) for i, m in enumerate(mask))


TOOL_METRICS = ("tools/call_frequency", "tools/failure_frequency")


@pytest.mark.parametrize("case", CASES)
def test_the_loop_with_tools_trains_as_trls_grpo_trainer_on_the_same_model_outputs(case, model_dir, tmp_path,
                                                                                    monkeypatch):
    options = CASES[case]
    init = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    script = Turns(Tokenizer.from_dir(model_dir)).script()  # the model's token ids, the same for both
    thresholds = Thresholds()
    drawn, ours, our_losses, rows, got = run_rlcore(options, model_dir, script, tmp_path, monkeypatch, thresholds)
    assert thresholds.ratio_margin(options) > MARGIN, (
        f"an importance ratio sits {thresholds.ratio_margin(options):.1e} (relative) from a clip bound: choose "
        f"another epsilon")
    theirs, their_losses, logs, want = run_trl(options, model_dir, drawn, script, tmp_path, monkeypatch)

    assert len(ours) == len(theirs) == 2
    for (prompts, completions, masks), (trl_prompts, trl_completions, trl_masks), results, cut in zip(
            ours, theirs, RESULTS, CUT):
        assert prompts == trl_prompts  # TRL rendered the same prompts, the tools' schemas included
        assert completions == trl_completions  # the model's turns and the tool results between them
        assert masks == trl_masks
        assert [tool_results(mask) for mask in masks] == results  # the script's rows are what they say
        assert [len(c) == T and c[-1] != Tokenizer.from_dir(model_dir).eos_token_id for c in completions] == cut
    assert our_losses == pytest.approx(their_losses, rel=1e-4, abs=1e-7)  # each micro-batch's
    assert len(rows) == len(logs) == options["max_steps"]
    assert [r["grad_norm"] for r in rows] == pytest.approx([h["grad_norm"] for h in logs], rel=1e-4)
    assert [r["lr"] for r in rows] == pytest.approx([h["learning_rate"] for h in logs], rel=1e-6)
    # TRL logs a round's tools/* on its first step; rlcore puts them on every step of the round
    steps_per_round = len(rows) // 2
    assert [r[k] for r in rows[::steps_per_round] for k in TOOL_METRICS] == \
        pytest.approx([h[k] for h in logs if TOOL_METRICS[0] in h for k in TOOL_METRICS], rel=1e-6)
    assert got.keys() == want.keys()
    for name in want:  # each tensor's update agrees to 0.1%, as in test_train_trl.py
        moved = want[name] - init[name]
        assert moved.abs().max() > 1e-3, name  # it trained
        assert (got[name] - init[name] - moved).norm() <= 1e-3 * moved.norm(), name


@pytest.mark.parametrize("cut_inside_a_call", [False, True])
def test_a_turn_max_completion_length_cuts_runs_its_calls_as_in_trl(model_dir, tmp_path, monkeypatch,
                                                                    cut_inside_a_call):
    """A turn cut at max_completion_length. Where its text ends with a complete call, TRL parses
    it, runs the call and counts it, then drops the result (no room), and so does rlcore; where the
    cut falls inside a second call, the turn is plain text to both, and nothing runs. The sequences
    and masks are the same either way, and so are the calls run and tools/call_frequency."""
    t = Turns(Tokenizer.from_dir(model_dir))
    text = call("add", 8, 9) + ("\n" + call("add", 1, 1)[:24] if cut_inside_a_call else "")  # cut in "arguments"
    script = [[[t.cut(text)]] + [[t("Fine.")]] * (2 * G - 1)]  # row 0: T ids, the cut at their end
    options = dict(max_steps=1, gradient_accumulation_steps=2)
    CALLED.clear()
    drawn, ours, _, rows, _ = run_rlcore(options, model_dir, script, tmp_path, monkeypatch)
    ours_called = list(CALLED)
    CALLED.clear()
    theirs, _, logs, _ = run_trl(options, model_dir, drawn, script, tmp_path, monkeypatch)
    assert ours_called == CALLED == ([] if cut_inside_a_call else [("add", 8, 9)])
    assert ours == theirs and ours[0][1][0] == script[0][0][0]  # row 0 ends at the cut, either side
    assert rows[0]["tools/call_frequency"] == logs[0]["tools/call_frequency"] == (0 if cut_inside_a_call else 1 / (2 * G))


def test_a_tool_result_past_the_models_positions_is_dropped_as_trl_drops_it(model_dir, tmp_path, monkeypatch):
    """TRL drops a tool result that would take the sequence to the model's max_position_embeddings
    (its generation backends stop there), as it drops one past max_completion_length, and so does
    rlcore (which also warns at setup when a prompt + max_completion_length passes the model's
    positions). Here prompt + call + result is past them: both end the completion with the call,
    which both ran and counted."""
    import shutil

    from conftest import rewrite_config

    t = Turns(Tokenizer.from_dir(model_dir))
    script = [[[t(call("add", 2, 3)), t("5.")]] + [[t("Fine.")]] * (2 * G - 1)]
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    longest = max(len(hf.apply_chat_template(row["prompt"], tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
                  for row in map(json.loads, chat_data(tmp_path / "all.jsonl").read_text().splitlines()))
    short = shutil.copytree(model_dir, tmp_path / "short")
    rewrite_config(short, max_position_embeddings=longest + len(script[0][0][0]) + 10)  # the call fits, not its result
    options = dict(max_steps=1, gradient_accumulation_steps=2)
    with pytest.warns(UserWarning, match="max_position_embeddings"):  # rlcore's setup warning
        drawn, ours, _, rows, _ = run_rlcore(options, short, script, tmp_path, monkeypatch)
    theirs, _, logs, _ = run_trl(options, short, drawn, script, tmp_path, monkeypatch)
    (_, completions, masks), (_, trl_completions, _) = ours[0], theirs[0]
    assert completions == trl_completions and completions[0] == script[0][0][0]
    assert tool_results(masks[0]) == 0
    assert rows[0]["tools/call_frequency"] == logs[0]["tools/call_frequency"] == 1 / (2 * G)
