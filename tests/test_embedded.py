"""Building the embedded default model in $RLCORE_CACHE: a build that fails or is interrupted leaves
nothing behind but what it found.

The SFT is replaced by a stand-in (the warm start itself is test_train.py's), so each test takes a
fraction of a second."""

import pytest

import rlcore.embedded
from rlcore.embedded import build_embedded_model
from rlcore.tasks import unique_problems

POOL = unique_problems("arithmetic", 20, 0)
DEFAULT = "embedded-arithmetic-v2-seed0-eval200"  # rlcore/default.toml's data.seed and data.num_eval


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
    monkeypatch.setattr(rlcore.embedded, "sft", sft_raising(error))
    with pytest.raises(type(error)):
        build_embedded_model(tmp_path / "embedded", POOL, threads=1)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_build_keeps_the_finished_models_and_the_other_builders_directories(tmp_path, monkeypatch):
    """Ranks on other machines that share the cache build beside this one, in directories of their own."""
    finished_model(tmp_path)
    other = tmp_path / "embedded-arithmetic-v2-seed0-eval8.build-7"  # another process's, at work
    other.mkdir()
    (other / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(rlcore.embedded, "sft", sft_raising(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError):
        build_embedded_model(tmp_path / "embedded-arithmetic-v2-seed0-eval8", POOL, threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEFAULT, other.name]
    assert (tmp_path / DEFAULT / "model.safetensors").read_bytes() == b"weights"
    assert (other / "tokenizer.json").read_text() == "{}"


def test_a_build_whose_sft_finishes_creates_the_cache_and_leaves_only_the_model_there(tmp_path, monkeypatch):
    monkeypatch.setattr(rlcore.embedded, "sft", lambda *args, **kwargs: None)
    path = build_embedded_model(tmp_path / "cache" / "embedded", POOL, threads=1)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["embedded"]
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()

