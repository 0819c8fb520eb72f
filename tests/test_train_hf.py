"""The loop on a real-format Hugging Face checkpoint: Qwen2 weights + a Qwen2.5-style tokenizer
with its chat template, GSM8K-style JSONL prompts. Everything rlcore writes must load back in
transformers (weights and tokenizer) and agree with rlcore. The shipped GSM8K config runs on it,
and a Llama-style tokenizer (which prepends BOS) gets its stop strings right."""

import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from conftest import make_hf_model, rewrite_config
from rlcore import RlcoreWarning
from rlcore.models.hf_checkpoint import load_model
from rlcore.config import load_config
from rlcore.data.datasets import format_prompt
from rlcore.rewards.scoring import get_reward_funcs
from rlcore.models.tokenizer import Tokenizer
from rlcore.train import train
from test_tokenizer import llama_checkpoint

GSM8K_CONFIG = Path(__file__).parent.parent / "configs" / "qwen2.5-0.5b-gsm8k.toml"

transformers = pytest.importorskip("transformers")


BREVITY_CALLS = []


def brevity(prompts, completions, **columns):
    """Varies within every group of a random model, so advantages are nonzero and weights move.
    Records each call's completions and answers."""
    BREVITY_CALLS.append((completions, columns.get("answer")))
    return [1.0 / (1 + len(c)) for c in completions]


@pytest.fixture
def gsm8k_file(tmp_path):
    return write_gsm8k(tmp_path / "gsm8k.jsonl", range(6))


@pytest.fixture
def gsm8k_eval_file(tmp_path):
    """Other problems than gsm8k_file's: an eval file that is the training file is an error."""
    return write_gsm8k(tmp_path / "gsm8k_test.jsonl", range(6, 8))


