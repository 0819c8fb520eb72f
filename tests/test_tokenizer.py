"""rlcore.models.tokenizer against transformers' AutoTokenizer on the same files.

Each test builds a tiny byte-level BPE with the `tokenizers` library, saves it the way transformers
does (PreTrainedTokenizerFast.save_pretrained) and checks that rlcore reads the same ids, text,
special tokens and chat-template renderings as AutoTokenizer.from_pretrained(dir). The prompts the
loop builds (rlcore.data.datasets.format_prompt) are checked against TRL's maybe_apply_chat_template too.

tests/chat_templates/ holds the real templates, byte for byte as the model repos ship them (copied
from TRL's trl/chat_templates): Qwen2.5 Instruct, Llama 3 Instruct and Llama 3.1 Instruct.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers

from rlcore.data.datasets import format_prompt
from rlcore.models.tokenizer import Tokenizer, check_vocab_fits

transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")

TEMPLATES = Path(__file__).parent / "chat_templates"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Reinforcement learning from verifiable rewards: the answer is 42.",
    "数学问题：二加二等于四。",
    "café naïve résumé — déjà vu 🙂",
    "def f(x):\n    return x * 2\n",
]

TEXTS = [
    "Hello world!",
    "  leading spaces, trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "数学问题：二加二等于四。",
    "emoji 🙂🚀 and accents: café, Ångström",
    "unseen words: zyxwvut qqq",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "",
]

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eom_id|>", "<|eot_id|>"]

MESSAGES = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "What is 2 + 2?  "},
    {"role": "assistant", "content": "  It is 4. 🙂"},
    {"role": "user", "content": "And 数学 × 3?\n"},
]


def train_bpe(special_tokens: list[str], bos: str | None = None) -> RustTokenizer:
    """A byte-level BPE of a few hundred tokens, with `special_tokens` first; `bos` is prepended on
    encode by the post-processor, as in Llama 3's tokenizer.json."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def save_checkpoint(path: Path, backend: RustTokenizer, chat_template: str | None = None,
                    template_in_config: bool = False, **special_tokens) -> Path:
    """Save as transformers does; the template goes to chat_template.jinja, or into
    tokenizer_config.json with template_in_config."""
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)
    hf.chat_template = chat_template
    hf.save_pretrained(path, save_jinja_files=not template_in_config)
    return path


QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def qwen2_pipeline_checkpoint(path: Path) -> Path:
    """tokenizer.json with Qwen2's real pipeline (NFC, digit-splitting regex, byte-level), saved with
    tokenizer_class Qwen2Tokenizer as Qwen2.5 ships: transformers v5 then rebuilds the pipeline in
    Python from the vocab and merges, while rlcore runs tokenizer.json as saved."""
    backend = train_bpe(QWEN_SPECIALS)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    save_checkpoint(path, backend, (TEMPLATES / "qwen2_5.jinja").read_text(), eos_token="<|im_end|>",
                    pad_token="<|endoftext|>")
    edit_json(path / "tokenizer_config.json", tokenizer_class="Qwen2Tokenizer", bos_token=None, unk_token=None)
    return path


def qwen_checkpoint(path: Path, chat_template: str | None = None, template_in_config: bool = False) -> Path:
    """Qwen2.5 Instruct's special tokens: eos <|im_end|>, pad <|endoftext|>, no BOS."""
    return save_checkpoint(path, train_bpe(QWEN_SPECIALS), chat_template, template_in_config,
                           eos_token="<|im_end|>", pad_token="<|endoftext|>")


