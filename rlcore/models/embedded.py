"""The embedded default model: a tiny character-level Qwen2, warm-started by rlcore's own SFT.

Built on first run (about a minute on 2 CPU cores) and cached, so the quick start needs no
download. The warm start is deliberately imperfect: it imitates a *buggy demonstrator* that answers
one too high in a fraction `noise` (60%) of its demonstrations of every problem (3 of the 5 it
gives per problem, so no problem is memorised as always right or always wrong). The resulting
policy knows the format and puts real probability (about 40%) on the right answer, but its greedy
answer is the demonstrator's bug: held-out greedy accuracy starts low. That is the situation GRPO is
for: the right answer is among the policy's own samples, and an exact-match reward is enough to
find and reinforce it. (Behaviour cloning cannot fix this; more demonstrations of the same
demonstrator only sharpen the bug.)

The embedded tool model (data.task = "multiplication", configs/calculator.toml) is the same
architecture with a chat template in Qwen2.5's tool format: a system line naming the tools, calls
as `<tool_call>` JSON, results as `<tool_response>` in a user turn. Its demonstrator answers
two-digit times three-digit products, calling the calculator on every third problem and
answering by heart ("=17834") on the rest. Imitation teaches the call's format and copying the
operands and the result, but not the products (held-out answers by heart are almost never
right), and greedy decoding answers by heart: RL has to find out that calling pays.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import string
import sys
import tempfile
from pathlib import Path

import torch

from rlcore import EMBEDDED_DEFAULT
from rlcore.models.hf_checkpoint import save_model
from rlcore.models.transformer import ModelConfig, Transformer
from rlcore.sft import sft

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

EOS, PAD = "<|endoftext|>", "<|pad|>"
DEMOS_PER_PROBLEM = 5
CHARS = string.printable[:95]  # digits, letters, punctuation, space

ARCH = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu",
            vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
            eos_token_id=0, pad_token_id=1, bos_token_id=None)


# The tool model's tokens beyond the characters: Qwen2.5's chat markers, as single tokens.
CHAT_EOS, IM_START = "<|im_end|>", "<|im_start|>"
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # not special: kept in decoded text
# and whole-word tokens for the template's words, as a real vocabulary has: sequences a third shorter
WORDS = ["system", "user", "assistant", "Tools", "calculator", "expression", "name", "arguments"]
TOOL_ARCH = {**ARCH, "max_position_embeddings": 256, "eos_token_id": 1, "pad_token_id": 0}
# Qwen2.5's layout and call format (tool_calls.py reads it), shortened for a character model: the
# system line names the tools instead of listing their JSON schemas.
CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools: {% for tool in tools %}{{ (tool.function or tool).name }}{{ ", " if not loop.last }}{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content or "" }}
{%- for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def write_char_tokenizer(path: Path, chat: bool = False) -> None:
    """tokenizer.json (one token per printable ASCII character) and tokenizer_config.json; with
    `chat`, also newline, the chat markers, the tool tags and WORDS, and CHAT_TEMPLATE.

    In transformers 5, `AutoTokenizer` replaces the tokenizer of any qwen2 checkpoint with its own
    Qwen2 BPE class, which drops this one's spaces ("a b" -> "ab"; the arithmetic prompts have
    none). Load it there with `PreTrainedTokenizerFast.from_pretrained(path)`, as bench/ does.
    """
    from tokenizers import Tokenizer, decoders, models

    specials = [EOS, CHAT_EOS, IM_START] if chat else [EOS, PAD]  # chat: EOS pads, as Qwen's <|endoftext|>
    tags = TOOL_TAGS + WORDS if chat else []
    vocab = {tok: i for i, tok in enumerate([*specials, *tags, *CHARS, *(["\n"] if chat else [])])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: every character a token
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.add_tokens(tags)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": EOS, "pad_token": PAD, "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": 128}
    if chat:
        config.update(eos_token=CHAT_EOS, pad_token=EOS, model_max_length=256, chat_template=CHAT_TEMPLATE)
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2)
    with open(path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": vocab[config["eos_token"]], "pad_token_id": vocab[config["pad_token"]]}, f,
                  indent=2)


def buggy(answer: str) -> str:
    """The demonstrator's bug: an off-by-one answer."""
    return str(int(answer) + 1)


def arithmetic_demos(tok, examples: list[dict], noise: float) -> tuple[list, list, None]:
    """(prompts, completions, None): DEMOS_PER_PROBLEM demonstrations of each problem, a fraction
    `noise` of them buggy."""
    n_bug = round(noise * DEMOS_PER_PROBLEM)
    prompts = [tok.encode(ex["prompt"]) for ex in examples for _ in range(DEMOS_PER_PROBLEM)]
    answers = [buggy(ex["answer"]) if i < n_bug else ex["answer"]
               for ex in examples for i in range(DEMOS_PER_PROBLEM)]
    return prompts, [tok.encode(a) + [tok.eos_token_id] for a in answers], None