def write_gsm8k(f, first_numbers):
    rows = [{"question": f"What is {a} plus {b}?", "answer": f"{a} and {b} make {a + b}.\n#### {a + b}"}
            for a in first_numbers for b in range(4)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


HELD_OUT_SCORES = []


def even_first_number(prompts, completions, **columns):
    """Stands in for the task's accuracy (a random model scores 0, which any count passes): 1 for a
    question whose first number is even, so the held-out count is known; records its scores."""
    texts = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
    HELD_OUT_SCORES.append([float(int(re.search(r"\d+", t).group()) % 2 == 0) for t in texts])
    return HELD_OUT_SCORES[-1]


def test_loop_trains_an_hf_checkpoint_and_writes_one_transformers_loads(qwen_dir, gsm8k_file, tmp_path, monkeypatch):
    import rlcore.train

    # the loop's held-out scorer only (a copy: the config's check of the training rewards keeps the real table)
    judge = {**rlcore.run.setup.TASK_REWARD, "jsonl": f"{__name__}:even_first_number"}
    monkeypatch.setattr(rlcore.run.setup, "TASK_REWARD", judge)
    HELD_OUT_SCORES.clear()
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={gsm8k_file}", "data.prompt_column=question",
        "data.num_eval=4", "data.system_prompt=Answer with a number.", "rollout.num_generations=4",
        "rollout.max_completion_length=6", f"loss.reward_funcs=['accuracy', '{__name__}:brevity']",
        "loss.reward_weights=[1.0, 0.5]", "train.per_device_train_batch_size=8", "train.max_steps=2",
        "train.learning_rate=1e-2", "train.device=cpu", f"train.output_dir={run}"])
    result = train(cfg)
    saved = run / "checkpoint-2" / "model"

    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # The returned accuracy is the last evaluation's count of the 4 held-out prompts over 4 (the
    # last call scored them), and eval.jsonl's last row.
    assert len(HELD_OUT_SCORES[-1]) == 4 and 0 < sum(HELD_OUT_SCORES[-1]) < 4
    assert result["after"] == sum(HELD_OUT_SCORES[-1]) / 4
    last = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    # The reward functions scored the same held-out completions: their means, and the weighted sum
    # (loss.reward_weights 1.0 and 0.5), from the functions' own scores of the last call.
    completions, answers = BREVITY_CALLS[-1]
    assert len(completions) == 4
    exact = get_reward_funcs(["accuracy"], "answer")[0](prompts=[""] * 4, completions=completions, answer=answers)
    short = brevity([""] * 4, completions)
    assert last == pytest.approx({
        "step": 2, "eval/accuracy": result["after"], "eval/reward/accuracy/mean": sum(exact) / 4,
        f"eval/reward/{__name__}:brevity/mean": sum(short) / 4,
        "eval/reward/mean": sum(a + 0.5 * b for a, b in zip(exact, short)) / 4}, rel=1e-6)
    # The weights moved, and transformers reads rlcore's checkpoint with rlcore's logits.
    before, after = load_model(qwen_dir), load_model(saved)
    assert not torch.equal(before.model.layers[0].mlp.up_proj.weight, after.model.layers[0].mlp.up_proj.weight)
    hf = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - after.logits(after(ids))).abs().max().item() <= 1e-5
    # The tokenizer travels with the weights: the saved directory is a complete HF checkpoint.
    hf_tok = transformers.AutoTokenizer.from_pretrained(saved)
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2 plus 3?"}]
    assert Tokenizer.from_dir(saved).apply_chat_template(messages, tokenize=True) == \
        hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_the_shipped_gsm8k_config_trains_a_step(qwen_dir, gsm8k_file, gsm8k_eval_file, tmp_path):
    """configs/qwen2.5-0.5b-gsm8k.toml as shipped (columns, system prompt, chat template, rewards,
    bf16, batch sizes), with what a user passes and what a CPU needs: device, one step, short outputs."""
    run = tmp_path / "run"
    # rollout.seed=1: a round in which the random model scores once by chance (all rewards 0 move no weight)
    cfg = load_config(str(GSM8K_CONFIG), [
        f"model.path={qwen_dir}", f"data.path={gsm8k_file}", f"data.eval_path={gsm8k_eval_file}", "train.device=cpu",
        "train.max_steps=1", "rollout.max_completion_length=8", "rollout.seed=1", "train.eval_max_completion_length=8",
        f"train.output_dir={run}"])
    assert (cfg.train.bf16, cfg.data.use_chat_template, cfg.loss.reward_funcs) == (True, True, ["accuracy", "format"])
    tok = Tokenizer.from_dir(qwen_dir)  # the prompt the run feeds the model: ChatML with the system prompt
    assert tok.decode(format_prompt({"prompt": "How many?"}, tok, cfg.data.system_prompt, True)) == (
        f"<|im_start|>system\n{cfg.data.system_prompt}<|im_end|>\n<|im_start|>user\nHow many?<|im_end|>\n"
        "<|im_start|>assistant\n")

    train(cfg)
    (row,) = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["loss"] is not None and not row["skipped"] and {"reward/accuracy/mean", "reward/format/mean"} <= set(row)
    before, after = load_model(qwen_dir), load_model(run / "checkpoint-1" / "model")
    assert not torch.equal(before.model.norm.weight, after.model.norm.weight)