def llama_checkpoint(path: Path, chat_template: str | None = None, template_in_config: bool = False) -> Path:
    """Llama 3 Instruct's special tokens: bos <|begin_of_text|> added on encode, eos <|eot_id|>, no pad."""
    backend = train_bpe(LLAMA_SPECIALS, bos="<|begin_of_text|>")
    return save_checkpoint(path, backend, chat_template, template_in_config,
                           bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


CHECKPOINTS = {"qwen": qwen_checkpoint, "llama": llama_checkpoint}


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def load_both(path: Path) -> tuple[Tokenizer, "transformers.PreTrainedTokenizerBase"]:
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


def sentencepiece_backend() -> RustTokenizer:
    """Llama 2's layout: a BPE over "▁"-prefixed pieces with byte fallback, "▁" put before the
    text by the normalizer (tokenizers' conversion of a SentencePiece model), BOS by the
    post-processor."""
    trained = RustTokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = trained.normalizer
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return backend


@pytest.mark.parametrize("layout", ["sentencepiece", "byte_level"])
def test_stop_strings_match_where_a_completion_spells_them(tmp_path, layout):
    """A rollout stop string is matched on token ids. SentencePiece encodes a text on its own with
    "▁" before it, which the same text inside a completion lacks: `stop_ids` also gives the
    encoding it has there. (Before, no stop string ever matched on a Llama 2 tokenizer.)"""
    if layout == "sentencepiece":
        path, prompt = save_checkpoint(tmp_path, sentencepiece_backend(), bos_token="<s>", eos_token="</s>"), "hi"
    else:
        path, prompt = qwen_checkpoint(tmp_path), "<|im_start|>assistant\n"
    tok = Tokenizer.from_dir(path)
    completion = "Let me think step by step. The answer is 4.\n\nQuestion: what is two plus two? <answer>4</answer>"
    ids = tok.encode(prompt + completion, add_special_tokens=False)[len(tok.encode(prompt, add_special_tokens=False)):]
    assert tok.decode(ids) == completion if layout == "byte_level" else completion in tok.decode(ids)
    for stop in ["\n\n", "</answer>", "Question:", "."]:
        assert any(ids[i:i + len(s)] == s for s in tok.stop_ids(stop) for i in range(len(ids))), stop
        assert tok.stop_ids(stop)[0] == tok.encode(stop, add_special_tokens=False)


# ---- text <-> ids ----------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["eos_added_not_special", "special_in_tokenizer_config"])
def test_tokens_transformers_treats_as_special_are_dropped_from_decoded_text(tmp_path, case):
    """transformers makes every named special token, and every token tokenizer_config.json's
    added_tokens_decoder marks special, special, whatever tokenizer.json says. Otherwise the
    completion text reward functions get would keep the EOS (a format reward then scores 0)."""
    from tokenizers import AddedToken

    backend = train_bpe(QWEN_SPECIALS)
    eos = "<|im_end|>"
    if case == "eos_added_not_special":
        backend.add_tokens([AddedToken("<|eot|>", special=False, normalized=False)])
        eos = "<|eot|>"
    else:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    path = save_checkpoint(tmp_path, backend, eos_token=eos, pad_token="<|endoftext|>")
    if case == "special_in_tokenizer_config":  # as transformers 4 saved it: <think> special there only
        edit_json(path / "tokenizer_config.json", added_tokens_decoder={
            str(i): {"content": t.content, "special": True} for i, t in backend.get_added_tokens_decoder().items()})
    ours, ref = load_both(path)
    ids = ref.encode("<think>ok</think> The answer is 4.", add_special_tokens=False) + [ref.convert_tokens_to_ids(eos)]
    assert ours.eos_token_id == ids[-1]
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=True).endswith("answer is 4.")


@pytest.mark.parametrize("family", CHECKPOINTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tmp_path, family, add_special_tokens):
    ours, ref = load_both(CHECKPOINTS[family](tmp_path))
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=add_special_tokens) == \
            ref.encode(text, add_special_tokens=add_special_tokens), text


@pytest.mark.parametrize("family", CHECKPOINTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tmp_path, family, skip_special_tokens):
    ours, ref = load_both(CHECKPOINTS[family](tmp_path))
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == \
            ref.decode(ids, skip_special_tokens=skip_special_tokens), text


