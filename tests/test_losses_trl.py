"""The loss zoo against TRL's own code: a TRL config, loaded by rlcore, gives the advantages and
the loss TRL computes.

Advantages: TRL 1.16's GRPOTrainer._generate_and_score_completions, with generation replaced by
fixed completions, scores them with the same reward functions and normalises; rlcore's
score_completions and compute_advantages, configured from the same keys, must give the same
advantages (reward weights, None scores, every scale_rewards, both multi-objective aggregations).

Loss:
For each config below (TRL's GRPOConfig keys), TRL 1.16's GRPOTrainer._compute_loss and rlcore's
micro-batch loss (the loop's three calls: policy_loss, aggregate_loss, the entropy bonus) see
the same log-probs, entropies, advantages and masks over one optimizer step of GA micro-batches.
The step losses, their gradients with respect to the log-probs and entropies, and the clip /
KL / entropy metrics TRL logs must agree. The model forward is replaced by the given tensors
(TRL's _get_per_token_logps_and_entropies), so this tests the loss alone; the log-probs
themselves are tested against transformers in test_model.py and test_shared_prompt.py, and the
whole loop against TRL's GRPOTrainer in test_train_trl.py. A case with beta sets
use_bias_correction_kl, whose default differs (docs/trl.md: defaults that differ from TRL's).
"""

import os

import pytest
import torch

from conftest import toml_value
from rlcore.config import load_config
from rlcore.losses import EntropyBonus, PolicyLossOptions, aggregate_loss, compute_advantages, entropy_mask, policy_loss
from rlcore.rewards.scoring import get_reward_funcs, score_completions

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
trl = pytest.importorskip("trl", reason="TRL is the reference")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5 renames GRPOConfig fields

B, T, GA, G = 4, 7, 2, 4  # micro-batch rows, completion tokens, accumulation steps, group size

CASES = {
    "trl defaults (dapo, on-policy)": ({}, False),
    "grpo + kl": ({"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False}, True),
    "bnpo, clip-higher": ({"loss_type": "bnpo", "epsilon": 0.1, "epsilon_high": 0.28}, True),
    "dr_grpo": ({"loss_type": "dr_grpo"}, True),
    "dapo, two-sided delta": ({"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.5}, True),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.03,
              "epsilon_high": 0.04}, True),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, True),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.3}, True),
    # TRL builds sapo's temperatures in fp32 (torch.where of python floats): values exact in fp32
    "sapo": ({"loss_type": "sapo", "sapo_temperature_pos": 0.75, "sapo_temperature_neg": 1.25}, True),
    "vespo": ({"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_neg": 2.5}, True),
    "bias-corrected kl": ({"loss_type": "grpo", "beta": 0.1, "use_bias_correction_kl": True}, True),
    "high-entropy tokens": ({"top_entropy_quantile": 0.4}, True),
    "off-policy mask": ({"off_policy_mask_threshold": 0.05}, True),
    "entropy bonus": ({"entropy_coef": 0.05}, False),
    "all of it": ({"loss_type": "grpo", "beta": 0.02, "use_bias_correction_kl": False, "delta": 1.6,
                   "epsilon_high": 0.28, "top_entropy_quantile": 0.5, "entropy_coef": 0.03,
                   "off_policy_mask_threshold": 0.02}, True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 checkpoint and WordLevel tokenizer: GRPOTrainer needs a model (and, with beta,
    loads its reference from the path), though the loss never runs it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp("trl_loss")
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": 3 + i for i in range(29)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(d)
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d, tok


def trl_trainer(checkpoint, options: dict, reward_funcs=None):
    from datasets import Dataset

    d, tok = checkpoint
    args = trl.GRPOConfig(output_dir=str(d / "out"), use_cpu=True, bf16=False, report_to="none",
                          per_device_train_batch_size=B, gradient_accumulation_steps=GA, num_generations=G,
                          max_completion_length=T, **options)
    trainer = trl.GRPOTrainer(model=str(d), reward_funcs=reward_funcs or (lambda prompts, completions, **kw:
                                                                           [0.0] * len(prompts)),
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["w1 w2"] * G}),
                              processing_class=tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = GA  # transformers sets it in its training loop
    return trainer


