"""Prompts: JSONL loading with errors that name the file and line, the train/eval split, and
prompt formatting (chat template when the tokenizer has one).

An example is a dict with `prompt` (a string, or a list of chat messages) and `answer` (a string,
or None when the dataset has no answers), plus every other column of its JSONL row; reward
functions receive the columns as keyword arguments. A JSONL row's dict is an `Example`, which also
knows its file and line.
"""

from __future__ import annotations

import codecs
import json
import random
import warnings
from pathlib import Path

from rlcore import RlcoreWarning
from rlcore.data.tasks import train_eval_split
from rlcore.rewards.scoring import REWARD_KEYWORDS


class DataError(ValueError):
    """A dataset that cannot be used; the message names the file, the line and the fix."""


# Files that are not JSON Lines, known by their first bytes: what the file is and what to do.
# {path} is the file, {out} a new .jsonl file beside it, {key} the config option.
NOT_JSONL = {
    b"\x1f\x8b": "is gzip-compressed; decompress it (gunzip -c {path} > {out}) and set {key} = {out}",
    b"PK\x03\x04": "is a zip archive; unzip it and set {key} to the JSONL file inside",
    b"PAR1": ("is a Parquet file, not JSON Lines; convert it, with pandas: pd.read_parquet('{path}')"
              ".to_json('{out}', orient='records', lines=True), or with datasets: Dataset.from_parquet("
              "'{path}').to_json('{out}'); then set {key} = {out}"),
}


SHAREGPT_FIX = "'human' and 'gpt' are ShareGPT roles: rename them 'user' and 'assistant'"


class Example(dict):
    """A JSONL row as `load_jsonl` returns it, and `source`, its "file:line", for the errors found
    once the prompt is formatted. An attribute, not a key: every key is a column that the reward
    functions get."""

    def __init__(self, row: dict, source: str):
        super().__init__(row)
        self.source = source


def load_jsonl(path: str, prompt_column: str = "prompt", answer_column: str | None = "answer",
               key: str = "data.path", train_path: str | None = None) -> list[dict]:
    """One example per non-blank line of the UTF-8 JSONL file at `path` (the config's `key`;
    a byte-order mark at the start is skipped).

    `prompt_column` must hold a string or a list of `{"role", "content"}` messages (content: a
    string, or a list of `{"type": "text", "text"}` parts) and becomes `prompt`; `answer_column`
    (None or "" = the dataset has no answers) must hold a string or a number (or null: a row
    without one, which `accuracy` scores None). Every column is kept as it is, the answer column
    too (reward functions get them as TRL passes them; `accuracy` reads a GSM8K-style "#### 42"
    itself). No column may be named
    as a keyword rlcore passes reward functions itself (`rewards.REWARD_KEYWORDS`: prompts, completions...).
    `train_path`: data.path, loaded before, when this file is data.eval_path: a missing prompt or
    answer column is then a difference between the two files, not a wrong column option.
    """
    p = Path(path)
    if not p.is_file():
        problem = "is a directory" if p.is_dir() else "does not exist"
        raise DataError(f"dataset file {path} {problem}; set {key} to a JSONL file "
                        f"(one JSON object per line)")
    examples = []
    with open(p, "rb") as f:
        head = f.read(4)
        for magic, problem in NOT_JSONL.items():
            if head.startswith(magic):
                raise DataError(f"dataset file {path} " + problem.format(path=path, out=_jsonl_beside(p), key=key))
        f.seek(0)
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            if lineno == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # as pandas and datasets read it (Windows editors write one)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at column "
                                f"{e.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            if not examples and line.lstrip().startswith("[") and _is_json_array(p):
                out = _jsonl_beside(p)
                raise DataError(f"dataset file {path} is a JSON array of objects, not JSON Lines; write one "
                                f"object per line, e.g. jq -c '.[]' {path} > {out} (or json.dumps each element "
                                f"of json.load in Python), and set {key} = {out}")
            try:
                row = json.loads(line.rstrip("\r\n"))  # with the newline, an error at the end is "line 2"
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line "
                                f"must be one JSON object") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a JSON {type(row).__name__}, expected an object such as "
                                f'{{"{prompt_column}": "...", "{answer_column or "answer"}": "..."}}')
            examples.append(_example(row, where, prompt_column, answer_column, train_path))
    if not examples:
        raise DataError(f"dataset file {path} has no examples (it is empty or blank); "
                        f"write one JSON object per line")
    return examples


