"""Tokenizer and chat template read from a Hugging Face checkpoint dir, without transformers.

A `Tokenizer` wraps the `tokenizers` library's Rust tokenizer (tokenizer.json) and resolves special
tokens and the chat template from the same files, in the same order, as transformers'
`AutoTokenizer.from_pretrained(dir)`, so the prompt ids built here are the ones the model was tuned on.
tests/test_tokenizer.py checks every piece against transformers.

Where each piece comes from:
- vocabulary, normalizer, pre-tokenizer, decoder and post-processor (Llama 3 adds BOS there):
  tokenizer.json. transformers drops tokenizer_config.json's add_bos_token/add_eos_token when
  tokenizer.json exists, so they are ignored here too.
- bos/eos/pad/unk token strings: tokenizer_config.json (a string or an AddedToken dict
  {"content": ...}); special_tokens_map.json overrides them only for legacy configs that lack
  "added_tokens_decoder", as in transformers.
- stop ids for generation (`eos_token_ids`): the tokenizer's eos, then generation_config.json's and
  config.json's eos_token_id (an int or a list). Chat models stop on several: Llama 3.1 Instruct
  on <|end_of_text|>, <|eom_id|> and <|eot_id|>. `eos_token_id` is the first, the tokenizer's own.
- pad id: the tokenizer's pad token; Llama 3 has none, and then it is the EOS id, as in TRL.
  Padding is masked out of attention and loss, so the id only has to be a real row.
- chat template: chat_template.jinja, else tokenizer_config.json["chat_template"] (a string, or
  a list of {"name", "template"} of which "default" is used).
- special tokens: those tokenizer.json flags, plus, as in transformers, every named one (eos,
  pad, ...) and every one tokenizer_config.json's added_tokens_decoder marks special, so
  decode(skip_special_tokens=True), the text reward functions get, drops them.

decode returns what `tokenizers` decodes. Known differences from transformers 5, none on the
Llama 3 / Qwen2 / Qwen3 layouts the tests cover:
- clean_up_tokenization_spaces is not applied; transformers applies it to non-BPE (Unigram,
  WordPiece) models only.
- tokenizer.json runs as saved. For a Llama 2 tokenizer (tokenizer_class LlamaTokenizer) with the
  older normalizer layout, transformers 5 rebuilds the pre-tokenizer from `legacy` and
  `add_prefix_space` and its ids differ; rlcore's are SentencePiece's (and transformers 4's).
  Likewise for tokenizer_class Qwen2Tokenizer, transformers 5 replaces tokenizer.json's
  normalizer and pre-tokenizer with the class's own; the two agree on Qwen's released files,
  and differ only for a tokenizer.json with another pre-tokenizer under that class name.
- a missing bos/eos/pad/unk token is not filled from the tokenizer class's defaults, and a
  "tool_use" chat template is never picked.
"""

import json
from datetime import datetime
from functools import lru_cache
from os import PathLike
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

# Message keys that carry a reasoning trace; transformers copies the first one it finds to
# "thinking" and "reasoning_content", the names templates read (Qwen3 reads reasoning_content).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# continue_final_message puts this after the final message and cuts the rendered text there (transformers' tag)
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def read_json(path: Path) -> dict:
    """Parse a JSON file holding one object; an absent file reads as {}."""
    if not path.exists():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); re-download or re-save the checkpoint") from err
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(obj).__name__}; re-download or re-save "
                         f"the checkpoint")
    return obj


def checkpoint_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be a checkpoint directory, or None when it is a directory."""
    if path.is_dir():
        return None
    problem = "is a file, not a checkpoint directory" if path.exists() else "checkpoint directory not found"
    hint = ""
    if not path.exists() and not path.is_absolute() and len(path.parts) == 2:  # reads like a hub id, org/name
        hint = (f"; rlcore never downloads: fetch it first, e.g. hf download {path.as_posix()} --local-dir "
                f"ckpt/{path.name} (huggingface-cli download with huggingface_hub < 1.0), then give that directory")
    return (f"{path}: {problem}; give a Hugging Face checkpoint directory (config.json, *.safetensors, "
            f"tokenizer.json){hint}")


def token_content(value: Any) -> Any:
    """A special token as saved in tokenizer_config.json: a string, {"content": ...}, or null."""
    return value.get("content") if isinstance(value, dict) else value


def as_id_list(value: int | list[int] | None, source: str = "eos_token_id") -> list[int]:
    """config.json and generation_config.json save eos_token_id as an int, a list, or null."""
    if value is None:
        return []
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{source} = {value!r}: expected a token id (an int), a list of them, or null")
    return list(ids)


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' assistant
    masks (TRL's training templates use it); here it renders as its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: jinja's own tojson escapes <, >, & and ' for HTML, which templates don't want
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache
def compile_chat_template(template: str) -> jinja2.Template:
    """The jinja environment transformers renders chat templates in. Templates come from the Hub,
    so they run sandboxed."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def read_chat_template(path: Path, tokenizer_config: dict) -> str | None:
    file = path / "chat_template.jinja"
    if file.exists():
        return file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        if "default" not in named:
            raise ValueError(f"{path / 'tokenizer_config.json'}: chat_template lists {sorted(named)} but no "
                             f"'default'; pass chat_template= to apply_chat_template")
        return named["default"]
    return template


