"""GGUF files (llama.cpp's format) in: `import_gguf` writes a Hugging Face checkpoint directory.

A GGUF holds the weights, often quantized, under llama.cpp's tensor names, and everything else
as metadata: the architecture under llama.cpp's keys, and the tokenizer as its vocabulary, merges
and token types (no tokenizer.json). Importing undoes what llama.cpp's converter did: it
dequantizes every tensor with the `gguf` package (llama.cpp's own reader), renames it, undoes the
row permutation the converter applies to Llama's q/k projections, and rebuilds config.json and
tokenizer.json. transformers' own GGUF loading (`from_pretrained(dir, gguf_file=...)`) gets the
same weights and tokenizer from the same file; tests/test_gguf.py holds the two side by side.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from rlcore.models.hf_checkpoint import DTYPES, save_model
from rlcore.models.transformer import ModelConfig, Transformer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# llama.cpp's tensor names -> transformers' (blk.N.* lives under model.layers.N.)
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}

# tokenizer.ggml.pre -> the regex text is split with before byte-level BPE, as transformers builds
# it from a GGUF and llama.cpp tokenizes (None: GPT-2's, inside the ByteLevel pre-tokenizer).
# llama.cpp's "smollm" also isolates each digit; SmolLM2's merges never join a digit to anything,
# so GPT-2's regex (transformers' choice) gives the same ids.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"gpt2": None, "smollm": None, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT,
                  "llama-v3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class GGUFError(ValueError):
    """A GGUF file that cannot be imported; the message names the file, the problem and the fix."""


def import_gguf(file: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Write the llama / qwen2 / qwen3 model in GGUF `file` to `out_dir` as a Hugging Face
    checkpoint (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
    generation_config.json) in `dtype` (float32, bfloat16 or float16), atomically. Every tensor
    type the `gguf` package dequantizes is read, to fp32 first and then to `dtype`."""
    try:
        import gguf
    except ImportError:
        raise ImportError("importing a GGUF file needs the gguf package (llama.cpp's reader): "
                          "pip install -e \".[gguf]\" in a checkout, or pip install gguf") from None
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    file = Path(file)
    reader = read_gguf(gguf, file)
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    config = model_config(meta, tensors, file)
    backend, tokenizer_config = build_tokenizer(meta, file)  # before the slow part: its errors come first
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(config, source=str(file)))
    model.load_state_dict(dequantized_weights(gguf, tensors, model, file, DTYPES[dtype]), strict=True, assign=True)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    with tempfile.TemporaryDirectory() as tmp:
        backend.save(os.path.join(tmp, "tokenizer.json"))
        for name, content in (("tokenizer_config.json", tokenizer_config), ("generation_config.json", generation)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2, ensure_ascii=False)
        return save_model(model, out_dir, extra_files={name: os.path.join(tmp, name) for name in os.listdir(tmp)})


def dequantized_weights(gguf, tensors: dict, model: Transformer, file: Path, dtype: torch.dtype) -> dict:
    """The state dict of `model` (built on the meta device) from the file's tensors: each
    dequantized to fp32, renamed, Llama's q/k rows put back in transformers' order, cast to `dtype`."""
    cfg, expected = model.config, {name: p.shape for name, p in model.state_dict().items()}
    state = {}
    for name, tensor in tensors.items():
        hf_name = hf_tensor_name(name, file)
        try:
            w = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        except NotImplementedError:
            raise GGUFError(f"{file}: tensor {name} is stored as {tensor.tensor_type.name}, which gguf "
                            f"{version('gguf')} cannot dequantize; upgrade it (pip install -U gguf)") from None
        if hf_name not in expected or w.shape != expected[hf_name]:
            want = f"shape {tuple(expected[hf_name])}" if hf_name in expected else "no such tensor"
            raise GGUFError(f"{file}: tensor {name} ({hf_name}, shape {tuple(w.shape)}) does not fit the "
                            f"{cfg.model_type} model its metadata describes ({want}); the file is inconsistent")
        if cfg.model_type == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = unpermute_rows(w, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        state[hf_name] = w.to(dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise GGUFError(f"{file}: no tensors for {missing[:6]}{' ...' if len(missing) > 6 else ''}; "
                        f"the file is incomplete")
    return state


def read_gguf(gguf, file: Path):
    """`gguf.GGUFReader(file)`, with a file that is not GGUF, or is cut short, named as such."""
    with open(file, "rb") as f:  # a missing file raises FileNotFoundError, naming it
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{file} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); give a .gguf "
                        f"model file, llama.cpp's format")
    try:
        reader = gguf.GGUFReader(file)
    except (ValueError, IndexError, OSError) as e:  # numpy fails to fit what the header promises into the file
        raise GGUFError(f"{file} is truncated or damaged ({e}); download it again") from None
    return reader


