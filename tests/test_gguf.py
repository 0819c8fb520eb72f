"""rlcore.models.gguf against transformers' own GGUF loading of the same file.

Each test writes a tiny GGUF with llama.cpp's writer (gguf.GGUFWriter), as llama.cpp's converter
would from a tiny random transformers model: its tensors renamed, Llama's q/k rows permuted, some
tensors F16 or quantized, a small byte-level BPE tokenizer as metadata. The import must give the
source model's weights through the file's rounding, and the logits, token ids and chat template
that `from_pretrained(dir, gguf_file=...)` gives, in fp32, bit for bit.
"""

import json
import sys

import numpy as np
import pytest
import torch

from conftest import make_hf_model
from rlcore.cli import main
from rlcore.models.gguf import import_gguf
from rlcore.models.hf_checkpoint import load_model
from rlcore.models.tokenizer import Tokenizer
from test_tokenizer import LLAMA_SPECIALS, MESSAGES, QWEN_SPECIALS, TEMPLATES, TEXTS, train_bpe

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test files")
transformers = pytest.importorskip("transformers", reason="transformers' GGUF loading is the reference")
Q = gguf.GGMLQuantizationType

# llama.cpp's tensor names, as its converter writes them, and the ggml type each is written in
# here (1-D tensors, the norms and biases, are F32 as in llama.cpp's files)
HF_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
TYPES = {"token_embd": Q.F16, "attn_q": Q.Q8_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.F16,
         "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0, "output": Q.Q8_0}

# family -> (conftest family, its overrides, tokenizer: specials, pre, bos, eos, pad, add_bos, template)
QWEN_TOKENIZER = (QWEN_SPECIALS, "qwen2", None, "<|im_end|>", "<|endoftext|>", False, "qwen2_5.jinja")
FAMILIES = {
    "llama": ("llama", {}, (LLAMA_SPECIALS, "llama-bpe", "<|begin_of_text|>", "<|eot_id|>", None, True,
                            "llama3.jinja")),
    "llama_tied": ("llama_tied", {}, (QWEN_SPECIALS, "gpt2", None, "<|im_end|>", "<|endoftext|>", False,
                                      "qwen2_5.jinja")),
    "qwen2": ("qwen2", {}, QWEN_TOKENIZER),
    # transformers' GGUF loader leaves Qwen3's head_dim at Qwen3Config's default, 128
    "qwen3_tied": ("qwen3_tied", {"head_dim": 128}, QWEN_TOKENIZER),
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's q/k rows from rotate-half halves to
    interleaved pairs, which GGML's rope rotates."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[rest]}.{kind}"
    return f"{HF_TO_GGUF[stem]}.{kind}"


def through_file(w: np.ndarray, qtype) -> np.ndarray:
    """`w` as the file stores it and the gguf package reads it back: F32 as it is, F16 rounded,
    quantized types block by block."""
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def write_gguf(path, family: str, arch: str | None = None, tokenizer_model: str = "gpt2", **meta):
    """A tiny random `family` model written as llama.cpp's converter would; returns the source
    transformers model. `arch` and `tokenizer_model` override what the file states."""
    source, overrides, (specials, pre, bos, eos, pad, add_bos, template) = FAMILIES[family]
    backend = train_bpe(specials)
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get) + ["<think>"]  # a user-defined token, added whole but not special
    assert [vocab[t] for t in tokens[:-1]] == list(range(len(tokens) - 1))
    types = [3 if t in specials else 4 if t == "<think>" else 1 for t in tokens]
    merges = [" ".join(m) for m in json.loads(backend.to_str())["model"]["merges"]]
    hf = make_hf_model(source, vocab_size=len(tokens), **overrides)
    cfg, arch_name = hf.config, hf.config.model_type

    writer = gguf.GGUFWriter(path, arch or arch_name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    if arch_name == "llama":
        writer.add_rope_dimension_count(cfg.head_dim)
    elif getattr(cfg, "head_dim", None):  # as the converter: only where config.json states it
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(meta.pop("pre", pre))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, token in (("bos", bos), ("eos", eos), ("pad", pad)):
        if token is not None:
            getattr(writer, f"add_{name}_token_id")(tokens.index(token))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template((TEMPLATES / template).read_text())
    for key, value in meta.items():
        writer.add_string(key, value)
    for name, t in hf.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # llama.cpp writes no output tensor for a tied model
        w = t.numpy()
        target = gguf_name(name)
        if arch_name == "llama" and target.split(".")[-2] in ("attn_q", "attn_k"):
            w = llama_cpp_permute(w, cfg.num_attention_heads if ".attn_q." in target else cfg.num_key_value_heads)
        qtype = TYPES.get(target.split(".")[-2], Q.F32) if w.ndim == 2 else Q.F32
        if qtype == Q.F16:
            writer.add_tensor(target, w.astype(np.float16))
        elif qtype == Q.F32:
            writer.add_tensor(target, w)
        else:
            writer.add_tensor(target, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture
def imported(tmp_path):
    """Factory: write `family`'s GGUF and import it; (GGUF file, checkpoint dir, source model)."""

    def build(family: str):
        file = tmp_path / f"{family}.gguf"
        hf = write_gguf(file, family)
        return file, import_gguf(file, tmp_path / family), hf

    return build


def transformers_gguf(file):
    """transformers' own reading of the GGUF file: (model in fp32, tokenizer)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                              dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_loading_the_same_gguf(family, imported):
    file, path, _ = imported(family)
    ref, _ = transformers_gguf(file)
    model = load_model(path)
    ids = torch.randint(0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.logits(model(ids)), ref(ids).logits)  # bit-identical, fp32


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_are_the_source_models_through_the_files_rounding(family, imported):
    """Names mapped and Llama's q/k permutation undone: each weight is the source model's own,
    rounded as the file stores it (F16, Q8_0, Q4_1...), whatever transformers does."""
    _, path, hf = imported(family)
    ours = load_model(path).state_dict()
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        qtype = TYPES.get(gguf_name(name).split(".")[-2], Q.F32) if t.ndim == 2 else Q.F32
        assert torch.equal(ours[name], torch.from_numpy(through_file(t.numpy(), qtype))), name
    if family == "llama":  # guards the check: the file's rows really are in another order
        q = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
        assert not np.array_equal(llama_cpp_permute(q, hf.config.num_attention_heads), q)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_equals_transformers_tokenizer_of_the_same_gguf(family, imported):
    file, path, _ = imported(family)
    _, ref = transformers_gguf(file)
    ours = Tokenizer.from_dir(path)
    want = json.loads(ref.backend_tokenizer.to_str())
    # Where the file has no "<|endoftext|>", transformers' GPT2Tokenizer adds its default one past
    # the model's vocabulary (Llama 3's files have none); rlcore keeps to the file's tokens.
    rows = json.loads((path / "config.json").read_text())["vocab_size"]
    beyond = [t["content"] for t in want["added_tokens"] if t["id"] >= rows]
    assert beyond in ([], ["<|endoftext|>"])
    want["added_tokens"] = [t for t in want["added_tokens"] if t["id"] < rows]
    assert json.loads((path / "tokenizer.json").read_text()) == want
    texts = [t for t in TEXTS + ["<think>plan</think> 12345 + 678", "<|endoftext|>  \t 9"]
             if not any(token in t for token in beyond)]
    for text in texts:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    for prompt in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=prompt) == ref.apply_chat_template(
            MESSAGES, add_generation_prompt=prompt, tokenize=False)


@pytest.mark.parametrize("family", ["llama", "qwen3_tied"])
def test_the_checkpoint_directory_loads_in_transformers(family, imported):
    file, path, _ = imported(family)
    ref, ref_tokenizer = transformers_gguf(file)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ref(ids).logits)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == ref_tokenizer(text)["input_ids"], text
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == ref_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_writes_the_fp32_import_cast(dtype, tmp_path):
    file = tmp_path / "qwen2.gguf"
    write_gguf(file, "qwen2")
    fp32 = load_model(import_gguf(file, tmp_path / "fp32")).state_dict()
    path = import_gguf(file, tmp_path / dtype, dtype=dtype)
    assert json.loads((path / "config.json").read_text())["dtype"] == dtype
    cast = load_model(path, getattr(torch, dtype)).state_dict()
    assert all(torch.equal(cast[name], t.to(getattr(torch, dtype))) for name, t in fp32.items())


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(ValueError, match=r"model.gguf is not a GGUF file \(it starts with b'PK\\x03\\x04'"):
        import_gguf(file, tmp_path / "out")


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_truncated_file_is_named(keep, tmp_path):
    file = tmp_path / "qwen2.gguf"
    write_gguf(file, "qwen2")
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"qwen2.gguf is truncated.*download it again"):
        import_gguf(file, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unsupported_architecture_is_named(tmp_path):
    file = tmp_path / "gemma.gguf"
    write_gguf(file, "qwen2", arch="gemma2")
    with pytest.raises(ValueError, match=r"gemma.gguf: architecture 'gemma2' is not supported; rlcore imports "
                                         r"llama, qwen2, qwen3 GGUF files"):
        import_gguf(file, tmp_path / "out")


def test_an_unsupported_tokenizer_model_is_named(tmp_path):
    file = tmp_path / "spm.gguf"
    write_gguf(file, "llama", tokenizer_model="llama")
    with pytest.raises(ValueError, match=r"spm.gguf: tokenizer model 'llama' \(tokenizer.ggml.model\) is not "
                                         r"supported; rlcore builds only byte-level BPE tokenizers \('gpt2'"):
        import_gguf(file, tmp_path / "out")


def test_an_unknown_pre_tokenizer_is_named_not_guessed(tmp_path):
    file = tmp_path / "tekken.gguf"
    write_gguf(file, "llama", pre="tekken")
    with pytest.raises(ValueError, match=r"pre-tokenizer 'tekken' \(tokenizer.ggml.pre\) is not supported"):
        import_gguf(file, tmp_path / "out")


def test_without_the_gguf_package_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[gguf\]"'):
        import_gguf(tmp_path / "model.gguf", tmp_path / "out")


def test_fetch_without_the_gguf_package_stops_before_downloading(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert main(["fetch-smollm2", "--cache", str(tmp_path / "cache")]) == 1
    assert 'pip install -e ".[gguf]"' in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


def test_cli_import_gguf_writes_the_checkpoint(tmp_path, capsys):
    file = tmp_path / "qwen3.gguf"
    write_gguf(file, "qwen3_tied")
    assert main(["import-gguf", str(file), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {tmp_path / 'out'}"
    assert load_model(tmp_path / "out", "auto").model.embed_tokens.weight.dtype == torch.bfloat16


def test_cli_import_gguf_errors_are_one_line_and_exit_1(tmp_path, capsys):
    file = tmp_path / "notes.gguf"
    file.write_text("not a model")
    assert main(["import-gguf", str(file), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.startswith(f"rlcore: error: {file} is not a GGUF file")
