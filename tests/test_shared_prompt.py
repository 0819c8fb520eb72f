"""Rows that repeat a prompt share one forward pass over it (`completion_hidden`, `PrefixKV`),
within a micro-batch or across the micro-batches of an optimizer step (`SharedPrompts`).

The oracle is each row run on its own, unpadded: its log-probs from transformers, its gradients
from rlcore's plain forward pass. Sharing must change neither.
"""

import pytest
import torch

from rlcore.models.hf_checkpoint import load_model
from rlcore.models.transformer import PrefixKV
from rlcore.forward import SharedPrompts, completion_hidden, completion_logprobs, pack

# Three prompts of different lengths, repeated unevenly, with ragged completions.
LENGTHS_P, LENGTHS_C = (5, 9, 3), (4, 7, 1, 7, 2, 6)
WHICH = (0, 1, 0, 2, 1, 0)


def batch(seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in LENGTHS_P]
    completions = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in LENGTHS_C]
    return [prompts[i] for i in WHICH], completions


def per_row_logprobs(forward, prompts, completions):
    """[B, Tc] log-probs, each row through `forward(ids [1, T]) -> logits` alone, zero-padded."""
    Tc = max(map(len, completions))
    out = torch.zeros(len(prompts), Tc, dtype=torch.float64)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        logits = forward(torch.tensor([p + c]))[0, len(p) - 1:len(p) - 1 + len(c)].double()
        out[i, :len(c)] = logits.log_softmax(-1).gather(1, torch.tensor(c)[:, None])[:, 0]
    return out


# Two micro-batches of one optimizer step, as the loop cuts them from a shuffled round: rows
# (0, 3, 5) and (1, 2, 4) of `batch()`; prompt 0 is in both, prompt 1 too, prompt 2 in one.
MICRO = (torch.tensor([0, 3, 5]), torch.tensor([1, 2, 4]))


@pytest.mark.parametrize("across", [False, True], ids=["within_micro_batch", "across_micro_batches"])
@pytest.mark.parametrize("family", ["llama", "qwen2_tied", "qwen3"])
def test_shared_prompt_logprobs_match_transformers_per_row(family, across, hf_checkpoint):
    path, hf = hf_checkpoint(family)
    model = load_model(path)
    prompts, completions = batch()
    ids, attn, cids, cmask, Lp = pack(prompts, completions, pad_id=0)
    with torch.no_grad():
        if across:  # SharedPrompts over the step, then each micro-batch on its own
            shared = SharedPrompts.build(model, ids, attn, Lp)
            logp = torch.zeros(cids.shape)
            for r in MICRO:
                logp[r] = completion_logprobs(model, ids[r], attn[r], Lp, cids[r], shared=shared)[0]
        else:
            logp, _ = completion_logprobs(model, ids, attn, Lp, cids)
        ref = per_row_logprobs(lambda x: hf(input_ids=x).logits, prompts, completions)
    assert ((logp.double() - ref) * cmask).abs().max().item() <= 1e-4
    assert torch.isfinite(logp).all()  # padding positions too: they are masked, never NaN


