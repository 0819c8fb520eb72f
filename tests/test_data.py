"""JSONL loading (errors name the file and line), GSM8K answers, the train/eval split, prompt formatting."""

import gzip
import io
import json
import re
import string
import warnings
import zipfile
from pathlib import Path

import pytest

from rlcore import RlcoreWarning
from rlcore.data.datasets import DataError, encode_prompts, format_prompt, load_examples, load_jsonl
from rlcore.config.options import DataArgs

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_jsonl(tmp_path, rows, name="data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def char_tokenizer(tmp_path):
    """Factory: rlcore's Tokenizer over one token per printable character, with or without a chat template."""
    tokenizers = pytest.importorskip("tokenizers")
    from rlcore.models.tokenizer import Tokenizer

    def build(chat_template: str | None = None) -> Tokenizer:
        path = tmp_path / ("chat" if chat_template else "plain")
        path.mkdir()
        vocab = {t: i for i, t in enumerate(["<eos>", *string.printable])}
        tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
        tok.decoder = tokenizers.decoders.Fuse()
        tok.add_special_tokens(["<eos>"])
        tok.save(str(path / "tokenizer.json"))
        config = {"eos_token": "<eos>", **({"chat_template": chat_template} if chat_template else {})}
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        return Tokenizer.from_dir(path)

    return build


# ---- load_jsonl ----

def test_load_jsonl_reads_prompt_and_answer_and_keeps_other_columns(tmp_path):
    path = write_jsonl(tmp_path, [{"question": "1+1?", "answer": "2", "id": 7}])
    assert load_jsonl(path, "question", "answer") == [{"question": "1+1?", "answer": "2", "id": 7, "prompt": "1+1?"}]


def test_load_jsonl_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "a", "answer": "1"}, "", "  ", {"prompt": "b", "answer": "2"}])
    assert [ex["prompt"] for ex in load_jsonl(path)] == ["a", "b"]


@pytest.mark.parametrize("answer", ["3 * 4 = <<3*4=12>>12 boxes\n#### 1,212", 42, None])
def test_the_answer_column_reaches_reward_functions_as_the_file_has_it(tmp_path, answer):
    """As TRL passes dataset columns: a GSM8K answer keeps its reasoning, a number stays a number
    (was: "1212" and "42", so a TRL reward doing answer.split("####") failed)."""
    row = {"prompt": "q", "answer": answer, "level": 3}
    assert dict(load_jsonl(write_jsonl(tmp_path, [row]))[0]) == row


def test_chat_message_prompt_is_accepted(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path, [{"prompt": messages, "answer": "1"}])
    assert load_jsonl(path)[0]["prompt"] == messages


def test_text_parts_content_is_accepted_and_kept(tmp_path):
    messages = [{"role": "user", "content": [{"type": "text", "text": "40+28="}]}]  # the OpenAI form
    path = write_jsonl(tmp_path, [{"prompt": messages, "answer": "68"}])
    assert load_jsonl(path)[0]["prompt"] == messages  # was: "has type list; expected ... messages"


@pytest.mark.parametrize("message, error", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
     r"data\.jsonl:1: column 'prompt', message 0 \(role 'user'\): content part \"\{'type': 'image_url'.*\" is not a "
     r"text part \{\"type\": \"text\", \"text\": \"\.\.\.\"\}; rlcore trains text-only models: drop the part"),
    ({"role": "user", "content": 12},
     r"data\.jsonl:1: column 'prompt', message 0 \(role 'user'\): content = '12' has type int; expected a string "
     r"or a list of \{\"type\": \"text\", \"text\": \"\.\.\.\"\} parts"),
    ({"from": "human", "value": "40+28="},
     r"data\.jsonl:1: column 'prompt', message 0 = \"\{'from': 'human'.* is not a \{\"role\": \.\.\., \"content\": "
     r"\.\.\.\} message \(ShareGPT's \{\"from\", \"value\"\}: rename the keys to \"role\" and \"content\", and "
     r"the roles \"human\"/\"gpt\" to \"user\"/\"assistant\"\)"),
])
def test_a_message_that_is_not_text_names_line_message_and_content(tmp_path, message, error):
    with pytest.raises(DataError, match=error):
        load_jsonl(write_jsonl(tmp_path, [{"prompt": [message], "answer": "68"}]))


