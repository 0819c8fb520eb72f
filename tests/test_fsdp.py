"""train.fsdp over 2 gloo processes (rlcore.parallel.fsdp): FSDP trains as one process with micro-batches
twice as large and as the replicated mode does; its sharded checkpoints resume exactly, survive a
SIGKILL during a save, resume on one rank, and export the full model.

Every run trains a tiny Qwen2 checkpoint on completions fixed by their rows' place in the round
(test_distributed.FIXED_ROLLOUT), so runs with other rank counts see the same completions.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcore.cli import main
from rlcore.models.transformer import ModelConfig, Transformer
from rlcore.run.export import sharded_model
from test_distributed import FIXED_ROLLOUT
from test_train import rows, torchrun, weights, without_timing
from test_train_hf import write_gsm8k

# test_distributed's script, with a resumed run's first round numbered FIRST_ROUND (the rounds it skips)
FIXED = FIXED_ROLLOUT.replace("fixed_completions(len(rounds),",
                              "fixed_completions(len(rounds) + int(os.environ.get('FIRST_ROUND', '0')),")
assert FIXED != FIXED_ROLLOUT

# rank 1 dies (SIGKILL) inside torch.distributed.checkpoint's writing of checkpoint-4, after its shard
KILLED_IN_SAVE = FIXED.replace("sys.exit(main(sys.argv[1:]))", """
import signal
from torch.distributed.checkpoint.filesystem import FileSystemWriter
real_write = FileSystemWriter.write_data


def write_data(self, plan, planner):
    written = real_write(self, plan, planner)
    written.wait()
    if os.environ["RANK"] == "1" and "checkpoint-4" in str(self.path):
        os.kill(os.getpid(), signal.SIGKILL)
    return written

