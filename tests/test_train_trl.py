"""The whole loop against TRL's GRPOTrainer, step for step: the same TRL keys, the same checkpoint
and the same completions give the same gradient norms, learning rates and trained weights.

test_losses_trl.py checks the loss on given log-probs. This checks everything around it, as two
independent implementations: rlcore's model against transformers', and rlcore's loop (micro-batches,
gradient accumulation, mu-epoch replay, old and reference log-probs, the temperature, AdamW and its
weight-decay groups, the linear, cosine and constant schedules, gradient clipping) against TRL's
with transformers' Trainer, on Qwen2, tied Llama and tied Qwen3 models. Sampling is the one thing
replaced, on both sides: each round's completions are fixed token ids, handed to rlcore's loop in
place of its engine and to TRL in place of its `_generate`, with the prompts' token ids rlcore's
round drew. TRL shuffles a round's rows with the global RNG and rlcore with its own generator seeded
by `seed`; TRL is given the permutations rlcore draws, so both cut the round into the same
micro-batches.

Where rlcore differs from TRL on purpose (docs/trl.md, defaults that differ from TRL's), the cases step
around it: each names lr_scheduler_type (rlcore's default is constant, TRL's linear), none warms up
(rlcore's warmup runs step s at (s+1)/(W+1), TRL's at s/W), and the off-policy case is not dapo
(with steps_per_generation > GA, TRL's dapo divides by the round's tokens * GA / S, rlcore's by the
step's own tokens: docs/losses.md).
"""

import json

import pytest
import torch

from conftest import clip_bound_margin, fixed_completions, fixed_rollout, save_model_for_tokenizer, token_reward, toml_value
from rlcore.config import load_config
from test_train_hf import write_gsm8k

trl = pytest.importorskip("trl", reason="TRL is the reference")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

G, T = 4, 6  # group size, completion tokens at most
STEPS = 4

COMMON = {"num_generations": G, "max_completion_length": T, "max_steps": STEPS, "learning_rate": 0.01,
          "seed": 7, "per_device_train_batch_size": 4}

# TRL GRPOConfig keys, given to both. The round is per_device_train_batch_size * steps_per_generation rows.
CASES = {
    "trl defaults (dapo, on-policy, linear decay), clipping": dict(
        gradient_accumulation_steps=2, lr_scheduler_type="linear", max_grad_norm=0.05),
    "grpo, mu = 2, beta, clip-higher, delta, weight decay, temperature": dict(
        loss_type="grpo", gradient_accumulation_steps=2, num_iterations=2, beta=0.04,
        use_bias_correction_kl=False, epsilon_high=0.28, delta=1.5, weight_decay=0.1, temperature=0.7,
        lr_scheduler_type="cosine"),
    "off-policy rounds (steps_per_generation > GA), bnpo, masked truncations, high-entropy tokens only": dict(
        loss_type="bnpo", gradient_accumulation_steps=2, steps_per_generation=4, epsilon=0.1,
        mask_truncated_completions=True, top_entropy_quantile=0.69, temperature=0.3, max_grad_norm=0.5,
        lr_scheduler_type="constant"),
    "gspo's sequence ratios, mu = 3, dr_grpo, high-entropy tokens only": dict(
        loss_type="dr_grpo", importance_sampling_level="sequence", epsilon=0.2, epsilon_high=0.28,
        num_iterations=3, gradient_accumulation_steps=1, top_entropy_quantile=0.6, temperature=0.3,
        lr_scheduler_type="linear"),
}


# rlcore's and transformers' arithmetic differ in the last bits, by an amount that depends on the CPU's
# kernels. A case is only a fair comparison where every value that meets a threshold (an entropy against
# the entropy-quantile cut, an importance ratio against a clip bound) sits clear of it by far more.
MARGIN = 1e-5  # relative: about 80 fp32 ulps, where the two sides' entropies and log-probs differ by one or two


