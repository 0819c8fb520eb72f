"""Data parallelism over 2 gloo processes: gradient averaging (every gradient becomes the exact mean of
the ranks'), the embedded default built once, and 2 ranks training as one process does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import exit_spawned_rank
from rlcore.parallel.collectives import average_gradients


def model_with_grads(rank: int) -> torch.nn.Module:
    """Mixed shapes and dtypes, and one parameter without a gradient; grads differ per rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False), torch.nn.Linear(3, 2))
    model[1].double()
    g = torch.Generator().manual_seed(100 + rank)
    for name, p in model.named_parameters():
        if name != "2.bias":
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    return model


def _average_on_rank(rank, init_file, out_dir, bucket_bytes):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = model_with_grads(rank)
    average_gradients(model, 2, bucket_bytes=bucket_bytes)
    torch.save({n: p.grad for n, p in model.named_parameters()}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
    exit_spawned_rank()  # conftest: the last all-reduce's tensor could abort the process at exit


def check_average(tmp_path, bucket_bytes):
    mp.spawn(_average_on_rank, args=(str(tmp_path / "init"), str(tmp_path), bucket_bytes), nprocs=2)
    want = {n: None if p.grad is None else (p.grad + q.grad) / 2
            for (n, p), q in zip(model_with_grads(0).named_parameters(), model_with_grads(1).parameters())}
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt")
        for n, w in want.items():
            if w is None:
                assert got[n] is None, n
            else:
                # exact: a sum of two terms rounds the same in either order, and / 2 is exact
                assert got[n].dtype == w.dtype and torch.equal(got[n], w), (rank, n)


def test_gradients_averaged_with_one_parameter_per_bucket(tmp_path):
    check_average(tmp_path, bucket_bytes=1)


def test_gradients_averaged_with_everything_in_few_buckets(tmp_path):
    check_average(tmp_path, bucket_bytes=2**20)  # buckets split only where the dtype changes


# ---- the embedded default under torchrun ----

def _embedded_dir_on_rank(rank, init_file, out_dir, cache):
    """Every rank asks for the embedded model at once; the builder records who built it."""
    import time
    from pathlib import Path

    import rlcore.train
    from rlcore.config import load_config

    def build(path, pool, task):  # stands in for the 800-step SFT
        if path.exists():
            (Path(out_dir) / f"{rank}.txt").write_text("cached")
        else:
            time.sleep(1.0)
            path.mkdir(parents=True)
            (Path(out_dir) / f"{rank}.txt").write_text("built")
        return path

    os.environ["RLCORE_CACHE"] = cache
    rlcore.run.setup.build_embedded_model = build
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rlcore.run.setup.embedded_model_dir(load_config(None, []), rank)
    dist.destroy_process_group()


def test_rank_0_builds_the_embedded_model_while_the_others_wait(tmp_path):
    """Without the wait every rank built it at once, and the first to finish removed the others'
    build files under them: the first torchrun of the default failed."""
    mp.spawn(_embedded_dir_on_rank, args=(str(tmp_path / "init"), str(tmp_path), str(tmp_path / "cache")), nprocs=2)
    assert [(tmp_path / f"{rank}.txt").read_text() for rank in (0, 1)] == ["built", "cached"]


LEAVE = """
import atexit, sys
from rlcore.parallel import collectives
assert collectives.leave(5) == 5  # no process group in this process: the status comes back
collectives._ended_group = True  # as after close() under torchrun
atexit.register(lambda: print("atexit handler ran"))
print("output before", end="")
collectives.leave(3)
print("not reached")
"""


def test_a_rank_leaves_with_its_status_after_the_atexit_handlers_and_flushed_output():
    out = subprocess.run([sys.executable, "-c", LEAVE], capture_output=True, text=True)
    assert (out.returncode, out.stdout, out.stderr) == (3, "output beforeatexit handler ran\n", "")


# a script for `torchrun` (or plain python): `rlcore` with each round's completions fixed by its rows'
# place in the round (conftest.fixed_completions), whatever the rank count
FIXED_ROLLOUT = """
import os, sys
import rlcore.train
from conftest import clip_bound_margin, fixed_completions, fixed_rollout
from rlcore.cli import main

rounds = []
real_loss = rlcore.train.policy_loss


def policy_loss(logp, old, advantages, mask, *args, **kwargs):  # records how near a clip bound its ratios come
    with open(f"margins-{os.environ.get('RANK', '0')}.txt", "a") as f:
        f.write(f"{clip_bound_margin(logp - old, mask)}\\n")
    return real_loss(logp, old, advantages, mask, *args, **kwargs)


def generate(model, prompts, num_generations, max_new_tokens, eos_token_ids, pad_token_id, **kwargs):
    first = int(os.environ.get("RANK", "0")) * len(prompts)  # this rank's rows: first .. first + len(prompts) - 1
    every = fixed_completions(len(rounds), first + len(prompts), eos_token_ids[0], max_new_tokens)
    rounds.append(prompts)
    return fixed_rollout(prompts, every[first:], eos_token_ids[0], pad_token_id)

rlcore.rollout.completions.generate = generate
rlcore.train.policy_loss = policy_loss
sys.exit(main(sys.argv[1:]))
"""


def one_and_two_ranks(tmp_path, script: Path, options: list[str], b: int):
    """`script` (rlcore train with a fixed rollout) run as one process of per-device batch b, then as 2
    torchrun ranks of b / 2, with the `--set` options; their run directories and the ranks' output."""
    from test_train import torchrun

    def args(run, batch):
        return ["train", *(a for o in [*options, f"train.output_dir={run}", f"train.per_device_train_batch_size={batch}"]
                           for a in ("--set", o))]

    one, two = tmp_path / "one", tmp_path / "two"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    out = subprocess.run([sys.executable, str(script), *args(one, b)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    out = torchrun(tmp_path, *args(two, b // 2), script=script)
    assert out.returncode == 0, out.stderr[-3000:]
    return one, two, out


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_ranks_train_as_one_rank_with_micro_batches_twice_as_large(loss_type, qwen_dir, tmp_path):
    """docs/distributed.md: with S = GA, P ranks of b-row micro-batches train as one process of b*P-row ones, to
    fp32 rounding, on the same completions (an optimizer step then spans the whole round on every
    rank, whatever each rank's shuffle). 2 gloo ranks x b = 3 against one process with b = 6, over
    4 optimizer steps of mu = 2 replays with GA = 2: the same rewards, gradient norms and weights."""
    from test_train import rows, weights
    from test_train_hf import write_gsm8k

    script = tmp_path / "fixed_rollout.py"
    script.write_text(FIXED_ROLLOUT)
    data = write_gsm8k(tmp_path / "prompts.jsonl", range(8))
    options = [f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={data}", "data.prompt_column=question",
               "data.num_eval=0", "rollout.num_generations=4", "rollout.max_completion_length=6",
               f"loss.loss_type={loss_type}", "loss.num_iterations=2", "loss.reward_funcs=['conftest:token_reward']",
               "train.gradient_accumulation_steps=2", "train.learning_rate=0.01", "train.max_steps=4",
               "train.max_grad_norm=0.5", "train.device=cpu", "train.bf16=false"]

    one, two, out = one_and_two_ranks(tmp_path, script, options, 6)
    assert "2 rank(s) x 6 completions = 3 prompts x G=4 per round" in out.stdout

    # The two runs' log-probs differ in the last bits (other batch shapes): a ratio on a clip bound (the default
    # epsilon, 0.2) could fall on either side, and the runs then differ by more than rounding. 8 micro-batch losses
    # a run (2 rounds x mu = 2 x GA = 2) on each of 3 processes.
    margins = [float(x) for f in tmp_path.glob("margins-*.txt") for x in f.read_text().split()]
    assert len(margins) == 3 * 8 and min(margins) > 1e-5, f"a ratio sits {min(margins):.1e} from a clip bound"
    a, b = rows(one), rows(two)
    assert [r["reward/mean"] for r in b] == [r["reward/mean"] for r in a]  # the same completions
    assert [r["grad_norm"] for r in b] == pytest.approx([r["grad_norm"] for r in a], rel=1e-5)
    wa, wb, init = weights(one / "checkpoint-4" / "model"), weights(two / "checkpoint-4" / "model"), weights(qwen_dir)
    for name in wa:  # each tensor's update, to 0.1%: Adam moves an element whose gradient is rounding noise by
        moved = wa[name] - init[name]  # its sign (k_proj's bias: softmax ignores a shift of all of a query's scores)
        assert moved.abs().max() > 1e-3, name
        assert (wb[name] - init[name] - moved).norm() <= 1e-3 * moved.norm(), name


def test_two_ranks_with_dynamic_sampling_train_as_one_rank_with_micro_batches_twice_as_large(qwen_dir, tmp_path):
    """Dynamic sampling under torchrun (docs/loop.md): the kept groups are chosen over every rank's
    rows and each rank trains on its share of them, so 2 ranks x b = 3 train as one process with
    b = 6 on the same completions (fixed by their place in each generation batch), through rounds
    that take several generation batches and rounds that meet the cap of 2 and fill up with dropped
    groups. Groups of 4 straddle the ranks' 6 rows, so kept rows move between ranks."""
    from test_train import rows, weights
    from test_train_hf import write_gsm8k

    script = tmp_path / "fixed_rollout.py"
    script.write_text(FIXED_ROLLOUT)
    data = write_gsm8k(tmp_path / "prompts.jsonl", range(8))
    options = [f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={data}", "data.prompt_column=question",
               "data.num_eval=0", "rollout.num_generations=4", "rollout.max_completion_length=6",
               "rollout.filter_groups=true", "rollout.max_num_gen_batches=2",
               "loss.reward_funcs=['conftest:token_reward_if_odd_sum']", "train.steps_per_generation=2",
               "train.gradient_accumulation_steps=2", "train.learning_rate=0.01", "train.max_steps=4",
               "train.max_grad_norm=0.5", "train.device=cpu", "train.bf16=false"]

    one, two, out = one_and_two_ranks(tmp_path, script, options, 6)
    margins = [float(x) for f in tmp_path.glob("margins-*.txt") for x in f.read_text().split()]
    assert min(margins) > 1e-5, f"a ratio sits {min(margins):.1e} from a clip bound"
    a, b = rows(one), rows(two)
    counts = ("dynamic_sampling/gen_batches", "dynamic_sampling/groups_kept", "reward/mean", "frac_reward_zero_std")
    assert [[r[k] for k in counts] for r in b] == [[r[k] for k in counts] for r in a]
    assert {r["dynamic_sampling/gen_batches"] for r in a} == {1, 2}  # rounds of one batch, and of two
    assert min(r["dynamic_sampling/groups_kept"] for r in a) < 3  # a round at the cap, filled up
    assert [r["grad_norm"] for r in b] == pytest.approx([r["grad_norm"] for r in a], rel=1e-5)
    wa, wb, init = weights(one / "checkpoint-4" / "model"), weights(two / "checkpoint-4" / "model"), weights(qwen_dir)
    for name in wa:
        moved = wa[name] - init[name]
        assert (wb[name] - init[name] - moved).norm() <= 1e-3 * moved.norm(), name