def test_truncation_and_padding_saved_in_tokenizer_json_are_off_as_in_transformers(tmp_path):
    backend = train_bpe(QWEN_SPECIALS)
    backend.enable_truncation(max_length=4)
    backend.enable_padding(pad_id=backend.token_to_id("<|endoftext|>"), pad_token="<|endoftext|>", length=64)
    ours, ref = load_both(save_checkpoint(tmp_path, backend, eos_token="<|im_end|>"))
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
    assert len(ours.encode(TEXTS[1])) > 4
    assert ours.pad_token_id == ref.pad_token_id == backend.token_to_id("<|endoftext|>")


def test_qwen2_tokenizer_class_agrees_with_its_tokenizer_json(tmp_path):
    ours, ref = load_both(qwen2_pipeline_checkpoint(tmp_path))
    assert type(ref).__name__ == "Qwen2Tokenizer"
    for text in TEXTS + ["e\u0301 vs \u00e9, 12345 digits", "it's we'll THEY'D"]:
        assert ours.encode(text) == ref.encode(text), text
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token) == \
        (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token)
    assert_chat_matches(ours, ref, MESSAGES, add_generation_prompt=True)


def test_split_special_tokens_encodes_special_token_text_as_plain_text(tmp_path):
    path = qwen_checkpoint(tmp_path)
    edit_json(path / "tokenizer_config.json", split_special_tokens=True)
    ours, ref = load_both(path)
    text = "<|im_start|>user\nhi<|im_end|>"
    assert ours.encode(text) == ref.encode(text)
    assert ours.eos_token_id not in ours.encode(text)


def test_decode_round_trips_unicode_and_whitespace(tmp_path):
    ours = Tokenizer.from_dir(qwen_checkpoint(tmp_path))
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text


def test_batch_decode_matches_transformers_and_accepts_tensors(tmp_path):
    ours, ref = load_both(llama_checkpoint(tmp_path))
    batch = [ref.encode(text) for text in TEXTS[:3]]
    expected = ref.batch_decode(batch, skip_special_tokens=True)
    assert ours.batch_decode(batch, skip_special_tokens=True) == expected
    assert ours.decode(torch.tensor(batch[0]), skip_special_tokens=True) == expected[0]
    same_length = [ids[:4] for ids in batch]
    assert ours.batch_decode(torch.tensor(same_length)) == ref.batch_decode(same_length)


@pytest.mark.parametrize("family", CHECKPOINTS)
def test_vocab_size_counts_added_tokens_like_len_of_transformers(tmp_path, family):
    ours, ref = load_both(CHECKPOINTS[family](tmp_path))
    assert ours.vocab_size == len(ref)


# ---- special tokens --------------------------------------------------------------------------

@pytest.mark.parametrize("family", CHECKPOINTS)
def test_special_tokens_match_transformers(tmp_path, family):
    ours, ref = load_both(CHECKPOINTS[family](tmp_path))
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == (ref.bos_token, ref.eos_token, ref.unk_token)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_id == ref.eos_token_id


def test_pad_token_id_matches_transformers_when_set(tmp_path):
    ours, ref = load_both(qwen_checkpoint(tmp_path))
    assert ours.pad_token == ref.pad_token == "<|endoftext|>"
    assert ours.pad_token_id == ref.pad_token_id


def test_pad_falls_back_to_eos_when_tokenizer_has_none(tmp_path):
    ours, ref = load_both(llama_checkpoint(tmp_path))
    assert ref.pad_token_id is None
    assert ours.pad_token is None
    assert ours.pad_token_id == ref.eos_token_id