class Thresholds:
    """Records, during rlcore's run, the values its loop compares with a threshold: the entropies each
    entropy-quantile cut is taken over (torch.quantile's input) and each micro-batch's log-ratios."""

    def __init__(self):
        self.quantiles, self.ratios = [], []

    def watch(self, monkeypatch) -> None:
        import rlcore.train

        real_quantile, real_loss = torch.quantile, rlcore.train.policy_loss

        def quantile(values, q, *args, **kwargs):
            self.quantiles.append((values.detach().double(), float(q)))
            return real_quantile(values, q, *args, **kwargs)

        def policy_loss(logp, old, advantages, mask, *args, **kwargs):
            self.ratios.append(((logp - old).detach().double(), mask.bool()))
            return real_loss(logp, old, advantages, mask, *args, **kwargs)

        monkeypatch.setattr(torch, "quantile", quantile)
        monkeypatch.setattr(rlcore.train, "policy_loss", policy_loss)

    def entropy_margin(self) -> float:
        """The smallest distance, relative, from an entropy to its cut (computed in fp64); inf with no cut."""
        margins = [((values - torch.quantile(values, q)).abs() / values.abs().max().clamp(min=1)).min().item()
                    for values, q in self.quantiles]
        return min(margins, default=float("inf"))

    def ratio_margin(self, options: dict) -> float:
        """The smallest distance, relative, from an importance ratio to a bound the loss clips it at."""
        return min((clip_bound_margin(log_ratio, mask, options.get("epsilon", 0.2), options.get("epsilon_high"),
                                      options.get("delta"), options.get("importance_sampling_level") == "sequence")
                    for log_ratio, mask in self.ratios), default=float("inf"))


def run_rlcore(options: dict, model_dir, data, tmp_path, monkeypatch, thresholds: Thresholds | None = None):
    """rlcore's loop on the fixed completions; returns its prompts per round, metrics rows and weights."""
    import rlcore.train
    from rlcore.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    rounds = []

    def fixed_generate(model, prompts, num_generations, max_new_tokens, **kwargs):
        assert num_generations == 1 and max_new_tokens == T
        rounds.append(prompts)
        return fixed_rollout(prompts, fixed_completions(len(rounds) - 1, len(prompts), tok.eos_token_id, T),
                             tok.eos_token_id, tok.pad_token_id)

    monkeypatch.setattr(rlcore.rollout.completions, "generate", fixed_generate)
    run = tmp_path / "rlcore"
    cfg = load_config(None, [f"{k}={toml_value(v)}" for k, v in {**COMMON, **options}.items()] + [
        f"model.path={model_dir}", "data.task=jsonl", f"data.path={data}", "data.prompt_column=question",
        "data.num_eval=0", "loss.reward_funcs=['conftest:token_reward']", "train.device=cpu",
        "train.bf16=false", f"train.output_dir={run}"])
    with monkeypatch.context() as spies:  # rlcore's calls only, not TRL's
        if thresholds is not None:
            thresholds.watch(spies)
        rlcore.train.train(cfg)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {**COMMON, **options}["max_steps"]
    weights = transformers.AutoModelForCausalLM.from_pretrained(run / f"checkpoint-{steps}" / "model").state_dict()
    return rounds, rows, weights


def shuffle_as_rlcore(seed: int):
    """A stand-in for TRL's shuffle_sequence_dict that permutes each round's rows as rlcore's loop
    does (its generator seeded by `seed`), so both cut a round into the same micro-batches."""
    shuffler = torch.Generator().manual_seed(seed)

    def shuffle(batch: dict) -> dict:
        n = len(next(v for v in batch.values() if v is not None))
        perm = torch.randperm(n, generator=shuffler)
        return {k: v if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0)
                else v[perm] if isinstance(v, torch.Tensor) else [v[i] for i in perm] for k, v in batch.items()}

    return shuffle


def run_trl(options: dict, model_dir, rounds, tmp_path, monkeypatch):
    """TRL's GRPOTrainer on the same prompts and completions; returns its log history and weights."""
    from datasets import Dataset

    import trl.trainer.grpo_trainer as grpo

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                          use_vllm=False, logging_steps=1, save_strategy="no", **COMMON, **options)
    trainer = trl.GRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(model_dir),
                              reward_funcs=token_reward, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": [f"p{i}" for i in range(64)]}))
    calls = []

    def fixed_generate(prompts):
        ids = rounds[len(calls)]  # the prompts rlcore drew for this round
        assert len(prompts) == len(ids)
        completions = fixed_completions(len(calls), len(ids), tok.eos_token_id, T)
        calls.append(ids)
        return ids, completions, None, tok.batch_decode(completions), None, {}, None, None

    trainer._generate = fixed_generate
    monkeypatch.setattr(grpo, "shuffle_sequence_dict", shuffle_as_rlcore(COMMON["seed"]))
    trainer.train()
    assert len(calls) == len(rounds)
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    return logs, trainer.model.state_dict()