def test_without_an_answer_column_the_row_is_kept_as_it_is(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "q", "answer": 6}, {"prompt": "r"}])
    assert [dict(ex) for ex in load_jsonl(path, answer_column="")] == [{"prompt": "q", "answer": 6}, {"prompt": "r"}]


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl does not exist; set data\.path"):
        load_jsonl(str(tmp_path / "nope.jsonl"))


def test_a_directory_is_not_a_dataset_file(tmp_path):
    with pytest.raises(DataError, match=rf"dataset file {tmp_path} is a directory; set data\.path"):
        load_jsonl(str(tmp_path))


def test_missing_eval_file_names_data_eval_path(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "q", "answer": "1"}])
    with pytest.raises(DataError, match=r"nope\.jsonl does not exist; set data\.eval_path"):
        load_examples(DataArgs(task="jsonl", path=path, eval_path=str(tmp_path / "nope.jsonl")))


def test_a_line_that_is_not_utf8_names_file_line_and_byte(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xe9", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:2: not UTF-8 text \(byte b'\\xe9' at column 13\)"):
        load_jsonl(str(path))


def test_a_utf8_bom_at_the_start_is_read_past_as_pandas_does(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    assert [ex["prompt"] for ex in load_jsonl(str(path))] == ["a", "b"]  # was: "Unexpected UTF-8 BOM"


@pytest.mark.parametrize("name, make, message", [
    ("data.jsonl.gz", lambda rows: gzip.compress(rows),
     r"data\.jsonl\.gz is gzip-compressed; decompress it \(gunzip -c \S*data\.jsonl\.gz > \S*data\.jsonl\) "
     r"and set data\.path = \S*data\.jsonl$"),
    ("data.zip", lambda rows: zip_of(rows),
     r"data\.zip is a zip archive; unzip it and set data\.path to the JSONL file inside$"),
    ("train.parquet", lambda rows: b"PAR1" + rows + b"PAR1",
     r"train\.parquet is a Parquet file, not JSON Lines; convert it, with pandas: "
     r"pd\.read_parquet\('\S*train\.parquet'\)\.to_json\('\S*train\.jsonl', orient='records', lines=True\), "
     r"or with datasets: Dataset\.from_parquet\('\S*train\.parquet'\)\.to_json\('\S*train\.jsonl'\); "
     r"then set data\.path = "),
])
def test_a_compressed_or_parquet_file_is_named_with_how_to_make_jsonl(tmp_path, name, make, message):
    path = tmp_path / name  # each was: "not UTF-8 text ...; save the file as UTF-8"
    path.write_bytes(make(b'{"prompt": "a", "answer": "1"}\n'))
    with pytest.raises(DataError, match=message):
        load_jsonl(str(path))


def zip_of(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("data.jsonl", data)
    return buffer.getvalue()


def test_the_gunzip_suggestion_never_overwrites_the_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(gzip.compress(b'{"prompt": "a", "answer": "1"}\n'))
    with pytest.raises(DataError, match=r"gunzip -c \S*data\.jsonl > \S*data\.jsonl\.jsonl\)"):
        load_jsonl(str(path))


@pytest.mark.parametrize("text", [
    '[{"prompt": "a", "answer": "1"},\n {"prompt": "b", "answer": "2"}]\n',  # was: "arr.json:1: not valid JSON"
    '[\n  {\n    "prompt": "a",\n    "answer": "1"\n  }\n]',
    '[{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]',  # was: "arr.json:1: a JSON list"
])
def test_a_json_array_file_is_named_with_how_to_make_jsonl(tmp_path, text):
    path = tmp_path / "arr.json"
    path.write_text(text)
    with pytest.raises(DataError, match=r"arr\.json is a JSON array of objects, not JSON Lines; write one object per "
                                        r"line, e\.g\. jq -c '\.\[\]' \S*arr\.json > \S*arr\.jsonl .* set data\.path"):
        load_jsonl(str(path))


def test_lines_that_each_hold_a_list_are_not_called_a_json_array(tmp_path):
    path = write_jsonl(tmp_path, [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]])
    with pytest.raises(DataError, match=r"data\.jsonl:1: a JSON list, expected an object"):
        load_jsonl(path)
    path = write_jsonl(tmp_path, [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]])
    with pytest.raises(DataError, match=r"data\.jsonl:1: a JSON list, expected an object"):  # one conversation
        load_jsonl(path)