def test_stop_strings_are_encoded_without_the_bos_a_llama_tokenizer_adds(gsm8k_file, tmp_path, monkeypatch):
    """A stop string is matched on its token ids; with BOS prepended it could never match. The
    held-out evaluation stops at it too."""
    import rlcore.train

    path = llama_checkpoint(tmp_path / "llama")
    tok = Tokenizer.from_dir(path)
    assert tok.encode("</answer>")[0] == tok.bos_token_id  # this tokenizer's post-processor adds BOS
    model = make_hf_model("llama", vocab_size=512)
    model.config.eos_token_id, model.config.bos_token_id = tok.eos_token_id, tok.bos_token_id
    model.save_pretrained(path)
    seen, real = [], rlcore.rollout.generate

    def spy(*args, **kwargs):  # records the stops of each call: the held-out evaluations' and the rollout's
        seen.append(kwargs.get("stop_sequences"))
        return real(*args, **kwargs)

    monkeypatch.setattr(rlcore.rollout.completions, "generate", spy)
    train(load_config(None, [
        f"model.path={path}", "data.task=jsonl", f"data.path={gsm8k_file}", "data.prompt_column=question",
        "data.num_eval=4", "data.use_chat_template=false", "rollout.num_generations=4",
        "rollout.max_completion_length=6", 'rollout.stop=["</answer>"]', "train.per_device_train_batch_size=8",
        "train.max_steps=1", "train.device=cpu", f"train.output_dir={tmp_path / 'run'}"]))
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]  # eval before, the rollout, eval after: as TRL's
    stops = seen[0]  # generation_kwargs' stop strings end its evaluation's completions too
    assert stops == tok.stop_ids("</answer>") and stops[0] == tok.encode("</answer>", add_special_tokens=False)
    assert all(tok.bos_token_id not in ids for ids in stops)


SEEN = {}


def trl_style(prompts, completions, completion_ids, trainer_state, log_metric, difficulty, **kwargs):
    """A reward written for TRL: conversational completions, its keywords, a column some rows lack."""
    SEEN.setdefault("steps", []).append(trainer_state.global_step)
    SEEN.update(prompt=prompts[0], completion=completions[0], ids=completion_ids[0])
    SEEN.setdefault("difficulty", []).extend((int(p[1]["content"][4:-1]), d) for p, d in zip(prompts, difficulty))
    log_metric("custom/mean_ids", sum(map(len, completion_ids)) / len(completion_ids))
    return [float(len(c[0]["content"]) % 3) for c in completions]


def unscorable(prompts, completions, **kwargs):
    return [None] * len(completions)