def with_family(qwen_dir, family: str):
    """qwen_dir's tokenizer with a tiny random model of `family` (conftest's FAMILIES)."""
    from rlcore.models.tokenizer import Tokenizer

    if family != "qwen2":
        save_model_for_tokenizer(qwen_dir, family, Tokenizer.from_dir(qwen_dir))
    return qwen_dir


FIRST = next(iter(CASES))  # the other families (tied embeddings; Qwen3's q/k norms) on the first case


@pytest.mark.parametrize("case, family", [(case, "qwen2") for case in CASES] +
                         [(FIRST, "llama_tied"), (FIRST, "qwen3_tied")])
def test_the_loop_trains_as_trls_grpo_trainer_on_the_same_completions(case, family, qwen_dir, tmp_path, monkeypatch):
    options, model_dir = CASES[case], with_family(qwen_dir, family)
    data = write_gsm8k(tmp_path / "prompts.jsonl", range(8))
    init = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    thresholds = Thresholds()
    rounds, rows, got = run_rlcore(options, model_dir, data, tmp_path, monkeypatch, thresholds)
    # A case that drifts onto a tie fails here, by name, not as a gradient norm off in the 5th digit.
    assert thresholds.entropy_margin() > MARGIN, (
        f"an entropy sits {thresholds.entropy_margin():.1e} (relative) from its top_entropy_quantile cut, which "
        f"last-bit differences can move it across: choose a quantile whose cuts fall between distinct entropies")
    assert thresholds.ratio_margin(options) > MARGIN, (
        f"an importance ratio sits {thresholds.ratio_margin(options):.1e} (relative) from a clip bound: choose "
        f"another epsilon")
    assert bool(thresholds.quantiles) == (options.get("top_entropy_quantile", 1.0) < 1.0)  # the mask was applied
    logs, want = run_trl(options, model_dir, rounds, tmp_path, monkeypatch)

    assert len(rows) == len(logs) == STEPS
    assert [r["grad_norm"] for r in rows] == pytest.approx([h["grad_norm"] for h in logs], rel=1e-4)
    assert [r["lr"] for r in rows] == pytest.approx([h["learning_rate"] for h in logs], rel=1e-6)
    assert got.keys() == want.keys()
    for name in want:  # each tensor's update agrees to 0.1% (fp32: an element's Adam step is sign(grad) when
        moved = want[name] - init[name]  # its gradient is rounding noise; a clip bound may fall either way)
        assert moved.abs().max() > 1e-3, name  # it trained
        assert (got[name] - init[name] - moved).norm() <= 1e-3 * moved.norm(), name


def test_with_s_above_ga_dapo_divides_by_each_steps_own_tokens_where_trl_takes_the_rounds_mean(
        qwen_dir, tmp_path, monkeypatch):
    """The difference the cases above step around (docs/losses.md): with steps_per_generation = 4 >
    GA = 2, each micro-batch's dapo loss is its sum of l / the active tokens of its own optimizer step,
    where TRL divides by the round's tokens * GA / S, which differs from it here."""
    import rlcore.train

    calls, real = [], rlcore.train.aggregate_loss

    def spy(per_token, mask, loss_type, **kwargs):
        loss = real(per_token, mask, loss_type, **kwargs)
        calls.append((float((per_token * mask).sum()), float(mask.sum()), float(kwargs["step_tokens"]), loss.item()))
        return loss

    monkeypatch.setattr(rlcore.train, "aggregate_loss", spy)
    data = write_gsm8k(tmp_path / "prompts.jsonl", range(8))
    run_rlcore(dict(loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=4,
                    lr_scheduler_type="constant"), qwen_dir, data, tmp_path, monkeypatch)
    assert len(calls) == STEPS * 2  # 2 rounds of 4 micro-batches, 2 per optimizer step
    steps = [calls[k:k + 2] for k in range(0, len(calls), 2)]
    for step in steps:
        tokens = sum(c[1] for c in step)
        assert [c[2] for c in step] == [tokens, tokens]
        assert [c[3] for c in step] == pytest.approx([c[0] / tokens for c in step], rel=1e-6)
    trl_divisor = [sum(c[1] for c in calls[4 * r:4 * r + 4]) * 2 / 4 for r in (0, 0, 1, 1)]
    assert [sum(c[1] for c in step) for step in steps] != pytest.approx(trl_divisor)