def test_eos_ids_are_tokenizer_eos_then_generation_config_eos(tmp_path):
    path = qwen_checkpoint(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    im_end, endoftext = ref.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    transformers.GenerationConfig(eos_token_id=[endoftext, im_end]).save_pretrained(path)
    ours = Tokenizer.from_dir(path)
    generation_eos = transformers.GenerationConfig.from_pretrained(path).eos_token_id
    assert set(ours.eos_token_ids) == {ref.eos_token_id, *generation_eos}
    assert ours.eos_token_ids == [im_end, endoftext]
    assert ours.eos_token_id == ref.eos_token_id == im_end


def test_eos_ids_read_an_int_eos_from_generation_config_and_config_json(tmp_path):
    path = llama_checkpoint(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    eom, end_of_text = ref.convert_tokens_to_ids(["<|eom_id|>", "<|end_of_text|>"])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eom}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": [end_of_text, eom]}))
    assert Tokenizer.from_dir(path).eos_token_ids == [ref.eos_token_id, eom, end_of_text]


def test_added_token_dicts_in_tokenizer_config_match_transformers(tmp_path):
    path = qwen_checkpoint(tmp_path)
    edit_json(path / "tokenizer_config.json",
              eos_token={"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
              pad_token={"__type": "AddedToken", "content": "<|im_start|>"})
    ours, ref = load_both(path)
    assert (ours.eos_token, ours.eos_token_id) == (ref.eos_token, ref.eos_token_id)
    assert (ours.pad_token, ours.pad_token_id) == (ref.pad_token, ref.pad_token_id)


def test_special_tokens_map_overrides_a_config_without_added_tokens_decoder(tmp_path):
    path = qwen_checkpoint(tmp_path)  # transformers v5 saves no added_tokens_decoder
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    ours, ref = load_both(path)
    assert ours.eos_token == ref.eos_token == "<|endoftext|>"
    assert ours.eos_token_id == ref.eos_token_id


def test_special_tokens_map_is_ignored_when_config_has_added_tokens_decoder(tmp_path):
    path = qwen_checkpoint(tmp_path)
    backend = RustTokenizer.from_file(str(path / "tokenizer.json"))
    decoder = {str(i): {"content": token.content, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
               for i, token in backend.get_added_tokens_decoder().items()}
    edit_json(path / "tokenizer_config.json", added_tokens_decoder=decoder)  # as transformers v4 saved it
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    ours, ref = load_both(path)
    assert ours.eos_token == ref.eos_token == "<|im_end|>"


# ---- chat templates --------------------------------------------------------------------------

# (checkpoint, template file) pairs as the model repos ship them
CHAT_CASES = {
    "qwen2.5": (qwen_checkpoint, "qwen2_5.jinja"),
    "llama3": (llama_checkpoint, "llama3.jinja"),
    "llama3.1": (llama_checkpoint, "llama3_1.jinja"),
}


def chat_checkpoint(path: Path, case: str, template_in_config: bool = False) -> Path:
    build, template_file = CHAT_CASES[case]
    return build(path, (TEMPLATES / template_file).read_text(encoding="utf-8"), template_in_config)


def assert_chat_matches(ours: Tokenizer, ref, messages: list[dict], **kwargs) -> None:
    """Same text and same ids as transformers' apply_chat_template."""
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == ref.apply_chat_template(messages, tokenize=False, **kwargs)
    ref_ids = ref.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert ours.apply_chat_template(messages, tokenize=True, **kwargs) == ref_ids


@pytest.mark.parametrize("case", CHAT_CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("template_in_config", [False, True], ids=["chat_template.jinja", "tokenizer_config"])
def test_chat_template_matches_transformers(tmp_path, case, add_generation_prompt, template_in_config):
    path = chat_checkpoint(tmp_path, case, template_in_config)
    assert (path / "chat_template.jinja").exists() != template_in_config
    ours, ref = load_both(path)
    assert_chat_matches(ours, ref, MESSAGES, add_generation_prompt=add_generation_prompt)
    assert_chat_matches(ours, ref, MESSAGES[1:3], add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("case", CHAT_CASES)
@pytest.mark.parametrize("prefill", ["<think>", "<think>\n ", "  Let me see: 2 + 2", ""])
def test_continue_final_message_matches_transformers(tmp_path, case, prefill):
    """The conversation is left open inside the final message; Llama 3's templates trim the content,
    and transformers then cuts the trailing whitespace too."""
    ours, ref = load_both(chat_checkpoint(tmp_path, case))
    messages = [*MESSAGES[:2], {"role": "assistant", "content": prefill}]
    assert_chat_matches(ours, ref, messages, add_generation_prompt=False, continue_final_message=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True).endswith(
        prefill.strip() if case.startswith("llama") else prefill)


def test_continue_final_message_and_add_generation_prompt_together_are_an_error(tmp_path):
    ours = Tokenizer.from_dir(chat_checkpoint(tmp_path, "qwen2.5"))
    with pytest.raises(ValueError, match=r"continue_final_message and add_generation_prompt are both set.*"
                                         r"pass add_generation_prompt=False"):
        ours.apply_chat_template(MESSAGES[:2], continue_final_message=True)


def test_continue_final_message_a_template_drops_is_an_error_naming_it(tmp_path):
    ours = Tokenizer.from_dir(chat_checkpoint(tmp_path, "qwen2.5"))  # Qwen2.5's template skips unknown roles
    with pytest.raises(ValueError, match=r"chat template drops or rewrites the final message \('gpt', '<think>'\), "
                                         r"so it cannot be continued"):
        ours.apply_chat_template([MESSAGES[1], {"role": "gpt", "content": "<think>"}], add_generation_prompt=False,
                                 continue_final_message=True)


def test_qwen_template_writes_its_default_system_message(tmp_path):
    ours, ref = load_both(chat_checkpoint(tmp_path, "qwen2.5"))
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert text == ref.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)


def test_llama_template_ids_start_with_a_single_bos(tmp_path):
    ours, ref = load_both(chat_checkpoint(tmp_path, "llama3.1"))
    ids = ours.apply_chat_template(MESSAGES, tokenize=True)
    assert ids[0] == ref.bos_token_id
    assert ids[1] != ref.bos_token_id


def test_default_of_a_list_of_named_templates_is_used(tmp_path):
    path = qwen_checkpoint(tmp_path)
    templates = [{"name": "tool_use", "template": "tools!"},
                 {"name": "default", "template": (TEMPLATES / "qwen2_5.jinja").read_text()}]
    edit_json(path / "tokenizer_config.json", chat_template=templates)
    ours, ref = load_both(path)
    assert_chat_matches(ours, ref, MESSAGES, add_generation_prompt=True)


@pytest.mark.parametrize("case", ["qwen2.5", "llama3.1"])
def test_tools_render_with_transformers_tojson(tmp_path, case):
    """Tool schemas go through tojson: no ASCII or HTML escaping, indent=4 in Llama 3.1."""
    tools = [{"type": "function", "function": {
        "name": "compare", "description": "Is a < b & b > c? Gibt „ja“ zurück 🙂",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}}}]
    ours, ref = load_both(chat_checkpoint(tmp_path, case))
    assert_chat_matches(ours, ref, MESSAGES[1:2], add_generation_prompt=True, tools=tools)


def test_extra_kwargs_reach_the_template(tmp_path):
    ours, ref = load_both(chat_checkpoint(tmp_path, "llama3.1"))
    assert "Today Date: 01 Jan 2025" in ours.apply_chat_template(MESSAGES, date_string="01 Jan 2025")
    assert_chat_matches(ours, ref, MESSAGES, add_generation_prompt=True, date_string="01 Jan 2025")


def test_template_globals_match_transformers(tmp_path):
    """strftime_now, tojson with options, special token variables, loopcontrols, trim_blocks and
    lstrip_blocks (the indented block tags below), and TRL's {% generation %} tag."""
    template = """{{ strftime_now('%Y-%m-%d') }}|{{ messages | tojson(indent=2) }}|{{ eos_token }}{{ pad_token }}
{% for m in messages %}
    {% if loop.index > 2 %}
        {% break %}
    {% endif %}
    [{{ m.content }}]
{% endfor %}
{% generation %}
{{ 'tagged' }}
{% endgeneration %}
"""
    ours, ref = load_both(qwen_checkpoint(tmp_path, template))
    assert_chat_matches(ours, ref, MESSAGES, add_generation_prompt=False)


def test_raise_exception_in_a_template_is_an_error_naming_the_checkpoint_and_the_system_message(tmp_path):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    path = qwen_checkpoint(tmp_path, template)
    ours = Tokenizer.from_dir(path)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}'s chat template refused the conversation with "
                                         r"roles \['system', 'user', 'assistant', 'user'\]: first message must be user\. The conversation "
                                         r"has a system message \(data\.system_prompt"):  # was a jinja2 traceback
        ours.apply_chat_template(MESSAGES)


def test_a_template_that_is_not_valid_jinja_is_named_with_its_line(tmp_path):
    ours = Tokenizer.from_dir(qwen_checkpoint(tmp_path, "{% for m in messages %}\n{{ m.content }\n{% endfor %}"))
    with pytest.raises(ValueError, match=r"chat template is not valid jinja \(line 2: unexpected '}'\); fix the template"):
        ours.apply_chat_template(MESSAGES)


def test_none_valued_keys_and_reasoning_aliases_match_transformers(tmp_path):
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content | default('<none>') }}"
                "/{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}")
    ours, ref = load_both(qwen_checkpoint(tmp_path, template))
    messages = [{"role": "user", "content": "q", "tool_calls": None},
                {"role": "assistant", "content": None, "reasoning": "think first"}]
    assert_chat_matches(ours, ref, messages, add_generation_prompt=False)