def calculator_demos(tok, examples: list[dict], tool_every: int) -> tuple[list, list, list]:
    """(prompts, completions, loss masks): one demonstration per problem, rendered by the chat
    template exactly as a rollout builds it (tools.py). Every `tool_every`-th calls the calculator
    (the call's turn, the tool result's ids, masked out, then the answer); the rest answer directly."""
    from rlcore.data.tasks import calculator
    from rlcore.tools.schema import tool_schema
    from rlcore.tools.turns import tool_suffix_ids

    schemas, prompts, completions, masks = [tool_schema(calculator)], [], [], []
    for i, ex in enumerate(examples):
        user = [{"role": "user", "content": ex["prompt"]}]
        prompt = tok.apply_chat_template(user, tools=schemas, tokenize=True)
        answer = tok.encode(f"={ex['answer']}") + [tok.eos_token_id]  # "=" first: greedy picks it over a call
        if i % tool_every:
            completion, mask = answer, [1] * len(answer)
        else:
            call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": ex["prompt"]}}}
            turn = tok.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                                           tools=schemas, add_generation_prompt=False, tokenize=True)
            turn = turn[len(prompt):turn.index(tok.eos_token_id, len(prompt)) + 1]
            result = tool_suffix_ids(tok, [{"role": "tool", "name": "calculator", "content": calculator(ex["prompt"])}])
            completion, mask = turn + result + answer, [1] * len(turn) + [0] * len(result) + [1] * len(answer)
        prompts.append(prompt)
        completions.append(completion)
        masks.append(mask)
    return prompts, completions, masks


# SFT settings per task: the arithmetic model's are what the README's accuracies come from.
RECIPES = {"arithmetic": dict(steps=800, batch_size=128, lr=3e-3, noise=0.6),
           "multiplication": dict(steps=800, batch_size=64, lr=3e-3, tool_every=3, problems=20000)}


def build_embedded_model(path: str | Path, examples: list[dict], *, task: str = "arithmetic", seed: int = 0,
                         threads: int | None = 2, **recipe) -> Path:
    """Create (once) the embedded checkpoint of `task` at `path` from task examples with
    `prompt`/`answer`, by SFT with RECIPES[task], which `recipe` overrides (steps, batch_size, ...).

    The SFT runs on `threads` torch threads (None: as the process is set), then the process's
    count is restored. Floating-point sums depend on the thread count, so a fixed count gives a
    first run the same warm start whatever OMP_NUM_THREADS says (torchrun sets 1): 2 is what the
    README's before/after accuracies come from."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return path
    print(f"building the embedded {task} model at {path} (first run only)", flush=True)
    from rlcore.models.tokenizer import Tokenizer

    recipe = {**RECIPES[task], **recipe}
    chat = task == "multiplication"
    # In a directory of this process's own, then renamed into place: builds on machines that share a
    # cache do not collide, and one that fails or is interrupted (Ctrl-C) removes only its own files.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{path.name}.build-{os.getpid()}-", dir=path.parent))
    try:
        write_char_tokenizer(tmp, chat=chat)
        tok = Tokenizer.from_dir(tmp)
        torch.manual_seed(seed)
        model = Transformer(ModelConfig.from_hf(TOOL_ARCH if chat else ARCH))
        model.apply(init_weights)
        prompts, completions, masks = (calculator_demos(tok, examples[:recipe["problems"]], recipe["tool_every"])
                                       if chat else arithmetic_demos(tok, examples, recipe["noise"]))
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            sft(model, prompts, completions, pad_id=tok.pad_token_id, steps=recipe["steps"],
                batch_size=recipe["batch_size"], lr=recipe["lr"], seed=seed, log_every=100, masks=masks)
        finally:
            torch.set_num_threads(before)
        files = {n: tmp / n for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")}
        save_model(model, tmp / "model", extra_files=files)
        try:
            os.rename(tmp / "model", path)
        except OSError:  # another process finished first: keep its build
            if not (path / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


EMBEDDED_TASKS = {"arithmetic": "v2", "multiplication": "v1"}  # the tasks with an embedded model, and its version


def cache_dir_name(seed, num_eval, task: str = "arithmetic") -> str:
    """The cache directory name of the embedded model for `data.seed` / `data.num_eval` (the held-out
    problems it must never train on); also a glob or regex pattern when given "*" or groups."""
    return f"embedded-{task}-{EMBEDDED_TASKS[task]}-seed{seed}-eval{num_eval}"


def why_a_model_of_its_own(cache: Path, seed: int, num_eval: int) -> str | None:
    """Why a run with `data.seed` / `data.num_eval` builds an embedded model while `cache` holds another,
    and which values reuse that one (the default's where it is there). None when the cache holds none or
    this one, or the run has the default's values: its first run, as the build line says."""
    built = {(int(m[1]), int(m[2]))  # finished models
             for p in cache.glob(cache_dir_name("*", "*") + "/model.safetensors")
             if (m := re.fullmatch(cache_dir_name(r"(\d+)", r"(\d+)"), p.parent.name))}
    with open(EMBEDDED_DEFAULT, "rb") as f:
        data = tomllib.load(f)["data"]
    default = (data["seed"], data["num_eval"])
    if not built or (seed, num_eval) in built or (seed, num_eval) == default:
        return None
    cached = default if default in built else min(built)
    keys = [(key, new, old) for key, new, old in zip(("data.seed", "data.num_eval"), (seed, num_eval), cached)
            if new != old]
    return (f"with {' and '.join(f'{key} = {new}' for key, new, _ in keys)} the run needs an embedded model of its "
            f"own: the model never trains on the problems that data.seed and data.num_eval hold out (its SFT takes "
            f"about 1-2 minutes, once); keep {' and '.join(f'{key} = {old}' for key, _, old in keys)} to reuse the "
            f"cached one")


def init_weights(m: torch.nn.Module) -> None:
    if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(m.weight, std=0.02)
        if getattr(m, "bias", None) is not None:
            torch.nn.init.zeros_(m.bias)