def _is_json_array(p: Path) -> bool:
    """Whether the whole file is one JSON array of objects, e.g. pandas' to_json(orient='records')."""
    try:
        rows = json.loads(p.read_text(encoding="utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not (isinstance(rows, list) and rows and all(isinstance(row, dict) for row in rows)):
        return False
    return not all("role" in row for row in rows)  # else: one row's chat messages, a line without its object


def _jsonl_beside(p: Path) -> Path:
    """A name for the JSONL version of file `p`: data.jsonl.gz -> data.jsonl, never `p` itself."""
    out = p.with_name(p.name.split(".")[0] + ".jsonl")
    return out if out != p else p.with_name(p.name + ".jsonl")


def _example(row: dict, where: str, prompt_column: str, answer_column: str | None, train_path: str | None) -> dict:
    clash = next((column for column in row if column in REWARD_KEYWORDS), None)
    if clash is not None:
        option = {prompt_column: "data.prompt_column", answer_column: "data.answer_column"}.get(clash)
        raise DataError(f"{where}: column {clash!r} has the name of a keyword rlcore passes to reward functions itself "
                        f"({', '.join(REWARD_KEYWORDS)}), so they would get it twice; rename the column"
                        + (f" and set {option} to the new name" if option else ""))
    if "prompt_ids" in row:
        raise DataError(f"{where}: column 'prompt_ids' is where rlcore keeps each prompt's token ids, so it would "
                        f"be overwritten and never reach the reward functions; rename the column")
    columns = ", ".join(map(repr, row)) or "none"
    if prompt_column not in row:
        raise _missing_column(where, prompt_column, columns, "prompt", train_path,
                              "set data.prompt_column to the column that holds the prompt")
    prompt = row[prompt_column]
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
        raise DataError(f"{where}: column {prompt_column!r} = {str(prompt)[:60]!r} has type "
                        f"{type(prompt).__name__}; expected a string or a list of "
                        f'{{"role": ..., "content": ...}} messages')
    for i, message in enumerate(prompt if isinstance(prompt, list) else []):
        _check_message(message, f"{where}: column {prompt_column!r}, message {i}")
    if isinstance(prompt, str) and not prompt.strip():
        raise DataError(f"{where}: column {prompt_column!r} is an empty prompt; drop the row or fill it in")
    if answer_column:
        if answer_column not in row:
            raise _missing_column(where, answer_column, columns, "answer", train_path,
                                  'set data.answer_column to the column with the reference answer, or to "" if the '
                                  'dataset has none')
        raw = row[answer_column]
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, (str, int, float))):
            raise DataError(f"{where}: column {answer_column!r} = {str(raw)[:60]!r} has type "
                            f"{type(raw).__name__}; expected a string, a number, or null for a row "
                            f"without a reference answer")
    return Example({**row, "prompt": prompt}, where)


def _missing_column(where: str, column: str, columns: str, kind: str, train_path: str | None, fix: str) -> DataError:
    """The error for a row without its `kind` ("prompt" or "answer") column, `fix` when the column
    option is wrong. In data.eval_path's file (`train_path` given) the option is right: data.path has
    the column, so the eval file's column differs."""
    if train_path is None:
        return DataError(f"{where}: no column {column!r} (columns: {columns}); {fix}")
    return DataError(f"{where}: no column {column!r} (columns: {columns}), which data.path ({train_path}) has: the "
                     f"eval file's columns differ from data.path's, and data.{kind}_column names the {kind} column "
                     f"of both; give the files the same prompt and answer columns (rename this file's {kind} column "
                     f"to {column!r})")