def model_config(meta: dict, tensors: dict, file: Path) -> dict:
    """config.json from the metadata, as llama.cpp reads it (key names under the architecture)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{file}: architecture {arch!r} is not supported; rlcore imports "
                        f"{', '.join(ARCHITECTURES)} GGUF files (for another family, use its Hugging Face "
                        f"checkpoint if rlcore supports the family)")
    if "rope_freqs.weight" in tensors:
        raise GGUFError(f"{file}: a rope_freqs tensor (Llama 3.1-style rope scaling) is not supported from GGUF; "
                        f"use the model's Hugging Face checkpoint")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise GGUFError(f"{file}: rope scaling {scaling!r} is not supported from GGUF (only linear); use the "
                        f"model's Hugging Face checkpoint")
    required = ("embedding_length", "feed_forward_length", "block_count", "context_length", "attention.head_count",
                "attention.layer_norm_rms_epsilon") + (("rope.scaling.factor",) if scaling == "linear" else ())
    if missing := [f"{arch}.{k}" for k in required if f"{arch}.{k}" not in meta]:
        raise GGUFError(f"{file}: the metadata has no {', '.join(missing)}; the file is incomplete")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{file}: no token_embd.weight tensor (the embedding); the file is incomplete")
    value = {k.removeprefix(f"{arch}."): v for k, v in meta.items() if k.startswith(f"{arch}.")}
    heads, hidden = int(value["attention.head_count"]), int(value["embedding_length"])
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),  # ggml order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": int(value["feed_forward_length"]),
        "num_hidden_layers": int(value["block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(value.get("attention.head_count_kv", heads)),
        "head_dim": int(value.get("attention.key_length") or value.get("rope.dimension_count") or hidden // heads),
        "max_position_embeddings": int(value["context_length"]),
        "rms_norm_eps": f32_value(value["attention.layer_norm_rms_epsilon"]),
        "rope_theta": f32_value(value.get("rope.freq_base", 10000.0)),
        # llama.cpp writes the output projection only when it is not the embedding
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": f32_value(value["rope.scaling.factor"])}
    if arch != "qwen2":  # Qwen2 always has q/k/v biases; Llama and Qwen3 say so in attention_bias
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        config["mlp_bias"] = "blk.0.ffn_gate.bias" in tensors
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if (index := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{name}_token_id"] = int(index)
    return config


def f32_value(value: float) -> float:
    """A float32 of the metadata as its shortest decimal (1e-05, not 9.999999747378752e-06): the
    same float32 wherever it is used."""
    return float(str(np.float32(value)))


def hf_tensor_name(name: str, file: Path) -> str:
    """transformers' name of llama.cpp's tensor `name` (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight)."""
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name):
        if m[2] in LAYER_NAMES:
            return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.{m[3]}"
    elif (m := re.fullmatch(r"(\w+)\.(weight|bias)", name)) and m[1] in TOP_NAMES:
        return f"{TOP_NAMES[m[1]]}.{m[2]}"
    raise GGUFError(f"{file}: tensor {name} has no place in a llama, qwen2 or qwen3 model; the file holds "
                    f"something else")


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which reorders each head's q/k rows (weight `[heads * D, H]` or
    bias `[heads * D]`) from the two rotated halves (transformers' rotate_half) to interleaved
    pairs (GGML's rope): row 2i + j of a head came from row j * D/2 + i."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def build_tokenizer(meta: dict, file: Path) -> tuple[Tokenizer, dict]:
    """tokenizer.json's Tokenizer and tokenizer_config.json's dict from the tokenizer metadata, as
    transformers builds them from a GGUF: byte-level BPE over the file's vocabulary and merges, its
    control tokens special, its user-defined ones added, BOS/EOS added on encode as the file says."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{file}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; rlcore builds "
                        f"only byte-level BPE tokenizers ('gpt2': Llama 3, Qwen, SmolLM files); use the model's "
                        f"Hugging Face checkpoint, whose tokenizer.json rlcore reads")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{file}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; rlcore knows "
                        f"{', '.join(PRE_TOKENIZERS)}; use the model's Hugging Face checkpoint")
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    # Tokens are spelled in GPT-2's byte alphabet; one that is not (a llama.cpp mislabel) is respelled.
    spelling = byte_alphabet()
    alphabet = set(spelling)
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                            fuse_unk=False))
    split = PRE_TOKENIZERS[pre]
    backend.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                             pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                      pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                               use_regex=False)]))
    backend.decoder = decoders.ByteLevel()

    special = {name: tokens[int(meta[f"tokenizer.ggml.{key}"])] for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id")) if meta.get(f"tokenizer.ggml.{key}") is not None}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and "bos_token" in special
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in special
    bos, eos = special.get("bos_token"), special.get("eos_token")
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[(t, vocab[t]) for t, added in ((bos, add_bos), (eos, add_eos)) if added])

    # Control tokens (<|im_end|>) are special: whole in the text, dropped by skip_special_tokens.
    # User-defined ones (<think>) are matched whole but kept in decoded text.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                                if k == CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                        if k == USER_DEFINED and t in vocab])
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                      "single_word": t.single_word, "special": t.special}
             for i, t in sorted(backend.get_added_tokens_decoder().items())}
    # PreTrainedTokenizerFast: transformers runs tokenizer.json as written (a model's own class may rebuild it)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": add_bos,
                        "add_eos_token": add_eos, "added_tokens_decoder": added,
                        "clean_up_tokenization_spaces": False}
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    return backend, tokenizer_config


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the bytes 0..255 (transformers' bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