class Tokenizer:
    """A checkpoint's tokenizer: text <-> ids, special token ids, and its chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: dict[str, str],
                 config_eos_ids: list[int], chat_template: str | None, source: str = "tokenizer"):
        """`special_tokens` maps names ("eos_token", ...) to token strings; `config_eos_ids` are the
        stop ids named outside the tokenizer (generation_config.json, config.json); `source` names
        the checkpoint in errors."""
        self.backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.source = source
        self.bos_token = special_tokens.get("bos_token")
        self.eos_token = special_tokens.get("eos_token")
        self.pad_token = special_tokens.get("pad_token")
        self.unk_token = special_tokens.get("unk_token")
        self.bos_token_id = self.token_id("bos_token")
        eos = self.token_id("eos_token")
        self.eos_token_ids = list(dict.fromkeys(([] if eos is None else [eos]) + config_eos_ids))
        if not self.eos_token_ids:
            raise ValueError(f"{source}: no EOS token in tokenizer_config.json, generation_config.json or "
                             f"config.json, so rollouts could never stop; set eos_token in tokenizer_config.json")
        self.eos_token_id = self.eos_token_ids[0]
        pad = self.token_id("pad_token")
        self.pad_token_id = self.eos_token_id if pad is None else pad

    @classmethod
    def from_dir(cls, path: str | PathLike) -> "Tokenizer":
        """Load from a checkpoint dir holding tokenizer.json (and usually tokenizer_config.json)."""
        path = Path(path)
        if problem := checkpoint_dir_problem(path):
            raise FileNotFoundError(problem)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file} not found: rlcore reads the fast-tokenizer file; create it with "
                                    f"transformers' AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as err:  # the Rust side raises a bare Exception
            raise ValueError(f"{file} could not be loaded by tokenizers ({err}); re-download or re-save it") from err
        # transformers only truncates or pads when asked; a tokenizer.json may have either switched on
        padding = backend.padding
        backend.no_truncation()
        backend.no_padding()

        config = read_json(path / "tokenizer_config.json")
        entries = {"pad_token": padding["pad_token"]} if padding else {}
        entries.update(config)
        if "added_tokens_decoder" not in config:
            entries.update(read_json(path / "special_tokens_map.json"))
        special_tokens = {key: token_content(value) for key, value in entries.items()
                          if key.endswith("_token") and isinstance(token_content(value), str)}
        # transformers makes named special tokens and added_tokens_decoder's special ones special whatever
        # tokenizer.json says, so decode(skip_special_tokens=True), what reward functions see, drops them
        flagged = [token_content(v) for v in config.get("added_tokens_decoder", {}).values()
                   if isinstance(v, dict) and v.get("special")]
        backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                    for t in dict.fromkeys([*special_tokens.values(), *flagged])
                                    if isinstance(t, str) and backend.token_to_id(t) is not None])
        # split_special_tokens: special-token text in the input is encoded as plain text, as in transformers
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        config_eos_ids = []
        for name in ("generation_config.json", "config.json"):
            eos = read_json(path / name).get("eos_token_id")
            config_eos_ids += as_id_list(eos, f"{path / name}: eos_token_id")
        return cls(backend, special_tokens, config_eos_ids, read_chat_template(path, config), str(path))

    def token_id(self, name: str) -> int | None:
        """The id of special token `name` ("eos_token", ...), None where the tokenizer has none."""
        token = self.special_tokens.get(name)
        if token is None:
            return None
        index = self.backend.token_to_id(token)
        if index is None:
            raise ValueError(f"{self.source}: {name} {token!r} is not in tokenizer.json's vocabulary; "
                             f"fix {name} in tokenizer_config.json")
        return index

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included (transformers' len(tokenizer))."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens runs tokenizer.json's post-processor (e.g. Llama 3's BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def stop_ids(self, text: str) -> list[list[int]]:
        """Token-id sequences that spell `text` inside a completion: its encoding on its own and,
        where different, its encoding after another character. A SentencePiece tokenizer (Llama
        2) puts "▁" before the start of a text, which `text` lacks mid-completion; a rollout stop
        string matches either."""
        plain = self.encode(text, add_special_tokens=False)
        head = self.encode("x", add_special_tokens=False)
        after = self.encode("x" + text, add_special_tokens=False)
        inside = after[len(head):] if after[:len(head)] == head else []
        return [plain] if inside in ([], plain) else [plain, inside]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (a list or a 1-D tensor)."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        """Texts of a batch of id lists (or a [B, T] tensor); decoded in parallel by tokenizers."""
        batch = batch.tolist() if hasattr(batch, "tolist") else [list(ids) for ids in batch]
        return self.backend.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, chat_template: str | None = None,
                            continue_final_message: bool = False, **kwargs) -> str | list[int]:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the checkpoint's chat template.

        As transformers' `apply_chat_template`, except that add_generation_prompt defaults to True
        (rollouts prompt the assistant) and tokenize to False. The template sees `messages`,
        `add_generation_prompt`, the special token strings (`bos_token`, `eos_token`, ...),
        `tools=None`, `documents=None` and `kwargs`, which override the rest. With tokenize=True the
        text is encoded without adding special tokens: templates write BOS themselves.
        `chat_template` renders with that template text instead of the checkpoint's.
        `continue_final_message` (with add_generation_prompt=False) leaves the final message open for
        the model to continue, e.g. an assistant prefill "<think>": as in transformers, the text is
        rendered with CONTINUE_TAG after that message's content and cut there (a template that trims
        the content has also trimmed the space after the tag: then the text is cut and right-stripped).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are both set: the first continues "
                             "the final message, the second starts a new assistant turn; pass "
                             "add_generation_prompt=False")
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"{self.source} has no chat template (no chat_template.jinja, no 'chat_template' in "
                             f"tokenizer_config.json); base models often ship none: copy the instruct model's "
                             f"chat_template.jinja into {self.source}, or pass chat_template=")
        if not messages:
            raise ValueError("apply_chat_template got an empty conversation; pass at least one message")
        chat = []
        for message in messages:
            # transformers drops None-valued keys (OpenAI-style content=None) and aliases reasoning names
            message = {key: value for key, value in message.items() if value is not None}
            reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ValueError(f"continue_final_message needs the final message's content as a string, not "
                                 f"{final!r}")
            chat[-1] = {**chat[-1], "content": final + CONTINUE_TAG}
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        where = "the chat_template given" if chat_template else f"{self.source}'s chat template"
        try:
            compiled = compile_chat_template(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{where} is not valid jinja (line {e.lineno}: {e.message}); fix the template "
                             f"(chat_template.jinja, or tokenizer_config.json's chat_template)") from None
        try:
            text = compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # raise_exception() in the template, or an undefined operation
            roles = [m.get("role") for m in chat]
            hint = (" The conversation has a system message (data.system_prompt, or the dataset's prompt), "
                    "which some templates refuse: drop it or fold it into the user message."
                    if "system" in roles else "")
            raise ValueError(f"{where} refused the conversation with roles {roles}: {e}.{hint}") from None
        if continue_final_message:
            if final.strip() not in text or CONTINUE_TAG.strip() not in text:
                raise ValueError(f"{where} drops or rewrites the final message ({chat[-1].get('role')!r}, "
                                 f"{final.strip()[:60]!r}), so it cannot be continued (continue_final_message); "
                                 f"end the conversation with a message the template renders as it is")
            cut = text.rindex(CONTINUE_TAG.strip())
            text = text[:cut] if text.startswith(CONTINUE_TAG, cut) else text[:cut].rstrip()
        return self.encode(text, add_special_tokens=False) if tokenize else text


def check_vocab_fits(tokenizer: Tokenizer, embedding_rows: int, source: str | PathLike) -> None:
    """Raise if the tokenizer can emit ids, or names an EOS id, past the model's embedding table.

    A smaller tokenizer is normal (Qwen pads its embedding to a multiple of 128 rows); a larger one
    means the tokenizer files do not belong to these weights.
    """
    rows_needed = max(tokenizer.backend.get_vocab(with_added_tokens=True).values()) + 1
    if rows_needed > embedding_rows:
        raise ValueError(f"{source}: the tokenizer has ids up to {rows_needed - 1}, so it needs {rows_needed} "
                         f"embedding rows, but the model has {embedding_rows}; the tokenizer files do not match "
                         f"the weights (compare tokenizer.json with config.json's vocab_size)")
    too_big = [i for i in tokenizer.eos_token_ids if i >= embedding_rows]
    if too_big:
        raise ValueError(f"{source}: eos_token_id {too_big} is past the model's {embedding_rows} embedding rows, "
                         f"so generation could never stop on it; fix eos_token_id in config.json or "
                         f"generation_config.json")