def _check_message(m, where: str) -> None:
    """Raise unless `m` is a chat message: a string "role" and a "content" that is text, a string
    or a list of text parts [{"type": "text", "text": ...}] (the OpenAI form)."""
    if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
        hint = (' (ShareGPT\'s {"from", "value"}: rename the keys to "role" and "content", and the roles '
                '"human"/"gpt" to "user"/"assistant")' if isinstance(m, dict) and "from" in m else "")
        raise DataError(f"{where} = {str(m)[:60]!r} is not a {{\"role\": ..., \"content\": ...}} message{hint}")
    content = m["content"]
    if isinstance(content, list):
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise DataError(f"{where} (role {m['role']!r}): content part {str(part)[:60]!r} is not a text part "
                                f'{{"type": "text", "text": "..."}}; rlcore trains text-only models: drop the part')
    elif not isinstance(content, str):
        raise DataError(f"{where} (role {m['role']!r}): content = {str(content)[:60]!r} has type "
                        f"{type(content).__name__}; expected a string or a list of "
                        f'{{"type": "text", "text": "..."}} parts')


def message_text(content: str | list[dict]) -> str:
    """A message's text: its content string, or its text parts joined without a separator (the
    chat templates that read parts, such as Llama 4's, concatenate them)."""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def load_examples(data) -> tuple[list[dict], list[dict]]:
    """(train, eval) examples for a `DataArgs` config section; eval rows are never training rows.

    Synthetic tasks: `tasks.train_eval_split`. JSONL: the first `num_eval` rows of `data.eval_path`
    when given (a file other than `data.path`), else the first `num_eval` rows of `data.path` after
    a shuffle seeded by `data.seed`; then at most `num_train` training rows (0 = all). Eval prompts
    that are also training prompts (the same text in both files, or twice in data.path) are a warning.
    """
    if data.task != "jsonl":  # a synthetic task (an unknown name is an error naming tasks.TASKS)
        return train_eval_split(data.task, data.num_train, data.num_eval, data.seed)
    rows = load_jsonl(data.path, data.prompt_column, data.answer_column)
    random.Random(data.seed).shuffle(rows)
    if data.eval_path:
        if Path(data.eval_path).resolve() == Path(data.path).resolve():  # also another spelling of it, or a symlink
            raise DataError(f"data.eval_path = {data.eval_path!r} is the same file as data.path = {data.path!r} "
                            f"({Path(data.path).resolve()}), so eval accuracy would be measured on training prompts; "
                            f"leave data.eval_path unset to hold out data.num_eval rows of data.path, or set it to "
                            f"a separate file")
        evals = load_jsonl(data.eval_path, data.prompt_column, data.answer_column, key="data.eval_path",
                           train_path=data.path)
        if len(evals) < data.num_eval:
            n = len(evals)
            warnings.warn(f"data.eval_path {data.eval_path} has {n} row{'s' * (n != 1)}, fewer than data.num_eval = "
                          f"{data.num_eval}: the held-out evaluation runs on all {n}", RlcoreWarning, stacklevel=2)
        evals = evals[:data.num_eval]
    else:
        if len(rows) <= data.num_eval:
            raise DataError(f"{data.path} has {len(rows)} examples, so data.num_eval = "
                            f"{data.num_eval} leaves none to train on; lower data.num_eval or set data.eval_path")
        evals, rows = rows[:data.num_eval], rows[data.num_eval:]
    train = rows[:data.num_train] if data.num_train else rows
    trained = {json.dumps(ex["prompt"], sort_keys=True) for ex in train}  # as text: a list of messages is unhashable
    shared = [ex.source for ex in evals if json.dumps(ex["prompt"], sort_keys=True) in trained]
    if shared:
        warnings.warn(f"{len(shared)} of the {len(evals)} eval prompts are also training prompts (first: {shared[0]}), "
                      f"so held-out accuracy is partly measured on training prompts; drop them from "
                      f"{data.eval_path or data.path}", RlcoreWarning, stacklevel=2)
    return train, evals