FileSystemWriter.write_data = write_data
sys.exit(main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A tiny Qwen2 checkpoint, 32 prompts and the scripts every run of this file uses."""
    from conftest import save_model_for_tokenizer
    from rlcore.models.tokenizer import Tokenizer
    from test_tokenizer import qwen2_pipeline_checkpoint

    root = tmp_path_factory.mktemp("fsdp")
    model_dir = qwen2_pipeline_checkpoint(root / "qwen")
    save_model_for_tokenizer(model_dir, "qwen2", Tokenizer.from_dir(model_dir))
    (root / "fixed_rollout.py").write_text(FIXED)
    (root / "killed_in_save.py").write_text(KILLED_IN_SAVE)
    return {"root": root, "model": model_dir, "data": write_gsm8k(root / "prompts.jsonl", range(8))}


def options(setting, loss_type: str) -> list[str]:
    """4 optimizer steps of mu = 2 replays with GA = 2 (2 rounds), checkpoints at steps 2 and 4."""
    return [f"model.path={setting['model']}", "data.task=jsonl", f"data.path={setting['data']}",
            "data.prompt_column=question", "data.num_eval=0", "rollout.num_generations=4",
            "rollout.max_completion_length=6", f"loss.loss_type={loss_type}", "loss.num_iterations=2",
            "loss.reward_funcs=['conftest:token_reward']", "train.gradient_accumulation_steps=2",
            "train.learning_rate=0.01", "train.max_steps=4", "train.save_steps=2", "train.max_grad_norm=0.5",
            "train.device=cpu", "train.bf16=false"]


def sets(*overrides) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def launch(setting, name: str, ranks: int, args: list[str], script: str = "fixed_rollout.py"):
    """Run the `rlcore` CLI with `args` on `ranks` processes, with the completions fixed, in a
    directory of its own (where the script records how near a clip bound each ratio came)."""
    cwd = setting["root"] / f"cwd-{name}"
    cwd.mkdir(exist_ok=True)
    if ranks == 2:
        return torchrun(cwd, *args, script=setting["root"] / script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    return subprocess.run([sys.executable, str(setting["root"] / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def train_run(setting, name: str, ranks: int, b: int, loss_type: str = "dapo", *extra) -> Path:
    run = setting["root"] / name
    out = launch(setting, name, ranks, ["train", *sets(*options(setting, loss_type), f"train.output_dir={run}",
                                                        f"train.per_device_train_batch_size={b}", *extra)])
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def assert_far_from_clip_bounds(setting, *names):
    """The runs' log-probs differ in the last bits (other batch shapes or reduction orders): a ratio on a
    clip bound could fall on either side, and the runs would then differ by more than rounding."""
    margins = [float(x) for name in names for f in (setting["root"] / f"cwd-{name}").glob("margins-*.txt")
               for x in f.read_text().split()]
    assert margins and min(margins) > 1e-5, f"a ratio sits {min(margins):.1e} from a clip bound"


def assert_trained_alike(a: Path, b: Path, init_dir: Path, step: int = 4):
    """Runs a and b saw the same completions and moved every weight alike: the same rewards, gradient
    norms to 1e-5, and each tensor's update to 0.1% (Adam moves an element whose gradient is rounding
    noise by its sign)."""
    ra, rb = rows(a), rows(b)
    assert [r["reward/mean"] for r in rb] == [r["reward/mean"] for r in ra]
    assert [r["grad_norm"] for r in rb] == pytest.approx([r["grad_norm"] for r in ra], rel=1e-5)
    wa, wb = weights(a / f"checkpoint-{step}" / "model"), weights(b / f"checkpoint-{step}" / "model")
    init = weights(init_dir)
    for name in wa:
        moved = wa[name] - init[name]
        assert moved.abs().max() > 1e-3, name
        assert (wb[name] - init[name] - moved).norm() <= 1e-3 * moved.norm(), name


@pytest.fixture(scope="module")
def fsdp_dapo(setting):
    """The FSDP run every test below compares with: 2 ranks x b = 3, dapo."""
    return train_run(setting, "fsdp-dapo", 2, 3, "dapo", "train.fsdp=true")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_fsdp_on_two_ranks_trains_as_one_process_with_micro_batches_twice_as_large(loss_type, setting, fsdp_dapo):
    """grpo with loss.beta: the KL reference is sharded too, and its log-probs are the one process's."""
    beta = ["loss.beta=0.04"] if loss_type == "grpo" else []
    two = fsdp_dapo if loss_type == "dapo" else train_run(setting, "fsdp-grpo", 2, 3, "grpo", "train.fsdp=true", *beta)
    one = train_run(setting, f"one-{loss_type}", 1, 6, loss_type, *beta)
    assert_far_from_clip_bounds(setting, two.name, one.name)
    assert_trained_alike(one, two, setting["model"])
    if beta:
        assert [r["kl_ref"] for r in rows(two)] == pytest.approx([r["kl_ref"] for r in rows(one)], rel=1e-4)
        assert rows(one)[-1]["kl_ref"] > 0


@pytest.fixture(scope="module")
def replicated_dapo(setting):
    return train_run(setting, "replicated-dapo", 2, 3, "dapo")


def test_fsdp_trains_as_the_replicated_mode(setting, fsdp_dapo, replicated_dapo):
    replicated = replicated_dapo
    assert_far_from_clip_bounds(setting, replicated.name, fsdp_dapo.name)
    assert_trained_alike(replicated, fsdp_dapo, setting["model"])


