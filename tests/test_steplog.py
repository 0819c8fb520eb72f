"""What a run records (rlcore/run/steplog.py, rundir.py): step metrics combined over micro-batches and ranks,
completions.jsonl's columns, and the rows a resume keeps."""

import types

import pytest
import torch

import rlcore.run.steplog
from conftest import exit_spawned_rank
from rlcore.losses.policy import PolicyLossOptions, policy_loss
from rlcore.run.rundir import RunDir, drop_rows_after
from rlcore.run.steplog import Progress, log_line, reduce_metrics


def test_step_metrics_weight_micro_batches_by_active_tokens():
    """Combining two micro-batches' diagnostics gives the diagnostics of the two as one batch."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.ones(6, 5, dtype=torch.float64)
    mask[:2, 1:] = 0  # the first micro-batch holds far fewer active tokens than the second
    kw = dict(options=PolicyLossOptions(policy_loss="ppo", epsilon=0.2, epsilon_high=0.28))
    micro = []
    for rows in (slice(0, 3), slice(3, 6)):
        _, m = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], **kw)
        micro.append({"loss": 0.1, **{k: float(v) for k, v in m.items()}})
    _, whole = policy_loss(logp, old, adv, mask, **kw)
    got = reduce_metrics(micro)
    assert got["tokens"] == 22 and got["loss"] == pytest.approx(0.2)
    for k in ("kl_old/k1", "kl_old/k3", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region"):
        assert got[k] == pytest.approx(float(whole[k]), abs=1e-6), k  # clip fractions are fp32
    assert micro[0]["kl_old/k3"] != pytest.approx(micro[1]["kl_old/k3"])  # weighting matters here


def reduce_on_two_ranks(rank, store_path, parts, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    out[rank] = reduce_metrics(parts[rank], world=2)
    dist.destroy_process_group()
    exit_spawned_rank()  # conftest: gloo's last collective could abort the process at exit


def test_step_metrics_combine_ranks_as_one_batch(tmp_path):
    """Two gloo ranks: the loss is averaged over ranks (as DDP averages gradients), token means
    weighted by each rank's tokens, `_max` / `/max` keys the maximum over both, `/min` the minimum."""
    import torch.multiprocessing as mp

    parts = [[{"loss": 0.1, "tokens": 2.0, "entropy": 1.0, "mismatch/abs_max": 3.0, "ratio/max": 1.5,
               "ratio/min": 0.7}],
             [{"loss": 0.2, "tokens": 4.0, "entropy": 2.0, "mismatch/abs_max": 5.0, "ratio/max": 1.9,
               "ratio/min": 0.5},
              {"loss": 0.1, "tokens": 2.0, "entropy": 5.0, "mismatch/abs_max": 1.0, "ratio/max": 1.2,
               "ratio/min": 0.6}]]
    out = mp.Manager().dict()
    mp.spawn(reduce_on_two_ranks, args=(str(tmp_path / "store"), parts, out), nprocs=2)
    expected = {"loss": (0.1 + 0.3) / 2, "tokens": 8.0, "entropy": (2 + 8 + 10) / 8, "mismatch/abs_max": 5.0,
                "ratio/max": 1.9, "ratio/min": 0.5}
    for rank in (0, 1):
        assert out[rank] == pytest.approx(expected)


def test_step_metrics_with_different_keys_per_micro_batch_are_an_error():
    parts = [{"loss": 0.1, "tokens": 2.0, "entropy": 1.0}, {"loss": 0.1, "tokens": 2.0}]
    with pytest.raises(ValueError, match=r"the metrics of micro-batch 1 lack 'entropy' \(micro-batch 0 has "
                                         r"\['entropy', 'loss', 'tokens'\]\); a loss must return the same"):
        reduce_metrics(parts)
    with pytest.raises(ValueError, match=r"micro-batch 1 add 'ratio/max'"):
        reduce_metrics([parts[0], {**parts[0], "ratio/max": 2.0}])


@pytest.mark.parametrize("column, values, error", [
    ("score", [1.0], r"log_extra column 'score' got 1 values for 2 completions; log one value per completion"),
    ("step", [1, 2], r"log_extra column 'step' is one of completions.jsonl's own fields"),
])
def test_log_completions_refuses_a_log_extra_column_it_cannot_write(column, values, error, tmp_path):
    texts = [(["1+1=", "1+1="], ["2", "3"], {column: values})]
    with pytest.raises(ValueError, match=error):
        RunDir(tmp_path).log_completions(1, texts, torch.ones(2, 1), torch.zeros(2), torch.ones(2), ["r"], None)


def test_a_resume_drops_rows_after_the_checkpoint_and_a_line_cut_short(tmp_path):
    file = tmp_path / "completions.jsonl"
    file.write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"step": 3, "x": 3}\n{"step": 3, "comp')
    drop_rows_after(file, 2)
    assert file.read_text() == '{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n'


def test_the_progress_line_names_kl_old_and_with_a_reference_kl_ref():
    m = {"reward/mean": 0.5, "reward/accuracy": 0.25, "kl_old/k3": 0.0012, "completion/len_mean": 3.0,
         "tokens_per_s/rollout": 100.0, "time/rollout": 1.0, "time/scoring": 0.01, "time/update": 2.0}
    line = log_line(3, 10, m)
    assert "kl_old 0.0012" in line and "kl_ref" not in line and line.startswith("step    3/10")
    assert "kl_old 0.0012  kl_ref 0.0550" in log_line(3, 10, {**m, "kl_ref": 0.055})


def test_progress_is_silent_for_quick_work_then_reports_at_most_once_per_interval(monkeypatch, capsys):
    now = [100.0]
    monkeypatch.setattr(rlcore.run.steplog, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    progress, quiet = Progress("step 3 update"), Progress("step 3 update", enabled=False)  # rank 0, another rank
    for t, what in [(5, "a"), (9.9, "b"), (10.5, "c"), (15, "d"), (20.4, "e"), (20.6, "f"), (45, "g")]:
        now[0] = 100.0 + t
        progress.report(what)
        quiet.report(what)
    # the first line once 10 s have passed, then none until 10 s after the last line
    assert capsys.readouterr().out.splitlines() == ["  step 3 update: c, 10s", "  step 3 update: f, 21s",
                                                     "  step 3 update: g, 45s"]