def test_chat_template_argument_overrides_the_checkpoints(tmp_path):
    ours = Tokenizer.from_dir(qwen_checkpoint(tmp_path))
    assert ours.apply_chat_template(MESSAGES[1:2], chat_template="Q: {{ messages[0].content }}") == "Q: What is 2 + 2?  "


# ---- prompts as the loop formats them (rlcore.data.datasets.format_prompt) ------------------------------

PROMPTS = {
    "user": [{"role": "user", "content": "40+28="}],
    "system+user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "40+28="}],
    "multi-turn": MESSAGES,
    "prefill": [{"role": "user", "content": "40+28="}, {"role": "assistant", "content": "<think>"}],
    # a tool result with quotes and a newline: Llama 3.1's template renders it as a JSON string
    "tool": [{"role": "user", "content": "What is 40+28?"}, {"role": "assistant", "content": "calling add"},
             {"role": "tool", "content": 'The result is "68".\nDone.'}],
}


@pytest.mark.parametrize("case", CHAT_CASES)
@pytest.mark.parametrize("kind", PROMPTS)
def test_format_prompt_renders_a_prompt_as_trl_does(tmp_path, case, kind):
    """TRL's apply_chat_template: the generation prompt after a user message; an assistant message
    last is continued (transformers' continue_final_message)."""
    data_utils = pytest.importorskip("trl.data_utils", reason="TRL is the reference")
    ours, ref = load_both(chat_checkpoint(tmp_path, case))
    messages = PROMPTS[kind]
    prefill = kind == "prefill"
    expected = ref.apply_chat_template(messages, add_generation_prompt=not prefill, continue_final_message=prefill,
                                       tokenize=True, return_dict=False)
    assert format_prompt({"prompt": messages}, ours) == expected
    trl_text = data_utils.maybe_apply_chat_template({"prompt": messages}, ref)["prompt"]
    assert ref.encode(trl_text, add_special_tokens=False) == expected