def rlcore_config(options: dict, tmp_path):
    toml = tmp_path / "trl.toml"  # the same keys, flat, as a TRL user writes them
    toml.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in {
        **options, "per_device_train_batch_size": B, "gradient_accumulation_steps": GA, "num_generations": G,
        "max_completion_length": T}.items()))
    return load_config(str(toml))


# ---- advantages --------------------------------------------------------------------------------

def length_mod_5(prompts, completions, **kwargs):
    return [float(len(c) % 5) for c in completions]


def has_w1_unless_w3(prompts, completions, **kwargs):
    """None (unscorable) for a completion ending in w3: TRL turns it into NaN, rlcore too."""
    return [None if c.endswith("w3") else float("w1" in c.split()) for c in completions]


def constant_in_group_two(prompts, completions, **kwargs):
    """Equal scores within the second group: its rows' advantages come from the other functions."""
    return [1.0 if p == "w5 w6" else float(len(c)) for p, c in zip(prompts, completions)]


ADVANTAGE_CASES = {
    "group": {},
    "batch": {"scale_rewards": "batch"},
    "none": {"scale_rewards": "none"},
    "weights": {"reward_weights": [1.0, -0.5, 0.25]},
    "normalize_then_sum": {"multi_objective_aggregation": "normalize_then_sum", "reward_weights": [0.5, 1.0, 2.0]},
}


@pytest.mark.parametrize("case", ADVANTAGE_CASES)
def test_a_trl_config_gives_trls_advantages(case, checkpoint, tmp_path):
    d, tok = checkpoint
    options = ADVANTAGE_CASES[case]
    funcs = [length_mod_5, has_w1_unless_w3, constant_in_group_two]
    trainer = trl_trainer(checkpoint, options, funcs)
    # one generation batch (B x GA rows): B x GA / G prompts, G completions each, the last group all None
    prompts = [p for p in ("w1 w2", "w3 w4", "w5 w6", "w7 w8") for _ in range(G)]
    g = torch.Generator().manual_seed(len(case))
    completions = [" ".join(f"w{int(i)}" for i in torch.randint(1, 10, (int(n),), generator=g))
                   for n in torch.randint(1, 5, (len(prompts),), generator=g)]
    completions[-G:] = ["w1 w3"] * G  # has_w1_unless_w3: None for the whole group
    trainer._generate = lambda ps: ([[3, 4]] * len(ps), [tok(c)["input_ids"] or [1] for c in completions], None,
                                    completions, None, {}, None, None)
    trainer.model.train()
    want = trainer._generate_and_score_completions([{"prompt": p} for p in prompts])["advantages"]

    names = [f"{__name__}:{f.__name__}" for f in funcs]  # rlcore's config names them; TRL takes the functions
    lc = rlcore_config({**options, "reward_funcs": names}, tmp_path).loss
    R = score_completions(get_reward_funcs(lc.reward_funcs), prompts, completions, {})
    got, stats = compute_advantages(R, G, lc.reward_weights, lc.scale_rewards, reward_names=[f.__name__ for f in funcs],
                                    multi_objective_aggregation=lc.multi_objective_aggregation)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6)
    assert want.abs().sum() > 0  # the case has signal
    logged = trainer._metrics["train"]  # TRL's per-function reward statistics, as rlcore names them
    for f in funcs:
        for stat in ("mean", "std"):
            assert stats[f"reward/{f.__name__}/{stat}"] == pytest.approx(logged[f"rewards/{f.__name__}/{stat}"][-1],
                                                                         rel=1e-6)


# ---- loss --------------------------------------------------------------------------------------

def step_inputs(seed: int) -> list[dict]:
    """GA micro-batches of fp64 log-probs, entropies (fp32 values: TRL takes the quantile in fp32),
    advantages of both signs and a zero one (a zero-std group's), ragged masks (one row empty),
    and old / ref log-probs spread so that ratios land on both sides of every clip bound."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(GA):
        lengths = torch.tensor([T, 3, 0, 5])[torch.randperm(B, generator=g)]
        mask = (torch.arange(T) < lengths[:, None]).double()
        logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
        batches.append(dict(
            mask=mask, logp=logp,
            entropy=(torch.rand(B, T, generator=g) * 2).double(),
            adv=torch.randn(B, generator=g, dtype=torch.float64) * torch.tensor([1.0, 1.0, 1.0, 0.0]),
            old=logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3,
            ref=logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5,
        ))
    return batches


def trl_step(trainer, batches, off_policy: bool):
    """TRL's step loss and gradients, and the metrics its micro-batches logged."""
    step_tokens = sum(b["mask"].sum() for b in batches)
    total, grads = 0.0, []
    for b in batches:
        logp, entropy = b["logp"].clone().requires_grad_(), b["entropy"].clone().requires_grad_()
        trainer._get_per_token_logps_and_entropies = lambda *a, **kw: (logp, entropy, None)
        inputs = dict(prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                      completion_ids=torch.ones(B, T, dtype=torch.long), completion_mask=b["mask"],
                      advantages=b["adv"], ref_per_token_logps=b["ref"], num_items_in_batch=step_tokens)
        if off_policy:
            inputs["old_per_token_logps"] = b["old"]
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        total, grads = total + loss.item(), grads + [(logp.grad, entropy.grad)]
    return total, grads, trainer._metrics["train"]