@pytest.mark.parametrize("repeats", [False, True], ids=["distinct_prompts", "repeated_prompts"])
def test_one_token_completions_match_transformers(repeats, hf_checkpoint):
    """Completions of one token: the prompt's last position alone predicts them (no pass over
    the completion at all, in either the plain or the shared-prompt path)."""
    path, hf = hf_checkpoint("qwen2")
    model = load_model(path)
    prompts, _ = batch()
    prompts = prompts if repeats else prompts[:2] + prompts[3:4]
    completions = [[7 + i] for i in range(len(prompts))]
    ids, attn, cids, cmask, Lp = pack(prompts, completions, pad_id=0)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, ids, attn, Lp, cids)
        ref = per_row_logprobs(lambda x: hf(input_ids=x).logits, prompts, completions)
    assert logp.shape == (len(prompts), 1)
    assert (logp.double() - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("across", [False, True], ids=["within_micro_batch", "across_micro_batches"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_shared_prompt_gradients_match_per_row_passes_fp64(family, across, hf_checkpoint):
    """Across micro-batches, each one backward()s on its own, as in the loop, then
    shared.backward() once; without that last call the prompt pass gets no gradient and this
    fails."""
    model = load_model(hf_checkpoint(family)[0]).double()
    prompts, completions = batch(seed=1)
    ids, attn, cids, cmask, Lp = pack(prompts, completions, pad_id=0)
    weights = torch.randn(cids.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * cmask
    if across:
        shared = SharedPrompts.build(model, ids, attn, Lp)
        for r in MICRO:
            logp = completion_logprobs(model, ids[r], attn[r], Lp, cids[r], shared=shared)[0]
            (logp * weights[r]).sum().backward()
        shared.backward()
    else:
        (completion_logprobs(model, ids, attn, Lp, cids)[0] * weights).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    per_row = torch.autograd.grad((per_row_logprobs(lambda x: model.logits(model(x)), prompts, completions)
                                   * weights).sum(), list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), got, per_row):
        # RMSNorm normalises in fp32 (as transformers does) even in fp64, so summing the rows'
        # gradients before or after it differs at fp32 rounding, ~1e-7 relative.
        assert (a - b).abs().max() <= 1e-6 * b.abs().max() + 1e-12, name


def forward_shapes(model, monkeypatch) -> list:
    """The input shape of every forward call `model` makes from now on."""
    seen, forward = [], type(model).forward

    def recording(self, x, *args, **kwargs):
        seen.append(tuple(x.shape))
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", recording)
    return seen


def test_shared_pass_runs_each_distinct_prompt_once(hf_checkpoint, monkeypatch):
    model = load_model(hf_checkpoint("qwen2")[0])
    ids, attn, cids, cmask, Lp = pack(*batch(), pad_id=0)
    seen = forward_shapes(model, monkeypatch)
    completion_hidden(model, ids, attn, Lp)
    # 3 distinct prompts, then 6 completions without their last token (it predicts nothing)
    assert seen == [(3, Lp), (len(ids), ids.shape[1] - Lp - 1)]


def test_distinct_prompts_take_the_plain_pass(hf_checkpoint, monkeypatch):
    model = load_model(hf_checkpoint("qwen2")[0])
    prompts, completions = batch()
    ids, attn, cids, cmask, Lp = pack(prompts[:2] + prompts[3:4], completions[:3], pad_id=0)
    seen = forward_shapes(model, monkeypatch)
    completion_hidden(model, ids, attn, Lp)
    assert seen == [(len(ids), ids.shape[1] - 1)]  # one pass over the rows but their last token


def test_prefix_rows_without_a_mask_raise(hf_checkpoint):
    model = load_model(hf_checkpoint("qwen2")[0])
    prefix = PrefixKV()
    model(torch.ones(1, 3, dtype=torch.long), prefix=prefix)
    with pytest.raises(ValueError, match="mask"):
        model(torch.ones(2, 2, dtype=torch.long), prefix=prefix, prefix_rows=torch.zeros(2, dtype=torch.long))


def test_shared_prompts_run_each_distinct_prompt_of_the_step_once(hf_checkpoint, monkeypatch):
    model = load_model(hf_checkpoint("qwen2")[0])
    ids, attn, cids, cmask, Lp = pack(*batch(), pad_id=0)
    seen = forward_shapes(model, monkeypatch)
    shared = SharedPrompts.build(model, ids, attn, Lp)
    for r in MICRO:
        shared.completion_hidden(ids[r], attn[r])
    # 3 distinct prompts once, then 3 + 3 completions (but their last token, which predicts
    # nothing); per micro-batch it would be 2 + 3 prompts.
    assert seen == [(3, Lp), (3, ids.shape[1] - Lp - 1), (3, ids.shape[1] - Lp - 1)]


def test_shared_prompts_none_without_repeats_or_over_the_cap_and_foreign_rows_raise(hf_checkpoint):
    model = load_model(hf_checkpoint("qwen2")[0])
    prompts, completions = batch()
    ids, attn, cids, cmask, Lp = pack(prompts, completions, pad_id=0)
    assert SharedPrompts.build(model, ids[[0, 1, 3]], attn[[0, 1, 3]], Lp) is None  # 3 distinct prompts
    assert SharedPrompts.build(model, ids, attn, Lp, max_prompts=2) is None  # 3 distinct > 2
    assert SharedPrompts.build(model, ids, attn, Lp, max_prompts=3) is not None
    shared = SharedPrompts.build(model, ids[[0, 2]], attn[[0, 2]], Lp)  # prompt 0 twice
    with pytest.raises(ValueError, match="not among the prompts"):
        shared.completion_hidden(ids[[1]], attn[[1]])


@pytest.mark.parametrize("across", [False, True], ids=["within_micro_batch", "across_micro_batches"])
def test_bf16_autocast_logprobs_are_within_bf16_rounding_of_transformers_fp32(across, hf_checkpoint):
    """train.bf16's training forward: the body under bf16 autocast, the log-probs from fp32 hidden
    states and weights. Not equal to fp32 (autocast ran) and close to it (log-probs stay fp32)."""
    path, hf = hf_checkpoint("qwen2")
    model = load_model(path)
    prompts, completions = batch()
    ids, attn, cids, cmask, Lp = pack(prompts, completions, pad_id=0)
    with torch.no_grad():
        if across:
            shared = SharedPrompts.build(model, ids, attn, Lp, autocast=torch.bfloat16)
            logp = torch.zeros(cids.shape)
            for r in MICRO:
                logp[r] = completion_logprobs(model, ids[r], attn[r], Lp, cids[r], autocast=torch.bfloat16, shared=shared)[0]
        else:
            logp, _ = completion_logprobs(model, ids, attn, Lp, cids, autocast=torch.bfloat16)
        ref = per_row_logprobs(lambda x: hf(input_ids=x).logits, prompts, completions)
    assert logp.dtype == torch.float32
    diff = ((logp.double() - ref) * cmask).abs().max().item()
    print(f"\nbf16 autocast vs fp32: max |logp diff| = {diff:.2e}")
    assert 1e-5 < diff < 5e-3


# ----------------------------------------------------------------------------- gradient checkpointing

@pytest.mark.parametrize("path", ["distinct_prompts", "within_micro_batch", "across_micro_batches"])
def test_gradient_checkpointing_keeps_the_gradients_of_per_row_passes_fp64(path, hf_checkpoint):
    """train.gradient_checkpointing on each of the training forward's three paths: the plain pass,
    a prompt shared within a micro-batch, and SharedPrompts over two micro-batches (whose prompt
    pass is recomputed only at shared.backward()). Oracle: per-row passes without it."""
    model = load_model(hf_checkpoint("qwen3")[0]).double()
    prompts, completions = batch(seed=1)
    if path == "distinct_prompts":
        prompts, completions = prompts[:2] + prompts[3:4], completions[:3]
    ids, attn, cids, cmask, Lp = pack(prompts, completions, pad_id=0)
    weights = torch.randn(cids.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * cmask
    model.gradient_checkpointing = True
    if path == "across_micro_batches":
        shared = SharedPrompts.build(model, ids, attn, Lp)
        for r in MICRO:
            (completion_logprobs(model, ids[r], attn[r], Lp, cids[r], shared=shared)[0] * weights[r]).sum().backward()
        shared.backward()
    else:
        (completion_logprobs(model, ids, attn, Lp, cids)[0] * weights).sum().backward()
    model.gradient_checkpointing = False
    per_row = torch.autograd.grad((per_row_logprobs(lambda x: model.logits(model(x)), prompts, completions)
                                   * weights).sum(), list(model.parameters()))
    for (name, p), b in zip(model.named_parameters(), per_row):
        assert (p.grad - b).abs().max() <= 1e-6 * b.abs().max() + 1e-12, name


@pytest.mark.parametrize("on", [False, True])
def test_gradient_checkpointing_frees_layer_activations_and_runs_layers_again(on, hf_checkpoint, monkeypatch):
    """With it, a layer's inner activations (here the MLP's up projection, which the product
    with silu(gate) needs in backward) are gone after forward, and backward runs every layer
    a second time; without it they stay alive until backward and each layer runs once."""
    import weakref

    from rlcore.models.transformer import Block

    model = load_model(hf_checkpoint("qwen2")[0])
    model.gradient_checkpointing = on
    calls, forward = [], Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, *a: calls.append(self) or forward(self, *a))
    kept = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, out: kept.append(weakref.ref(out)))
    prompts, completions = batch()
    ids, attn, cids, cmask, Lp = pack(prompts[:2] + prompts[3:4], completions[:3], pad_id=0)
    logp, _ = completion_logprobs(model, ids, attn, Lp, cids)
    assert (kept[0]() is None) == on
    assert len(calls) == len(model.model.layers)
    logp.sum().backward()
    assert len(calls) == len(model.model.layers) * (2 if on else 1)
    with torch.no_grad():  # no autograd, nothing to recompute: no checkpointing
        calls.clear()
        completion_logprobs(model, ids, attn, Lp, cids)
        assert len(calls) == len(model.model.layers)