def test_format_prompt_rejects_sharegpt_roles_qwen_drops(tmp_path):
    """Qwen2.5's template skips roles it does not know: every such prompt rendered alike."""
    ours = Tokenizer.from_dir(chat_checkpoint(tmp_path, "qwen2.5"))
    prompt = [{"role": "human", "content": "40+28="}, {"role": "gpt", "content": "68"}, {"role": "user", "content": "2+2="}]
    with pytest.raises(ValueError, match=r"message 0 \(role 'human'\): its text '40\+28=' is not in the prompt the "
                                         r"chat template renders.*rename them 'user' and 'assistant'"):
        format_prompt({"prompt": prompt}, ours)


# ---- errors ----------------------------------------------------------------------------------

def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_path_that_is_not_a_directory_is_named(tmp_path, kind):
    path = tmp_path / "ckpt"
    if kind == "file":
        path.write_text("")
    problem = "is a file, not a checkpoint directory" if kind == "file" else "checkpoint directory not found"
    with pytest.raises(FileNotFoundError, match=rf"{path}: {problem}"):
        Tokenizer.from_dir(path)


def test_a_missing_path_that_reads_like_a_hub_id_says_rlcore_never_downloads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"Qwen/Qwen2\.5-0\.5B: checkpoint directory not found; .*rlcore never "
                                                r"downloads: fetch it first, e\.g\. hf download "
                                                r"Qwen/Qwen2\.5-0\.5B --local-dir ckpt/Qwen2\.5-0\.5B"):
        Tokenizer.from_dir(Path("Qwen/Qwen2.5-0.5B"))