def test_a_trl_reward_function_runs_on_a_conversational_dataset(qwen_dir, tmp_path):
    data = tmp_path / "conv.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say {i}."}],
             "answer": str(i), **({"difficulty": i % 3} if i % 2 else {})} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={data}", "data.num_eval=2",
        "rollout.num_generations=4", "rollout.max_completion_length=5", "train.eval_max_completion_length=5",
        f"loss.reward_funcs=['{__name__}:trl_style']", "train.per_device_train_batch_size=8", "train.max_steps=2",
        "train.device=cpu", f"train.output_dir={run}"])
    SEEN.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg)

    assert not [w for w in caught if "no reward function scored" in str(w.message)]
    assert SEEN["steps"] == [0, 0, 1, 2]  # trainer_state.global_step: held-out before, each round, held-out after
    assert isinstance(SEEN["prompt"], list) and SEEN["prompt"][0]["role"] == "system"
    (message,) = SEEN["completion"]  # TRL's conversational completion
    assert message["role"] == "assistant"
    assert Tokenizer.from_dir(qwen_dir).decode(SEEN["ids"], skip_special_tokens=True) == message["content"]
    # the column some rows lack reaches every row: its value, or None
    assert all(d == (i % 3 if i % 2 else None) for i, d in SEEN["difficulty"])
    assert len(SEEN["difficulty"]) == 2 * 8 + 2 * 2  # two rounds of 8, two evaluations of 2 held-out rows
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(1 <= m["custom/mean_ids"] <= 5 for m in metrics)  # log_metric lands in metrics.jsonl
    evals = [json.loads(ln) for ln in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and all(1 <= e["eval/custom/mean_ids"] <= 5 for e in evals)


def test_a_round_nothing_scores_is_reported(qwen_dir, gsm8k_file, tmp_path):
    cfg = load_config(None, [
        f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={gsm8k_file}", "data.prompt_column=question",
        "data.num_eval=2", "rollout.num_generations=4", "rollout.max_completion_length=4",
        "train.eval_max_completion_length=4", f"loss.reward_funcs=['{__name__}:unscorable']",
        "train.per_device_train_batch_size=8", "train.max_steps=1", "train.device=cpu",
        f"train.output_dir={tmp_path / 'run'}"])
    with pytest.warns(RlcoreWarning, match=r"no reward function scored any completion of round 1 \(all returned None or "
                                          r"NaN\), so every advantage is 0"):  # was a print: 'warning: ...'
        train(cfg)


def test_prompt_plus_completion_past_max_position_embeddings_warns(qwen_dir, gsm8k_file, tmp_path):
    def run(name, *overrides):
        cfg = load_config(None, [
            f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={gsm8k_file}", "data.prompt_column=question",
            "rollout.num_generations=4", "train.per_device_train_batch_size=8", "train.max_steps=1",
            "train.device=cpu", f"train.output_dir={tmp_path / name}", *overrides])
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            train(cfg)
        return [str(w.message) for w in said if "max_position_embeddings" in str(w.message)]

    rewrite_config(qwen_dir, max_position_embeddings=100)  # the prompts here are about 95 tokens
    said = run("a", "data.num_eval=2", "rollout.max_completion_length=30", "train.eval_max_completion_length=1")
    assert len(said) == 1, said
    found = re.match(r"the longest prompt \((\d+) tokens\) \+ rollout\.max_completion_length = 30 is \d+ positions, "
                     r"past .*'s max_position_embeddings = 100 \(config\.json\).*lower rollout\.max_completion_length",
                     said[0])
    assert found, said
    # without held-out prompts, eval_max_completion_length reaches no position
    rewrite_config(qwen_dir, max_position_embeddings=int(found[1]) + 1)
    assert run("b", "data.num_eval=0", "rollout.max_completion_length=1", "train.eval_max_completion_length=30") == []


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_weight_decay_skips_the_parameters_transformers_trainer_skips(family, hf_checkpoint):
    """train.weight_decay decays what transformers' Trainer (so TRL) decays, by name: not biases
    (Qwen2's q/k/v), not norm weights (Qwen3's q_norm / k_norm too); the embedding and matrices."""
    from transformers import Trainer

    from rlcore.config.options import TrainArgs
    from rlcore.run.setup import adamw

    path, hf = hf_checkpoint(family)
    model = load_model(path)
    opt = adamw(model, TrainArgs(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    kept = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert decayed == set(Trainer.get_decay_parameter_names(None, hf))
    assert decayed | kept == set(names.values()) and not decayed & kept
    assert any(n.endswith("bias") for n in kept) == (family == "qwen2")


QWEN3_GENERATION_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def test_chat_template_kwargs_render_prompts_as_transformers_does(qwen_dir, gsm8k_file, tmp_path, monkeypatch):
    """data.chat_template_kwargs (TRL's chat_template_kwargs) reaches the template: Qwen3's
    enable_thinking = false pre-fills an empty think block, as transformers renders it."""
    import rlcore.train

    template = qwen_dir / "chat_template.jinja"
    text = template.read_text()
    template.write_text(text[:text.rindex("{%- if add_generation_prompt %}")] + QWEN3_GENERATION_PROMPT)
    cfg = load_config(None, [
        f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={gsm8k_file}", "data.prompt_column=question",
        "data.num_eval=4", "data.chat_template_kwargs={enable_thinking=false}", "rollout.num_generations=4",
        "rollout.max_completion_length=4", "train.eval_max_completion_length=4", "train.per_device_train_batch_size=8",
        "train.max_steps=1", "train.device=cpu", f"train.output_dir={tmp_path / 'run'}"])
    tok, ref = Tokenizer.from_dir(qwen_dir), transformers.AutoTokenizer.from_pretrained(qwen_dir)
    messages = [{"role": "user", "content": "How many?"}]
    for kwargs in ({}, cfg.data.chat_template_kwargs):
        ours = format_prompt({"prompt": "How many?"}, tok, None, True, kwargs)
        assert ours == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False, **kwargs)
        assert ("<think>" in tok.decode(ours)) == bool(kwargs)
    seen, real = [], rlcore.run.setup.encode_prompts
    monkeypatch.setattr(rlcore.run.setup, "encode_prompts", lambda *a: seen.append(a[5]) or real(*a))  # chat_template_kwargs
    train(cfg)
    assert seen == [{"enable_thinking": False}] * 2  # the training and the held-out prompts


@pytest.mark.parametrize("prompts, b, ga, spg, mu, epochs", [
    (21, 4, 2, 2, 2, 1.5),   # 10 whole rounds of 2 prompts (one prompt left over), 2 steps per round
    (40, 8, 1, 2, 1, 1.0),   # 2 steps per round
    (13, 4, 1, 1, 3, 0.4),   # a fraction of an epoch, mu = 3
])
def test_num_train_epochs_gives_the_steps_trl_trains_for(prompts, b, ga, spg, mu, epochs, qwen_dir, tmp_path):
    """TRL's GRPOTrainer as the reference: the optimizer steps transformers' Trainer derives from
    num_train_epochs with max_steps = -1 (its RepeatSampler's dataloader, GA, num_iterations)."""
    trl = pytest.importorskip("trl", reason="TRL is the reference")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rlcore.config.geometry import epoch_steps, generation_steps

    G = 4
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=b, gradient_accumulation_steps=ga,
                          steps_per_generation=spg, num_iterations=mu, num_generations=G, num_train_epochs=epochs,
                          use_cpu=True, bf16=False, report_to="none", use_vllm=False, max_completion_length=4)
    trainer = trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(qwen_dir), reward_funcs=brevity, args=args,
                              train_dataset=Dataset.from_dict({"prompt": [f"p{i}" for i in range(prompts)]}),
                              processing_class=AutoTokenizer.from_pretrained(qwen_dir))
    trl_steps = trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())[-1]

    cfg = load_config(None, [f"train.per_device_train_batch_size={b}", f"train.gradient_accumulation_steps={ga}",
                             f"train.steps_per_generation={spg}", f"loss.num_iterations={mu}",
                             f"rollout.num_generations={G}", f"num_train_epochs={epochs}"])
    S = generation_steps(cfg.train, 1)
    assert cfg.train.max_steps == -1
    assert epoch_steps(prompts, b * S // G, S * mu // ga, epochs) == trl_steps


TRL_STYLE_CONFIG = Path(__file__).parent.parent / "configs" / "trl-style-grpo.toml"


def test_the_shipped_trl_style_recipe_loads_unchanged_and_trains(qwen_dir, gsm8k_file, gsm8k_eval_file,
                                                                  tmp_path):
    """configs/trl-style-grpo.toml is flat TRL GRPOConfig keys: each lands in its rlcore option,
    the TRL-only ones are dropped with a warning naming them, and the loop runs it."""
    run = tmp_path / "run"
    with pytest.warns(UserWarning) as caught:
        cfg = load_config(str(TRL_STYLE_CONFIG), [
            f"model.path={qwen_dir}", f"data.path={gsm8k_file}", f"data.eval_path={gsm8k_eval_file}",
            "data.prompt_column=question", "train.device=cpu", "train.bf16=false", "train.max_steps=2",
            "train.gradient_accumulation_steps=1", "rollout.max_completion_length=8", f"train.output_dir={run}"])
    dropped = {str(w.message).split(" = ")[0].removeprefix("TRL's ") for w in caught}
    assert dropped == {"model_init_kwargs attn_implementation", "gradient_checkpointing_kwargs", "use_vllm",
                       "save_strategy"}
    t, r, lo = cfg.train, cfg.rollout, cfg.loss
    assert t.report_to == "none"
    assert (r.num_generations, r.temperature, r.top_p, r.max_completion_length) == (16, 0.7, 0.95, 8)
    assert (t.lr_scheduler_type, t.lr_scheduler_kwargs, t.warmup_ratio) == ("cosine_with_min_lr", {"min_lr_rate": 0.1}, 0.1)
    assert (t.gradient_checkpointing, t.num_train_epochs, t.log_completions) == (True, 1.0, True)
    assert (lo.beta, lo.epsilon_high, lo.mask_truncated_completions, lo.reward_funcs) == (
        0.001, 0.28, True, ["accuracy", "format"])
    assert lo.use_bias_correction_kl  # written out: TRL's default, not rlcore's
    with pytest.warns(UserWarning):
        assert load_config(str(TRL_STYLE_CONFIG), [f"data.path={gsm8k_file}"]).train.max_steps == -1  # epochs

    train(cfg)
    got = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2] and all(r["loss"] is not None for r in got)
    assert got[0]["lr"] == pytest.approx(3e-6 * 1 / 2)  # warmup: step 0 of ceil(0.1 * 2) = 1 runs at (0+1)/(1+1)