def format_prompt(example: dict, tokenizer, system_prompt: str | None = None, use_chat_template: bool = True,
                  chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
    """Token ids of the prompt, ready for generation.

    With a chat template (and `use_chat_template`): the system message (if any) and the prompt (a
    string is the user message; text parts are joined, `message_text`), rendered with the template
    variables `chat_template_kwargs` (e.g. Qwen3's enable_thinking) as TRL's apply_chat_template
    renders a prompt: one that ends with a user or tool message gets the generation prompt; one
    that ends with an assistant message (a prefill such as "<think>") is continued
    (continue_final_message); another last role is an error. So is a message whose text is not in
    the rendered prompt: templates skip roles they do not know (Qwen2.5's skips ShareGPT's
    "human"), and the model would never see it. `tools` (JSON schemas) go to the template as
    `tools`, which shows them to the model (TRL's tools).
    Without one: the plain text, preceded by the system prompt and a blank line when there is one.
    """
    prompt = example["prompt"]
    where = getattr(example, "source", None) or f"prompt {str(prompt)[:60]!r}"
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{**m, "content": message_text(m["content"])} for m in prompt] if isinstance(prompt, list)
                    else [{"role": "user", "content": prompt}])
        labels = [f"message {i} (role {m['role']!r})" for i, m in enumerate(messages)]
        last = messages[-1]["role"]
        if last not in ("user", "tool", "assistant"):
            fix = SHAREGPT_FIX if last in ("human", "gpt") else "end it with the user message to answer"
            raise DataError(f"{where}: the prompt ends with a message of role {last!r}; as in TRL's "
                            f"apply_chat_template it must end with a 'user' or 'tool' message, which the model "
                            f"answers, or an 'assistant' message, which it continues; {fix}")
        if system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
            labels.insert(0, "data.system_prompt")
        prefill = last == "assistant"
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=not prefill, tokenize=False,
                                                 continue_final_message=prefill, tools=tools,
                                                 **(chat_template_kwargs or {}))
        except ValueError as e:  # the template refused the conversation, or drops the message to continue
            raise DataError(f"{where}: {e}") from None
        for label, m in zip(labels, messages):
            # reasoning templates (Qwen3, DeepSeek-R1) drop an earlier assistant turn's <think>...</think>
            shown = (m["content"].split("</think>")[-1] if m["role"] == "assistant" else m["content"]).strip()
            # Llama 3.1's renders a tool result as a JSON string (tojson): quotes and newlines escaped
            as_json = (json.dumps(shown)[1:-1], json.dumps(shown, ensure_ascii=False)[1:-1])
            words = " ".join(shown.split())  # a template that trims or re-spaces the text still shows it
            if shown not in text and not any(j in text for j in as_json) and words not in " ".join(text.split()):
                fix = (SHAREGPT_FIX if m["role"] in ("human", "gpt") else
                       "this chat template drops system messages: unset data.system_prompt"
                       if label == "data.system_prompt" else
                       "this chat template drops system messages: put the text in the user message"
                       if m["role"] == "system" else
                       "chat templates render the roles system, user, assistant and tool"
                       if m["role"] not in ("system", "user", "assistant", "tool") else
                       "check the chat template, which leaves this message out")
                raise DataError(f"{where}: {label}: its text {shown[:40]!r} is not in the prompt the chat "
                                f"template renders, so the model would never see it; {fix}")
        return list(tokenizer.encode(text, add_special_tokens=False))
    if isinstance(prompt, list):
        raise DataError(f"{where}: the prompt is a list of chat messages but the tokenizer "
                        f"has no chat template (or data.use_chat_template is false); use a "
                        f"checkpoint with a chat template, or plain-string prompts")
    return list(tokenizer.encode(f"{system_prompt}\n\n{prompt}" if system_prompt else prompt))


def encode_prompts(examples: list[dict], tokenizer, system_prompt: str | None, use_chat_template: bool,
                   max_prompt_length: int, chat_template_kwargs: dict | None = None,
                   tools: list[dict] | None = None) -> list[list[int]]:
    """`format_prompt` for each example; a prompt over `max_prompt_length` tokens is an error naming
    its file and line (a synthetic task's: its index and text)."""
    out = []
    for i, ex in enumerate(examples):
        ids = format_prompt(ex, tokenizer, system_prompt, use_chat_template, chat_template_kwargs, tools)
        if len(ids) > max_prompt_length:
            source = getattr(ex, "source", None)  # a JSONL row's file:line; a synthetic task's have none
            what = f"{source}: prompt" if source else f"example {i} (prompt {str(ex['prompt'])[:60]!r}...)"
            raise DataError(f"{what} is {len(ids)} tokens after formatting, over data.max_prompt_length = "
                            f"{max_prompt_length}; raise data.max_prompt_length or drop long prompts from the data")
        out.append(ids)
    return out