def test_offloaded_shards_train_as_shards_on_the_device(setting, fsdp_dapo):
    """train.fsdp_offload (FSDP2's CPUOffloadPolicy): the shards, gradients and AdamW state in CPU
    memory, each block copied to the device to compute. Here the device is the CPU, so the placement
    is the same and the run must be the FSDP run, metrics and weights; on a GPU it is not measured."""
    offloaded = train_run(setting, "fsdp-offload", 2, 3, "dapo", "train.fsdp=true", "train.fsdp_offload=true")
    assert [without_timing(r) for r in rows(offloaded)] == [without_timing(r) for r in rows(fsdp_dapo)]
    a, b = weights(fsdp_dapo / "checkpoint-4" / "model"), weights(offloaded / "checkpoint-4" / "model")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_sharded_checkpoint_holds_the_shards_and_the_last_one_the_full_model(fsdp_dapo):
    first, last = fsdp_dapo / "checkpoint-2", fsdp_dapo / "checkpoint-4"
    assert sorted(p.name for p in (first / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (first / "model").exists() and (last / "model" / "model.safetensors").is_file()
    # the shards, gathered in one process, are the weights rank 0 gathered and wrote at the end
    gathered, single = weights(last / "model"), sharded_model(last)[0].state_dict()
    assert gathered.keys() == single.keys()
    assert all(torch.equal(gathered[k], single[k]) for k in gathered)


def test_a_sharded_run_resumed_from_its_checkpoint_trains_as_the_uninterrupted_one(setting, fsdp_dapo, tmp_path,
                                                                                    monkeypatch):
    run = tmp_path / "resumed"
    subprocess.run(["cp", "-r", str(fsdp_dapo), str(run)], check=True)
    (run / "latest").write_text("checkpoint-2")  # as if it had stopped after step 2, the first round's last
    monkeypatch.setenv("FIRST_ROUND", "1")
    subprocess.run(["rm", "-r", str(run / "checkpoint-4")], check=True)
    out = launch(setting, "resumed", 2, ["train", "--resume", str(run)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {run / 'checkpoint-2'} at step 2" in out.stdout
    assert [without_timing(r) for r in rows(run)] == [without_timing(r) for r in rows(fsdp_dapo)]
    wa, wb = weights(fsdp_dapo / "checkpoint-4" / "model"), weights(run / "checkpoint-4" / "model")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_sigkill_during_a_sharded_save_leaves_the_previous_checkpoint_which_resumes_on_one_rank(setting, fsdp_dapo,
                                                                                                   monkeypatch):
    """Rank 1 dies inside DCP's writing of checkpoint-4; checkpoint-2 stays the one `latest` names. The 2-rank
    checkpoint then resumes on 1 process with micro-batches twice as large (the same rounds of 12 completions),
    which trains as the 2 ranks did (the first test's equivalence): DCP gathered every shard."""
    run = setting["root"] / "killed"
    out = launch(setting, "killed", 2, ["train", *sets(*options(setting, "dapo"), f"train.output_dir={run}",
                                                       "train.per_device_train_batch_size=3", "train.fsdp=true")],
                 script="killed_in_save.py")
    assert out.returncode != 0
    assert (run / "latest").read_text() == "checkpoint-2" and (run / ".checkpoint-4.tmp").is_dir()
    assert not (run / "checkpoint-4").exists()

    monkeypatch.setenv("FIRST_ROUND", "1")  # checkpoint-2 ends the first round
    out = launch(setting, "killed-resumed", 1, ["train", "--resume", str(run),
                                                *sets("train.per_device_train_batch_size=6")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 rank(s) x 12 completions = 3 prompts x G=4 per round" in out.stdout
    assert not (run / ".checkpoint-4.tmp").exists()
    assert_trained_alike(fsdp_dapo, run, setting["model"])


def test_rlcore_export_gathers_a_sharded_checkpoint_into_a_hugging_face_model(setting, fsdp_dapo, tmp_path):
    one = setting["root"] / "one-dapo"
    if not one.exists():
        one = train_run(setting, "one-dapo", 1, 6, "dapo")
    assert main(["export", str(fsdp_dapo / "checkpoint-2"), str(tmp_path / "hf")]) == 0
    exported, reference, init = (weights(d) for d in (tmp_path / "hf", one / "checkpoint-2" / "model",
                                                      setting["model"]))
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    for name in reference:
        moved = reference[name] - init[name]
        assert (exported[name] - init[name] - moved).norm() <= 1e-3 * moved.norm(), name


# ---- rlcore.parallel.fsdp in 2 spawned gloo processes, on a tiny random model ----

def tiny_model(tied: bool, dtype=torch.float64) -> Transformer:

    torch.manual_seed(0)
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=tied,
                      qkv_bias=True)
    return Transformer(cfg).to(dtype)  # fp64: the sharded and the plain gradients agree to 1e-12


def rows_sharing_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """8 rows of 4 prompt + 6 completion tokens, rows 2k and 2k+1 with the same prompt."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 10), generator=g)
    ids[:, :4] = ids[torch.arange(8) // 2 * 2, :4]
    return ids, torch.ones_like(ids)


CASES = [(False, False), (True, False), (False, True)]  # (tied embeddings, bf16 compute)


def _sharded_steps_on_rank(rank, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    for tied, bf16 in CASES:
        torch.save(sharded_step(rank, tied, bf16), os.path.join(out_dir, f"{tied}-{bf16}-{rank}.pt"))
    dist.destroy_process_group()
    from conftest import exit_spawned_rank
    exit_spawned_rank()


def sharded_step(rank: int, tied: bool, bf16: bool) -> tuple:
    from rlcore.parallel import fsdp
    from rlcore.forward import SharedPrompts, completion_logprobs
    from rlcore.losses.logprobs import token_logprobs

    model = tiny_model(tied, torch.float32 if bf16 else torch.float64)
    engine = fsdp.EngineCopy(model)
    fsdp.shard(model, 2, torch.device("cpu"), bf16=bf16)
    amp = torch.bfloat16 if bf16 else None  # the loop's autocast, as with train.bf16
    ids, attn = rows_sharing_prompts()
    mine = slice(4 * rank, 4 * rank + 4)
    shards_before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    try:  # before a forward the output projection is a shard: the log-prob matmul must refuse it
        token_logprobs(torch.zeros(1, 1, 16, dtype=torch.float64), model.lm_head_weight,
                       torch.zeros(1, 1, dtype=torch.long))
        refused = False
    except (RuntimeError, NotImplementedError):
        refused = True
    # one optimizer step's 2 micro-batches of 2 rows sharing one prompt pass, as the loop runs them
    shared = SharedPrompts.build(model, ids[mine], attn[mine], 4, amp)
    logps = []
    for j, mb in enumerate((slice(4 * rank, 4 * rank + 2), slice(4 * rank + 2, 4 * rank + 4)), 1):
        logp, _ = completion_logprobs(model, ids[mb], attn[mb], 4, ids[mb, 4:], 1.0, amp, shared)
        fsdp.sync_gradients(model, last=False)
        logp.sum().backward()
        logps.append(logp.detach())
    reduced_early = any(p.grad is not None for p in model.parameters())  # a reduce-scatter sets the shards' grads
    fsdp.sync_gradients(model, last=True)
    shared.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # the master shards' dtype
    with engine.gathered(model) as plain:
        full = {n: p.clone() for n, p in plain.named_parameters()}
    freed = all(p.is_meta for p in engine.model.parameters())
    return refused, reduced_early, torch.cat(logps), grads, full, shards_before, freed


@pytest.fixture(scope="module")
def sharded_steps(tmp_path_factory):
    """Each of CASES' sharded steps, on 2 spawned ranks: {case: [rank 0's results, rank 1's]}."""
    import torch.multiprocessing as mp

    out_dir = tmp_path_factory.mktemp("sharded-steps")
    mp.spawn(_sharded_steps_on_rank, args=(str(out_dir / "init"), str(out_dir)), nprocs=2)
    return {case: [torch.load(out_dir / f"{case[0]}-{case[1]}-{rank}.pt") for rank in (0, 1)] for case in CASES}


@pytest.mark.parametrize("tied, bf16", CASES)
def test_sharded_log_probs_and_gradients_are_the_plain_models(tied, bf16, sharded_steps):
    """Per rank: the chunked log-probs read the gathered output projection (never a shard); the step's
    three backwards (2 micro-batches, then the shared prompt pass) reduce once, in the last, to the mean
    over the ranks of each rank's gradient;
    the engine's copy holds the full weights, and frees them after. fp64 to 1e-10; with bf16 compute
    (FSDP's mixed precision) against the plain model in fp32, to bf16's precision, with fp32 gradients."""
    from rlcore.forward import completion_logprobs

    out = sharded_steps[tied, bf16]
    plain = tiny_model(tied, torch.float32 if bf16 else torch.float64)
    tolerance = dict(rtol=3e-2, atol=3e-2) if bf16 else dict(rtol=1e-10, atol=1e-12)
    ids, attn = rows_sharing_prompts()
    logp, _ = completion_logprobs(plain, ids, attn, 4, ids[:, 4:])
    (logp.sum() / 2).backward()  # the mean over 2 ranks of each one's sum over its rows
    for rank in (0, 1):
        refused, reduced_early, got_logp, grads, full, _, freed = out[rank]
        assert refused and not reduced_early and freed
        torch.testing.assert_close(got_logp, logp[4 * rank:4 * rank + 4].detach(), **tolerance)
        for name, p in plain.named_parameters():
            assert grads[name].dtype == p.dtype, name
            if bf16:  # each gradient tensor to 2% of its norm
                assert (grads[name] - p.grad).norm() <= 2e-2 * p.grad.norm(), name
            else:
                torch.testing.assert_close(grads[name], p.grad, **tolerance, msg=name)
            assert torch.equal(full[name], p.detach()), name
    # each rank held half of each weight's rows
    for name, p in plain.named_parameters():
        halves = [out[rank][5][name] for rank in (0, 1)]
        assert torch.equal(torch.cat(halves), p.detach()), name


def test_lora_under_fsdp_on_two_ranks_trains_as_one_process(setting, tmp_path):
    """LoRA's adapters shard with the frozen base they sit on; the 2 ranks' adapters, merged by `rlcore export`,
    move the base's projections as one process's do (no adapter dropout: its random draws differ by rank)."""
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "lora.dropout=0.0"]
    two = train_run(setting, "lora-fsdp", 2, 3, "dapo", "train.fsdp=true", *lora)
    one = train_run(setting, "lora-one", 1, 6, "dapo", *lora)
    assert_far_from_clip_bounds(setting, two.name, one.name)
    assert sorted(p.name for p in (two / "checkpoint-2" / "sharded").iterdir()) == [".metadata", "__0_0.distcp",
                                                                                    "__1_0.distcp"]
    assert (two / "checkpoint-4" / "adapter" / "adapter_model.safetensors").is_file()
    assert [r["grad_norm"] for r in rows(two)] == pytest.approx([r["grad_norm"] for r in rows(one)], rel=1e-5)
    for run in (one, two):
        assert main(["export", str(run / "checkpoint-4"), str(tmp_path / run.name)]) == 0
    wa, wb, init = weights(tmp_path / one.name), weights(tmp_path / two.name), weights(setting["model"])
    projections = [name for name in wa if name.endswith("proj.weight")]
    assert projections
    for name in wa:
        moved = wa[name] - init[name]
        if name in projections:
            assert moved.abs().max() > 1e-4, name
        assert (wb[name] - init[name] - moved).norm() <= 1e-3 * moved.norm(), name


# ---- the option ----

def test_trls_fsdp_options_set_train_fsdp():
    from rlcore import ConfigError
    from rlcore.config import load_config

    assert load_config(None, ["fsdp=full_shard auto_wrap"]).train.fsdp
    assert load_config(None, ["fsdp=['full_shard']"]).train.fsdp
    assert not load_config(None, ["fsdp="]).train.fsdp
    with pytest.raises(ConfigError, match=r"train.fsdp = 'False' has type str, expected a bool"):
        load_config(None, ["train.fsdp=False"])
    assert not load_config(None, ["fsdp=full_shard auto_wrap"]).train.fsdp_offload
    offloaded = load_config(None, ["fsdp=full_shard auto_wrap offload"]).train
    assert offloaded.fsdp and offloaded.fsdp_offload
    with pytest.raises(ConfigError, match=r"TRL's fsdp = 'full_shard hybrid_shard': rlcore has no 'hybrid_shard'"):
        load_config(None, ["fsdp=full_shard hybrid_shard"])
    with pytest.warns(UserWarning, match=r"TRL's fsdp_config = \{'fsdp_version': 2\} is ignored"):
        load_config(None, ["fsdp_config={fsdp_version = 2}"])


def test_fsdp_refuses_fp16_and_a_synced_reference_and_offload_needs_fsdp():
    from rlcore import ConfigError
    from rlcore.config import load_config

    with pytest.raises(ConfigError, match="train.fsdp_offload = true offloads FSDP's shards, and train.fsdp = false"):
        load_config(None, ["train.fsdp_offload=true"])
    with pytest.raises(ConfigError, match="fp16 loss scaling is not supported with it"):
        load_config(None, ["train.fsdp=true", "train.fp16=true", "model.dtype=float32"])
    with pytest.raises(ConfigError, match="loss.sync_ref_model .* not supported with train.fsdp"):
        load_config(None, ["train.fsdp=true", "loss.sync_ref_model=true", "loss.beta=0.04"])


def test_two_torchrun_agents_as_two_nodes_train_as_two_ranks_of_one(setting, fsdp_dapo):
    """docs/distributed.md's multi-node launch, both "nodes" on this machine: two torchrun agents of one rank
    each meet at a c10d rendezvous on 127.0.0.1, and train as one agent's two ranks do (here with gradient
    checkpointing: FSDP gathers each recomputed block again in backward)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = setting["root"] / "two-nodes"
    cwd = setting["root"] / "cwd-two-nodes"
    cwd.mkdir()
    args = ["train", *sets(*options(setting, "dapo"), f"train.output_dir={run}", "train.per_device_train_batch_size=3",
                           "train.fsdp=true", "train.gradient_checkpointing=true")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=rlcore-test",
                                str(setting["root"] / "fixed_rollout.py"), *args],
                               cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert any("2 rank(s) x 6 completions = 3 prompts x G=4 per round" in out for out, _ in outputs)
    assert_far_from_clip_bounds(setting, "two-nodes", fsdp_dapo.name)
    assert_trained_alike(fsdp_dapo, run, setting["model"])


def test_a_replicated_checkpoint_does_not_resume_sharded(setting, replicated_dapo):
    config_toml = (replicated_dapo / "config.toml").read_text()
    out = launch(setting, "replicated-as-sharded", 2, ["train", "--resume", str(replicated_dapo),
                                                       *sets("train.fsdp=true", "train.max_steps=6")])
    assert out.returncode != 0
    assert "was saved by a replicated run (its optimizer state is whole) and train.fsdp = true shards this one; " \
           "resume it with --set train.fsdp=false" in out.stderr
    assert (replicated_dapo / "config.toml").read_text() == config_toml


def test_fsdp_samples_and_evaluates_what_the_replicated_mode_does(setting):
    """The real rollout engine and greedy held-out evaluation under FSDP run on the plain copy with the gathered
    weights: the same completions (rewards and lengths) and held-out accuracy as replicated ranks, exactly, before
    the first update (after it, the two modes' weights differ in the last bits, which may flip a sample)."""
    real = [f"model.path={setting['model']}", "data.task=jsonl", f"data.path={setting['data']}",
            "data.prompt_column=question", "data.num_eval=4", "rollout.num_generations=4",
            "rollout.max_completion_length=6", "loss.reward_funcs=['conftest:token_reward']", "train.max_steps=1",
            "train.learning_rate=0.01", "train.per_device_train_batch_size=4", "train.device=cpu",
            "train.bf16=false"]
    runs = {}
    for mode in ("replicated", "fsdp"):
        runs[mode] = setting["root"] / f"real-{mode}"
        cwd = setting["root"] / f"cwd-real-{mode}"
        cwd.mkdir()
        fsdp = "true" if mode == "fsdp" else "false"
        out = torchrun(cwd, "train", *sets(*real, f"train.output_dir={runs[mode]}", f"train.fsdp={fsdp}"))
        assert out.returncode == 0, out.stderr[-3000:]
    keys = ("reward/mean", "completion/len_mean", "completion/len_min", "completion/len_max")
    replicated, sharded = rows(runs["replicated"])[0], rows(runs["fsdp"])[0]
    assert [sharded[k] for k in keys] == [replicated[k] for k in keys]
    before = [(run / "eval.jsonl").read_text().splitlines()[0] for run in runs.values()]
    assert before[0] == before[1] and '"step": 0' in before[0]