def test_empty_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"data\.jsonl has no examples"):
        load_jsonl(write_jsonl(tmp_path, ["", ""]))


def test_bad_json_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "a", "answer": "1"}, '{"prompt": "b", "answer": 2'])
    with pytest.raises(DataError, match=r"data\.jsonl:2: not valid JSON \(Expecting ',' delimiter at column 28\)"):
        load_jsonl(path)  # just past the line's 27 characters, where "}" is missing (was: column 1)


def test_non_object_line_names_file_and_line(tmp_path):
    with pytest.raises(DataError, match=r"data\.jsonl:1: a JSON list, expected an object"):
        load_jsonl(write_jsonl(tmp_path, [[1, 2]]))


def test_missing_prompt_column_names_line_columns_and_fix(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}])
    with pytest.raises(DataError, match=r"data\.jsonl:2: no column 'prompt' \(columns: 'question', "
                                        r"'answer'\); set data\.prompt_column"):
        load_jsonl(path)


def test_missing_answer_column_names_line_and_fix(tmp_path):
    with pytest.raises(DataError, match=r"data\.jsonl:1: no column 'answer'.*data\.answer_column"):
        load_jsonl(write_jsonl(tmp_path, [{"prompt": "a", "solution": "1"}]))


def test_wrong_prompt_type_names_line_and_value(tmp_path):
    with pytest.raises(DataError, match=r"data\.jsonl:1: column 'prompt' = '12' has type int; expected a string"):
        load_jsonl(write_jsonl(tmp_path, [{"prompt": 12, "answer": "1"}]))


def test_a_null_answer_is_a_row_without_one(tmp_path):
    rows = load_jsonl(write_jsonl(tmp_path, [{"prompt": "a", "answer": None}, {"prompt": "b", "answer": "#### 7"}]))
    assert [r["answer"] for r in rows] == [None, "#### 7"]


def test_an_empty_prompt_names_the_line(tmp_path):
    with pytest.raises(DataError, match=r"data\.jsonl:2: column 'prompt' is an empty prompt"):
        load_jsonl(write_jsonl(tmp_path, [{"prompt": "a", "answer": "1"}, {"prompt": " ", "answer": "1"}]))


def test_wrong_answer_type_names_line_and_value(tmp_path):
    with pytest.raises(DataError, match=r"data\.jsonl:1: column 'answer' = '\[1\]' has type list; "
                                        r"expected a string, a number, or null"):
        load_jsonl(write_jsonl(tmp_path, [{"prompt": "a", "answer": [1]}]))


@pytest.mark.parametrize("column", ["prompts", "completions", "completion_ids", "trainer_state", "log_metric",
                                    "log_extra"])
def test_a_column_named_as_a_reward_keyword_names_line_column_and_fix(tmp_path, column):
    path = write_jsonl(tmp_path, [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2", column: "x"}])
    with pytest.raises(DataError, match=rf"data\.jsonl:2: column '{column}' has the name of a keyword rlcore passes "
                                        r"to reward functions itself \(prompts, completions, .*\), so they would get "
                                        r"it twice; rename the column$"):
        load_jsonl(path)  # was: accepted, and the first reward call "got multiple values for keyword argument"


def test_a_prompt_column_named_as_a_reward_keyword_is_renamed_with_data_prompt_column(tmp_path):
    with pytest.raises(DataError, match=r"data\.jsonl:1: column 'prompts' has the name of a keyword .*; rename the "
                                        r"column and set data\.prompt_column to the new name"):
        load_jsonl(write_jsonl(tmp_path, [{"prompts": "a", "answer": "1"}]), prompt_column="prompts")


def test_a_column_named_prompt_ids_is_refused_as_rlcores_own(tmp_path):
    with pytest.raises(DataError, match=r"data\.jsonl:1: column 'prompt_ids' is where rlcore keeps each prompt's "
                                        r"token ids, so it would be overwritten .*; rename the column$"):
        load_jsonl(write_jsonl(tmp_path, [{"prompt": "a", "answer": "1", "prompt_ids": [5, 6]}]))


# ---- load_examples ----

def test_synthetic_task_examples_come_from_the_task():
    train, evals = load_examples(DataArgs(task="arithmetic", num_train=50, num_eval=10))
    assert len(train) == 50 and len(evals) == 10
    assert not {ex["prompt"] for ex in train} & {ex["prompt"] for ex in evals}


def test_jsonl_holds_out_num_eval_rows(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)])
    train, evals = load_examples(DataArgs(task="jsonl", path=path, num_train=0, num_eval=5))
    assert len(train) == 15 and len(evals) == 5
    assert {ex["prompt"] for ex in train + evals} == {f"q{i}" for i in range(20)}