def test_corrupt_tokenizer_json_names_the_file(tmp_path):
    path = qwen_checkpoint(tmp_path)
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"tokenizer\.json could not be loaded by tokenizers"):
        Tokenizer.from_dir(path)


@pytest.mark.parametrize("name, text, message", [
    *((name, '{"eos_token": "<|im_end|>",}', r"is not valid JSON \(Expecting property name .*line 1 column 28")
      for name in ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json")),
    ("tokenizer_config.json", "[1]", ": expected a JSON object, got a list"),
    ("config.json", "[1]", ": expected a JSON object, got a list"),
    ("config.json", '{"eos_token_id": "<eos>"}', r": eos_token_id = '<eos>': expected a token id"),
])
def test_a_bad_json_file_is_named_with_its_problem(tmp_path, name, text, message):
    path = qwen_checkpoint(tmp_path)
    (path / name).write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(path / name)) + " ?" + message):
        Tokenizer.from_dir(path)


def test_missing_chat_template_names_the_dir_and_the_fix(tmp_path):
    path = qwen_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="has no chat template") as err:
        Tokenizer.from_dir(path).apply_chat_template(MESSAGES)
    assert str(path) in str(err.value) and "chat_template.jinja" in str(err.value)


def test_checkpoint_without_any_eos_is_an_error(tmp_path):
    path = llama_checkpoint(tmp_path)
    edit_json(path / "tokenizer_config.json", eos_token=None)
    with pytest.raises(ValueError, match="no EOS token in tokenizer_config.json, generation_config.json or config"):
        Tokenizer.from_dir(path)


def test_special_token_outside_the_vocab_is_named(tmp_path):
    path = qwen_checkpoint(tmp_path)
    edit_json(path / "tokenizer_config.json", eos_token="</s>")
    with pytest.raises(ValueError, match=r"eos_token '</s>' is not in tokenizer\.json's vocabulary"):
        Tokenizer.from_dir(path)


def test_vocab_larger_than_embedding_is_an_error_naming_both_sizes(tmp_path):
    path = qwen_checkpoint(tmp_path)
    tok = Tokenizer.from_dir(path)
    rows_needed = tok.vocab_size  # ids are contiguous here
    with pytest.raises(ValueError, match=rf"needs {rows_needed} embedding rows, but the model has {rows_needed - 1}"):
        check_vocab_fits(tok, rows_needed - 1, path)
    with pytest.raises(ValueError, match=str(path)):
        check_vocab_fits(tok, rows_needed - 1, path)


def test_an_eos_id_past_the_embedding_is_an_error(tmp_path):
    path = qwen_checkpoint(tmp_path)
    rows = Tokenizer.from_dir(path).vocab_size
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [rows + 5]}))
    tok = Tokenizer.from_dir(path)
    check_vocab_fits(tok, rows + 6, path)
    with pytest.raises(ValueError, match=rf"eos_token_id \[{rows + 5}\] is past the model's {rows + 5} embedding rows"):
        check_vocab_fits(tok, rows + 5, path)


def test_vocab_smaller_than_embedding_is_fine(tmp_path):
    tok = Tokenizer.from_dir(qwen_checkpoint(tmp_path))
    check_vocab_fits(tok, tok.vocab_size, tmp_path)
    check_vocab_fits(tok, tok.vocab_size + 128, tmp_path)  # Qwen pads its embedding rows