def test_trls_dtype_auto_trains_in_the_checkpoints_dtype(qwen_dir, gsm8k_file, tmp_path):
    """TRL's model_init_kwargs dtype = "auto" (transformers' from_pretrained(dtype="auto")) was a config
    error; it is the checkpoint's dtype, read from its config.json as transformers reads it."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.bfloat16)
    hf.save_pretrained(qwen_dir)  # a bf16 checkpoint; config.json says so
    assert transformers.AutoModelForCausalLM.from_pretrained(qwen_dir, dtype="auto").dtype == torch.bfloat16
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={gsm8k_file}", "data.prompt_column=question",
        "data.num_eval=4", "rollout.num_generations=4", "rollout.max_completion_length=4",
        f"loss.reward_funcs=['{__name__}:brevity']", "train.per_device_train_batch_size=8", "train.max_steps=1",
        "train.device=cpu", f"train.output_dir={run}", 'model_init_kwargs={torch_dtype="auto"}'])
    assert cfg.model.dtype == "auto"
    with pytest.warns(UserWarning, match=r"model\.dtype = 'auto' on .*, a bfloat16 checkpoint: AdamW updates the bf16"):
        train(cfg)
    saved = load_model(run / "checkpoint-1" / "model", "auto")
    assert {p.dtype for p in saved.parameters()} == {torch.bfloat16}
    assert json.loads((run / "checkpoint-1" / "model" / "config.json").read_text())["dtype"] == "bfloat16"


def test_dtype_auto_without_a_dtype_in_config_json_takes_the_weights_as_transformers_does(hf_checkpoint, tmp_path):
    from rlcore.models.hf_checkpoint import resolve_dtype

    _, hf = hf_checkpoint("qwen2")
    path = tmp_path / "bf16"
    hf.to(torch.bfloat16).save_pretrained(path, max_shard_size="50KB")
    rewrite_config(path, drop=["torch_dtype", "dtype"])
    assert transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto").dtype == torch.bfloat16
    assert resolve_dtype("auto", path) == "bfloat16"  # was float32


@pytest.mark.parametrize("stored, want", [("float32", "float32"), ("bfloat16", "bfloat16"), (None, "float32"),
                                          ("float16", "does not train in")])
def test_resolve_dtype_reads_the_checkpoints_config(stored, want, hf_checkpoint):
    from rlcore.models.hf_checkpoint import CheckpointError, resolve_dtype

    path, _ = hf_checkpoint("qwen2")
    stored = {"torch_dtype": stored} if stored else {}  # the key of hub checkpoints written by transformers 4
    rewrite_config(path, drop=["torch_dtype", "dtype"], **stored)
    assert resolve_dtype("bfloat16", path) == "bfloat16"  # an explicit dtype is kept
    if want.startswith("does"):
        with pytest.raises(CheckpointError, match=r"model\.dtype = 'auto' takes its dtype 'float16', which rlcore "
                                                  r"does not train in; set model\.dtype = 'float32'"):
            resolve_dtype("auto", path)
    else:
        assert resolve_dtype("auto", path) == want