def test_jsonl_num_train_caps_training_rows(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)])
    train, _ = load_examples(DataArgs(task="jsonl", path=path, num_train=4, num_eval=5))
    assert len(train) == 4


def test_jsonl_eval_path_is_the_eval_set(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    eval_path = write_jsonl(tmp_path, [{"prompt": "test", "answer": "0"}], name="test.jsonl")
    with pytest.warns(RlcoreWarning, match=r"test\.jsonl has 1 row, fewer than data\.num_eval = 32: the held-out "
                                          r"evaluation runs on all 1"):  # was silent
        train, evals = load_examples(DataArgs(task="jsonl", path=path, eval_path=eval_path, num_train=0))
    assert len(train) == 10 and [ex["prompt"] for ex in evals] == ["test"]


@pytest.mark.parametrize("spelling", ["the same string", "another relative path", "a symlink"])
def test_an_eval_path_that_is_data_path_is_an_error_naming_both_options_and_the_fix(tmp_path, monkeypatch, spelling):
    path = write_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    (tmp_path / "link.jsonl").symlink_to(path)
    monkeypatch.chdir(tmp_path)
    eval_path = {"the same string": path, "another relative path": "./data.jsonl", "a symlink": "link.jsonl"}[spelling]
    named = f"data.eval_path = '{eval_path}' is the same file as data.path = '{path}' ({Path(path).resolve()})"
    with pytest.raises(DataError, match=re.escape(named) + r", so eval accuracy would be measured on training prompts; "
                                        r"leave data\.eval_path unset to hold out data\.num_eval rows of data\.path, "
                                        r"or set it to a separate file"):
        load_examples(DataArgs(task="jsonl", path=path, eval_path=eval_path))


@pytest.mark.parametrize("eval_row, column", [({"question": "q", "answer": "1"}, "prompt"),
                                             ({"prompt": "q", "solution": "1"}, "answer")])
def test_an_eval_file_without_a_column_of_data_path_says_the_files_columns_differ(tmp_path, eval_row, column):
    path = write_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    eval_path = write_jsonl(tmp_path, [eval_row], name="eval.jsonl")
    with pytest.raises(DataError, match=rf"eval\.jsonl:1: no column '{column}' \(columns: .*\), which data\.path "
                                        rf"\({re.escape(path)}\) has: the eval file's columns differ from "
                                        rf"data\.path's, and data\.{column}_column names the {column} column of both; "
                                        rf"give the files the same prompt and answer columns \(rename this file's "
                                        rf"{column} column to '{column}'\)") as error:
        load_examples(DataArgs(task="jsonl", path=path, eval_path=eval_path))
    assert f"set data.{column}_column" not in str(error.value)  # was the advice, which breaks data.path


def test_eval_prompts_that_are_also_training_prompts_warn_with_the_first_line(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    eval_path = write_jsonl(tmp_path, [{"prompt": "new", "answer": "0"}, {"prompt": "q3", "answer": "3"}], "eval.jsonl")
    with pytest.warns(RlcoreWarning, match=rf"1 of the 2 eval prompts are also training prompts \(first: "
                                           rf"{re.escape(eval_path)}:2\), so held-out accuracy is partly measured on "
                                           rf"training prompts; drop them from {re.escape(eval_path)}"):
        load_examples(DataArgs(task="jsonl", path=path, eval_path=eval_path, num_eval=2))  # the file's 2: no warning


def test_a_prompt_held_out_of_data_path_that_it_also_trains_on_warns(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "the same", "answer": str(i)} for i in range(20)])
    with pytest.warns(RlcoreWarning, match=rf"5 of the 5 eval prompts are also training prompts .*; drop them from "
                                           rf"{re.escape(path)}"):
        load_examples(DataArgs(task="jsonl", path=path, num_eval=5))