def rlcore_step(cfg, batches, off_policy: bool):
    """rlcore's step loss and gradients as train.py's update computes them, and its metrics."""
    lc = cfg.loss
    bonus = EntropyBonus(lc.entropy_coef, lc.use_adaptive_entropy, lc.entropy_target, lc.entropy_coef_delta,
                         lc.entropy_coef_min, lc.entropy_coef_max)
    step_tokens = sum(b["mask"].sum() for b in batches)
    total, grads, metrics = 0.0, [], []
    for b in batches:
        logp, entropy = b["logp"].clone().requires_grad_(), b["entropy"].clone().requires_grad_()
        keep = None if lc.top_entropy_quantile == 1.0 else \
            entropy_mask(entropy.detach(), b["mask"], lc.top_entropy_quantile)
        old = b["old"] if off_policy else logp.detach()
        l, m = policy_loss(logp, old, b["adv"], b["mask"], options=PolicyLossOptions.from_config(lc),
                           ref=b["ref"] if lc.beta else None, entropy=entropy.detach(), entropy_keep=keep, samp=old)
        loss = aggregate_loss(l, b["mask"], lc.loss_type, gradient_accumulation_steps=GA,
                              max_completion_length=cfg.rollout.max_completion_length, step_tokens=step_tokens)
        if bonus.enabled:
            loss = loss - bonus.term(entropy, b["mask"] if keep is None else keep, GA)
        loss.backward()
        total, grads = total + loss.item(), grads + [(logp.grad, entropy.grad)]
        metrics.append(m)
    return total, grads, metrics


@pytest.mark.parametrize("case", CASES)
def test_a_trl_config_gives_trls_loss_gradients_and_metrics(case, checkpoint, tmp_path):
    options, off_policy = CASES[case]
    cfg = rlcore_config(options, tmp_path)
    trainer = trl_trainer(checkpoint, options)
    for seed in range(3):
        batches = step_inputs(seed)
        trainer._metrics["train"].clear()
        want, want_grads, logged = trl_step(trainer, batches, off_policy)
        got, got_grads, metrics = rlcore_step(cfg, batches, off_policy)

        assert got == pytest.approx(want, rel=1e-12, abs=1e-14), (case, seed)
        for (wl, we), (gl, ge) in zip(want_grads, got_grads):
            torch.testing.assert_close(gl, wl, rtol=1e-12, atol=1e-14)
            if we is None:  # TRL's entropies get no gradient without the bonus; rlcore's neither
                assert ge is None or not ge.any()
            else:
                torch.testing.assert_close(ge, we, rtol=1e-12, atol=1e-14)
        # Metrics defined alike (docs/losses.md, Metrics, lists those TRL defines otherwise: sequence-
        # level clip fractions count sequences there, and its kl includes the bias correction).
        names = [("entropy", "entropy")]
        if cfg.loss.importance_sampling_level == "token":
            names += [("clip_ratio/low_mean", "clip_ratio/low"), ("clip_ratio/high_mean", "clip_ratio/high"),
                      ("clip_ratio/region_mean", "clip_ratio/region")]
        if not cfg.loss.use_bias_correction_kl:
            names += [("kl", "kl_ref")]
        for theirs, ours in names:
            if theirs in logged:  # one value per micro-batch, each a masked token mean as rlcore's
                assert [float(m[ours]) for m in metrics] == pytest.approx(logged[theirs], rel=1e-6, abs=1e-12), \
                    (case, theirs)
