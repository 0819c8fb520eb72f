"""Building the embedded default model in $RLCORE_CACHE: a build that fails or is interrupted leaves
nothing behind but what it found, and a build the default's values would not need says why it runs.

The SFT is replaced by a stand-in (the warm start itself is test_train.py's), so each test takes a
fraction of a second."""

import pytest

import rlcore.models.embedded
import rlcore.train
from rlcore.cli import DEFAULT_CONFIG
from rlcore.config import load_config
from rlcore.models.embedded import build_embedded_model
from rlcore.data.tasks import unique_problems

POOL = unique_problems("arithmetic", 20, 0)
DEFAULT = "embedded-arithmetic-v2-seed0-eval200"  # rlcore/config/default.toml's data.seed and data.num_eval


def finished_model(cache, name=DEFAULT):
    (cache / name).mkdir(parents=True)
    (cache / name / "model.safetensors").write_bytes(b"weights")


def sft_raising(error):
    def sft(*args, **kwargs):
        raise error
    return sft


@pytest.mark.parametrize("error", [RuntimeError("out of memory"), KeyboardInterrupt()],
                         ids=["exception", "ctrl-c"])
def test_a_build_that_fails_or_is_interrupted_leaves_no_build_directory(tmp_path, monkeypatch, error):
    monkeypatch.setattr(rlcore.models.embedded, "sft", sft_raising(error))
    with pytest.raises(type(error)):
        build_embedded_model(tmp_path / "embedded", POOL, threads=1)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_build_keeps_the_finished_models_and_the_other_builders_directories(tmp_path, monkeypatch):
    """Ranks on other machines that share the cache build beside this one, in directories of their own."""
    finished_model(tmp_path)
    other = tmp_path / "embedded-arithmetic-v2-seed0-eval8.build-7"  # another process's, at work
    other.mkdir()
    (other / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(rlcore.models.embedded, "sft", sft_raising(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError):
        build_embedded_model(tmp_path / "embedded-arithmetic-v2-seed0-eval8", POOL, threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEFAULT, other.name]
    assert (tmp_path / DEFAULT / "model.safetensors").read_bytes() == b"weights"
    assert (other / "tokenizer.json").read_text() == "{}"


def test_a_build_whose_sft_finishes_creates_the_cache_and_leaves_only_the_model_there(tmp_path, monkeypatch):
    monkeypatch.setattr(rlcore.models.embedded, "sft", lambda *args, **kwargs: None)
    path = build_embedded_model(tmp_path / "cache" / "embedded", POOL, threads=1)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["embedded"]
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()


# ---- why a run builds a model of its own

def built_by_the_run(cache, monkeypatch, capsys, *overrides):
    """What embedded_model_dir prints for a run with `overrides` on rlcore/config/default.toml (the build stubbed)."""
    monkeypatch.setenv("RLCORE_CACHE", str(cache))
    monkeypatch.setattr(rlcore.run.setup, "build_embedded_model", lambda path, pool, task: path)
    rlcore.run.setup.embedded_model_dir(load_config(DEFAULT_CONFIG, list(overrides)))
    return capsys.readouterr().out


def test_a_build_for_another_num_eval_says_the_model_holds_out_those_problems(tmp_path, monkeypatch, capsys):
    finished_model(tmp_path)
    out = built_by_the_run(tmp_path, monkeypatch, capsys, "data.num_eval=8")
    assert out == ("with data.num_eval = 8 the run needs an embedded model of its own: the model never trains on the "
                   "problems that data.seed and data.num_eval hold out (its SFT takes about 1-2 minutes, once); keep "
                   "data.num_eval = 200 to reuse the cached one\n")


def test_a_build_for_another_seed_names_data_seed(tmp_path, monkeypatch, capsys):
    finished_model(tmp_path)
    out = built_by_the_run(tmp_path, monkeypatch, capsys, "data.seed=3")
    assert out.startswith("with data.seed = 3 the run needs an embedded model of its own")
    assert "keep data.seed = 0 to reuse" in out


def test_without_the_defaults_model_the_reason_names_a_cached_one(tmp_path, monkeypatch, capsys):
    finished_model(tmp_path, "embedded-arithmetic-v2-seed1-eval8")
    out = built_by_the_run(tmp_path, monkeypatch, capsys, "data.num_eval=16")
    assert out.startswith("with data.seed = 0 and data.num_eval = 16 the run needs")
    assert "keep data.seed = 1 and data.num_eval = 8 to reuse the cached one" in out


@pytest.mark.parametrize("cached, overrides", [
    ([], ["data.num_eval=8"]),  # the first run: the build line says so
    (["embedded-arithmetic-v2-seed0-eval8"], []),  # the default's own model
    ([DEFAULT, "embedded-arithmetic-v2-seed0-eval8"], ["data.num_eval=8"]),  # built already: no build
    ([DEFAULT + ".build-7", DEFAULT + ".tmp-7"], ["data.num_eval=8"]),  # unfinished builds are no model
], ids=["empty-cache", "default-values", "cached", "unfinished-only"])
def test_no_reason_is_printed_where_the_cache_offers_no_model_to_reuse(tmp_path, monkeypatch, capsys, cached,
                                                                       overrides):
    for name in cached:
        finished_model(tmp_path, name)
    assert built_by_the_run(tmp_path, monkeypatch, capsys, *overrides) == ""