def test_distinct_eval_and_training_prompts_do_not_warn(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_examples(DataArgs(task="jsonl", path=path, num_eval=5))


def test_jsonl_too_small_for_num_eval_is_an_error(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "q", "answer": "1"}] * 3)
    with pytest.raises(DataError, match=r"has 3 examples, so data\.num_eval = 32 leaves none to train on"):
        load_examples(DataArgs(task="jsonl", path=path))


# ---- format_prompt ----

def test_format_prompt_uses_chat_template_with_system_prompt(char_tokenizer):
    tok = char_tokenizer(TEMPLATE)
    ids = format_prompt({"prompt": "2+2="}, tok, system_prompt="Be brief.")
    assert tok.decode(ids) == "<system>Be brief.\n<user>2+2=\n<assistant>"


def test_format_prompt_without_system_prompt_has_only_the_user_turn(char_tokenizer):
    tok = char_tokenizer(TEMPLATE)
    assert tok.decode(format_prompt({"prompt": "2+2="}, tok)) == "<user>2+2=\n<assistant>"


def test_format_prompt_takes_chat_message_prompts_as_they_are(char_tokenizer):
    tok = char_tokenizer(TEMPLATE)
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    ids = format_prompt({"prompt": prompt}, tok, system_prompt="other")
    assert tok.decode(ids) == "<system>S\n<user>U\n<assistant>"


def test_a_prompt_ending_in_an_assistant_message_is_continued(char_tokenizer):
    """A prefill: the model writes on from "<think>" (TRL's continue_final_message), rather than after
    a closed assistant turn and a new generation prompt (was: "<assistant><think>\\n<assistant>")."""
    tok = char_tokenizer(TEMPLATE)
    prompt = [{"role": "user", "content": "40+28="}, {"role": "assistant", "content": "<think>"}]
    assert tok.decode(format_prompt({"prompt": prompt}, tok)) == "<user>40+28=\n<assistant><think>"


def test_a_tool_message_last_gets_the_generation_prompt(char_tokenizer):
    tok = char_tokenizer(TEMPLATE)
    prompt = [{"role": "user", "content": "1+1="}, {"role": "tool", "content": "2"}]
    assert tok.decode(format_prompt({"prompt": prompt}, tok)) == "<user>1+1=\n<tool>2\n<assistant>"


def test_sharegpt_roles_are_an_error_naming_the_line_and_the_rename(tmp_path, char_tokenizer):
    sharegpt = {"prompt": [{"role": "human", "content": "40+28="}], "answer": "68"}
    example = load_jsonl(write_jsonl(tmp_path, [{"prompt": "a", "answer": "1"}, sharegpt]))[1]
    with pytest.raises(DataError, match=r"data\.jsonl:2: the prompt ends with a message of role 'human'; as in TRL's "
                                        r"apply_chat_template it must end with a 'user' or 'tool' message.*"
                                        r"'human' and 'gpt' are ShareGPT roles: rename them 'user' and 'assistant'"):
        format_prompt(example, char_tokenizer(TEMPLATE))


# like Qwen2.5's template: messages of other roles are skipped
KNOWN_ROLES = ("{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}<{{ m['role'] }}>"
               "{{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("prompt, message", [
    ([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "40+28="}],
     r"data\.jsonl:1: message 0 \(role 'developer'\): its text 'Be brief\.' is not in the prompt the chat template "
     r"renders, so the model would never see it; chat templates render the roles system, user, assistant and tool"),
    ([{"role": "human", "content": "40+28="}, {"role": "gpt", "content": "68"}, {"role": "user", "content": "2+2="}],
     r"data\.jsonl:1: message 0 \(role 'human'\): its text '40\+28=' is not in the prompt .*'human' and 'gpt' are "
     r"ShareGPT roles: rename them 'user' and 'assistant'"),
])
def test_a_message_the_template_drops_is_an_error_naming_line_index_and_role(tmp_path, char_tokenizer, prompt,
                                                                              message):
    example = load_jsonl(write_jsonl(tmp_path, [{"prompt": prompt, "answer": "68"}]))[0]
    with pytest.raises(DataError, match=message):  # was: trained on a prompt without it
        format_prompt(example, char_tokenizer(KNOWN_ROLES))


def test_a_system_prompt_the_template_drops_is_an_error_naming_data_system_prompt(char_tokenizer):
    tok = char_tokenizer("{% for m in messages if m['role'] != 'system' %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match=r"prompt '40\+28=': data\.system_prompt: its text 'Be brief\.' is not in "
                                        r"the prompt .*drops system messages: unset data\.system_prompt"):
        format_prompt({"prompt": "40+28="}, tok, system_prompt="Be brief.")
    with pytest.raises(DataError, match=r"message 0 \(role 'system'\).*drops system messages: put the text in the "
                                        r"user message"):
        format_prompt({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]},
                      tok)


def test_a_template_that_respaces_a_message_still_shows_it(char_tokenizer):
    # e.g. a template that collapses a message's line breaks: its words are all in the prompt
    tok = char_tokenizer("{% for m in messages %}{{ m['content'] | replace('\\n', ' ') }}|{% endfor %}")
    assert format_prompt({"prompt": [{"role": "user", "content": "Add:\n40 + 28"}]}, tok)


def test_an_earlier_turns_reasoning_may_be_dropped_by_the_template(char_tokenizer):
    """As Qwen3's and DeepSeek-R1's templates render an assistant turn: without its <think> block."""
    tok = char_tokenizer("{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' %}"
                         "{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}<{{ m['role'] }}>{{ c }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    prompt = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "<think>easy</think>\n2"},
              {"role": "user", "content": "2+2="}]
    assert tok.decode(format_prompt({"prompt": prompt}, tok)) == "<user>1+1=\n<assistant>2\n<user>2+2=\n<assistant>"


def test_text_parts_render_as_their_joined_text(char_tokenizer):
    tok = char_tokenizer(TEMPLATE)
    parts = [{"role": "user", "content": [{"type": "text", "text": "40+"}, {"type": "text", "text": "28="}]}]
    assert tok.decode(format_prompt({"prompt": parts}, tok)) == "<user>40+28=\n<assistant>"


def test_format_prompt_without_template_is_plain_text(char_tokenizer):
    tok = char_tokenizer()
    assert format_prompt({"prompt": "2+2="}, tok) == tok.encode("2+2=")


def test_format_prompt_can_skip_the_chat_template(char_tokenizer):
    tok = char_tokenizer(TEMPLATE)
    assert format_prompt({"prompt": "2+2="}, tok, use_chat_template=False) == tok.encode("2+2=")


def test_format_prompt_without_template_puts_system_prompt_first(char_tokenizer):
    tok = char_tokenizer()
    assert tok.decode(format_prompt({"prompt": "2+2="}, tok, system_prompt="Add.")) == "Add.\n\n2+2="


def test_chat_messages_without_template_are_an_error(char_tokenizer):
    with pytest.raises(DataError, match="no chat template"):
        format_prompt({"prompt": [{"role": "user", "content": "U"}]}, char_tokenizer())


def test_a_synthetic_prompt_over_max_prompt_length_is_named_by_index_and_text(char_tokenizer):
    examples = [{"prompt": "1+1="}, {"prompt": "12345+67890="}]
    with pytest.raises(DataError, match=r"example 1 \(prompt '12345\+67890='.*is 12 tokens.*"
                                        r"data\.max_prompt_length = 8"):
        encode_prompts(examples, char_tokenizer(), None, True, max_prompt_length=8)


def test_a_jsonl_prompt_over_max_prompt_length_is_named_by_file_and_line(tmp_path, char_tokenizer):
    rows = [{"prompt": "x" * 800 if i == 19 else f"q{i}", "answer": "1"} for i in range(40)]
    train, _ = load_examples(DataArgs(task="jsonl", path=write_jsonl(tmp_path, rows, "huge.jsonl"), num_eval=4))
    with pytest.raises(DataError, match=r"huge\.jsonl:20: prompt is 800 tokens after formatting, over "
                                        r"data\.max_prompt_length = 512; raise"):  # was: "example 29 (prompt ...)"
        encode_prompts(train, char_tokenizer(), None, True, max_prompt_length=512)


def test_the_source_line_is_not_a_column(tmp_path):
    example = load_jsonl(write_jsonl(tmp_path, [{"prompt": "a", "answer": "1"}]))[0]
    assert example == {"prompt": "a", "answer": "1"} and example.source.endswith("data.jsonl:1")
