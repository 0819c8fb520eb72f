"""The rollout engine against independent references: transformers' greedy `generate`, a full
training-style forward pass without a cache, and the stopping rules stated in its docstring."""

import contextlib
import copy
import json

import pytest
import torch

from conftest import make_hf_model
import rlcore.rollout.engine as engine
from rlcore.models.transformer import KVCache, ModelConfig, Transformer, padded_causal_mask, rope_inv_freq
from rlcore.rollout import Rollout, generate
from rlcore.rollout.engine import forward_one_token, matmul_weights_in, prefill
from rlcore.rollout.packed import PackedDecoder

PAD = 0


def rlcore_model(hf) -> Transformer:
    model = Transformer(ModelConfig.from_hf(json.loads(hf.config.to_json_string())))
    missing, _ = model.load_state_dict(hf.state_dict(), strict=False)
    assert not missing
    return model.eval()


def random_prompts(lengths, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def training_logprobs(model, out: Rollout, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at each completion token, from one full forward pass of
    prompt + completion per row (right-padded, no cache): what the trainer computes. [N, T]"""
    rows = [p + c[:n] for p, c, n in zip(out.prompt_ids, out.completion_ids.tolist(), out.lengths.tolist())]
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    real = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    mask, positions = padded_causal_mask(real)
    with torch.no_grad():
        logp = model.logits(model(ids, positions, mask)).div(temperature).log_softmax(-1)
    result = torch.zeros(out.completion_ids.shape)
    for i, (p, n) in enumerate(zip(out.prompt_ids, out.lengths.tolist())):
        steps = torch.arange(n)
        result[i, :n] = logp[i, len(p) - 1 + steps, out.completion_ids[i, :n]]
    return result


def module_step(model, tokens, positions, cache, mask, slot) -> torch.Tensor:
    """The model's own forward for one token per row `[B]` written at cache slot `slot` (an int)
    of a cache covering slots 0..slot, under `mask` `[B, 1, 1, slot + 1]`: fp32 logits `[B, V]`."""
    slots = torch.full((len(tokens), 1), slot, dtype=torch.long)
    return model.logits(model(tokens[:, None], positions[:, None], mask, cache, slots)[:, -1]).float()


@pytest.fixture(params=["packed", "static"])
def decoder(request, monkeypatch):
    """Run `generate` with each decoding step: PackedDecoder (CPU default) and the static step
    (`decode_one_token`, the GPU path)."""
    monkeypatch.setattr(engine, "use_packed_decoder", lambda device: request.param == "packed")
    return request.param


@pytest.mark.parametrize("family", ["qwen2", "llama_tied", "qwen3"])
def test_greedy_matches_transformers_generate(family, decoder):
    hf = make_hf_model(family)
    model = rlcore_model(hf)
    prompts = random_prompts([5, 2, 9, 4])
    # EOS = a token row 0 emits that some other row never emits: rows end both ways.
    free = generate(model, prompts, 1, 24, eos_token_ids=[], pad_token_id=PAD, temperature=0.0)
    rows = [set(r) for r in free.completion_ids.tolist()]
    eos = [next(t for t in free.completion_ids[0].tolist()[3:] if not all(t in r for r in rows))]
    out = generate(model, prompts, 1, 24, eos_token_ids=eos, pad_token_id=PAD, temperature=0.0)

    T = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (T - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    ref = hf.generate(ids, attention_mask=attn, do_sample=False, max_new_tokens=24,
                      eos_token_id=eos, pad_token_id=PAD)[:, T:]
    assert torch.equal(out.completion_ids, ref)
    assert out.truncated.any() and not out.truncated.all()  # both ways of ending are covered


def test_greedy_samples_of_a_prompt_are_identical_and_prompt_major():
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([3, 7])
    out = generate(model, prompts, 3, 10, eos_token_ids=[1], pad_token_id=PAD, temperature=0.0)
    assert out.prompt_ids == [prompts[0]] * 3 + [prompts[1]] * 3
    single = generate(model, prompts, 1, 10, eos_token_ids=[1], pad_token_id=PAD, temperature=0.0)
    assert torch.equal(out.completion_ids, single.completion_ids.repeat_interleave(3, 0))


@pytest.mark.parametrize("family", ["qwen2", "qwen3_tied"])
def test_rollout_logprobs_equal_training_forward_logprobs(family, decoder):
    """Train/rollout parity: cached, batched, compacted decoding gives the trainer's numbers."""
    model = rlcore_model(make_hf_model(family))
    prompts = random_prompts([6, 3, 11, 6], seed=1)
    eos = list(range(1, 9))  # ~6% of the vocabulary: rows end at many lengths, the batch compacts
    out = generate(model, prompts, 4, 40, eos_token_ids=eos, pad_token_id=PAD, temperature=0.8,
                   generator=torch.Generator().manual_seed(0))
    assert len(set(out.lengths.tolist())) > 4 and out.lengths.max() > 16
    ref = training_logprobs(model, out, 0.8)
    torch.testing.assert_close(out.sampling_logprobs, ref, rtol=0, atol=1e-5)
    assert out.full_logprobs is None
    assert (out.sampling_logprobs[out.completion_mask == 0] == 0).all()


@pytest.mark.parametrize("filters", [dict(top_k=10), dict(top_p=0.7), dict(min_p=0.05),
                                     dict(top_k=20, top_p=0.9, min_p=0.02)])
def test_full_logprobs_under_filters_equal_training_forward_logprobs(filters):
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([4, 8], seed=2)
    out = generate(model, prompts, 4, 20, eos_token_ids=[1], pad_token_id=PAD, temperature=1.3,
                   generator=torch.Generator().manual_seed(1), **filters)
    ref = training_logprobs(model, out, 1.3)
    torch.testing.assert_close(out.full_logprobs, ref, rtol=0, atol=1e-5)
    # The filtered distribution renormalises the kept mass, so each kept token gains probability.
    m = out.completion_mask.bool()
    assert (out.sampling_logprobs[m] >= out.full_logprobs[m] - 1e-6).all()
    assert (out.full_logprobs[~m] == 0).all()


@pytest.mark.parametrize("penalty", [1.5, 0.6])
@pytest.mark.parametrize("family", ["qwen2", "llama_tied"])
def test_greedy_with_repetition_penalty_matches_transformers_generate(family, penalty, decoder):
    hf = make_hf_model(family)
    model = rlcore_model(hf)
    prompts = random_prompts([5, 2, 9, 4], seed=5)
    out = generate(model, prompts, 1, 24, eos_token_ids=[], pad_token_id=PAD, temperature=0.0,
                   repetition_penalty=penalty)
    T = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (T - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    ref = hf.generate(ids, attention_mask=attn, do_sample=False, max_new_tokens=24, eos_token_id=None,
                      pad_token_id=PAD, repetition_penalty=penalty)[:, T:]
    assert torch.equal(out.completion_ids, ref)
    plain = generate(model, prompts, 1, 24, eos_token_ids=[], pad_token_id=PAD, temperature=0.0)
    assert not torch.equal(plain.completion_ids, ref)  # the penalty changed the completions
    # The greedy log-probs: penalised (what was decoded from) and, as full_logprobs, the model's own.
    torch.testing.assert_close(out.full_logprobs, training_logprobs(model, out, 1.0), rtol=0, atol=1e-5)
    assert not torch.allclose(out.sampling_logprobs, out.full_logprobs, atol=1e-3)


@pytest.mark.parametrize("top_k", [0, 20])
def test_sampling_with_repetition_penalty_reports_both_logprobs_against_transformers(top_k, decoder):
    """sampling_logprobs: transformers' RepetitionPenaltyLogitsProcessor applied to a full forward's
    logits at each step (its prompt and completion so far), then temperature (and top-k);
    full_logprobs: the trainer's, without the penalty. Rows end at many lengths: the batch compacts."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper

    hf = make_hf_model("qwen2")
    model = rlcore_model(hf)
    prompts = random_prompts([6, 3, 11, 6], seed=1)
    eos = list(range(1, 9))
    out = generate(model, prompts, 4, 40, eos_token_ids=eos, pad_token_id=PAD, temperature=0.8, top_k=top_k,
                   repetition_penalty=1.3, generator=torch.Generator().manual_seed(0))
    assert len(set(out.lengths.tolist())) > 4 and out.lengths.max() > 16
    torch.testing.assert_close(out.full_logprobs, training_logprobs(model, out, 0.8), rtol=0, atol=1e-5)
    penalty = RepetitionPenaltyLogitsProcessor(1.3)
    ref = torch.zeros(out.completion_ids.shape)
    for i, (p, n) in enumerate(zip(out.prompt_ids, out.lengths.tolist())):
        ids = torch.tensor([p + out.completion_ids[i, :n].tolist()])
        with torch.no_grad():
            logits = hf(ids).logits[0].float()
        for t in range(n):
            scores = penalty(ids[:, :len(p) + t], logits[None, len(p) - 1 + t].clone()) / 0.8
            if top_k:
                scores = TopKLogitsWarper(top_k)(ids, scores)
            ref[i, t] = scores.log_softmax(-1)[0, ids[0, len(p) + t]]
    torch.testing.assert_close(out.sampling_logprobs, ref, rtol=0, atol=1e-5)
    m = out.completion_mask.bool()
    assert (out.sampling_logprobs[m] - out.full_logprobs[m]).abs().max() > 0.05


@pytest.mark.parametrize("decoder", ["module", "packed", "static"])
def test_cached_decoding_equals_full_recomputation(decoder):
    model = rlcore_model(make_hf_model("llama"))
    packed = PackedDecoder(model, 2)
    prompts = random_prompts([7, 3], seed=3)
    steps = random_prompts([6, 6], seed=4)  # the tokens fed after each prompt
    T = 7
    with torch.no_grad():
        prompt_cache, logits = prefill(model, prompts)
        cache = KVCache.empty(model.config, 2, T + 6, torch.float32)
        cache.k[:, :, :, :T], cache.v[:, :, :, :T] = prompt_cache.k, prompt_cache.v
        valid = torch.tensor([[True] * (T + 6), [False] * 4 + [True] * (T + 2)])[:, None, None]
        positions = torch.tensor([7, 3])
        cached = [logits]
        for t in range(6):
            S = T + t + 1
            view = KVCache(cache.k[:, :, :, :S], cache.v[:, :, :, :S])
            tokens = torch.tensor([steps[0][t], steps[1][t]])
            if decoder == "packed":
                cached.append(packed(tokens, positions + t, view, valid[..., :S], T + t))
            elif decoder == "static":  # the whole buffer, each row from its first real slot
                h = forward_one_token(model, tokens, positions + t, cache, torch.tensor(T + t), torch.tensor([0, 4]))
                cached.append(model.logits(h))
            else:
                cached.append(module_step(model, tokens, positions + t, view, valid[..., :S], T + t))
        for i in range(2):
            full = model.logits(model(torch.tensor([prompts[i] + steps[i]])))[0]
            recomputed = full[len(prompts[i]) - 1:]
            torch.testing.assert_close(torch.stack([c[i] for c in cached]), recomputed,
                                       rtol=0, atol=1e-5)


@pytest.mark.parametrize("family,overrides", [
    ("qwen2", {}), ("qwen3_tied", {}), ("llama3_rope", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
])
def test_packed_decoder_matches_module_decoding_step(family, overrides):
    """The packed step against the model's own forward, on the batch it was packed for, on a
    smaller one (MKL's fallback after finished rows are dropped), and without a mask when no
    row is padded; in fp32 (MKL-packed where available) and in bf16 (transposed weights)."""
    model = rlcore_model(make_hf_model(family, **overrides))
    cfg = model.config
    B, S = 6, 9
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 128, (B,), generator=g)
    positions = torch.tensor([8, 8, 5, 8, 3, 8])
    valid = torch.ones(B, 1, 1, S, dtype=torch.bool)
    valid[2, ..., :3] = valid[4, ..., :5] = False  # rows 2 and 4 have left padding
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        m = model.to(dtype)
        m.inv_freq = rope_inv_freq(cfg)  # fp32 RoPE frequencies, as load_model keeps them in bf16
        cache = KVCache.empty(cfg, B, S, dtype)
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
        packed = PackedDecoder(m, B)
        for rows in (torch.arange(B), torch.tensor([0, 2, 3, 4])):
            ref_cache = KVCache(cache.k[:, rows].clone(), cache.v[:, rows].clone())
            with torch.no_grad():
                ref = module_step(m, tokens[rows], positions[rows], ref_cache, valid[rows], S - 1)
            got_cache = KVCache(cache.k[:, rows].clone(), cache.v[:, rows].clone())
            got = packed(tokens[rows], positions[rows], got_cache, valid[rows], S - 1)
            torch.testing.assert_close(got, ref, rtol=0, atol=atol * ref.abs().max().item())
            torch.testing.assert_close(got_cache.k, ref_cache.k, rtol=0, atol=atol)
            torch.testing.assert_close(got_cache.v, ref_cache.v, rtol=0, atol=atol)
        unpadded = torch.tensor([0, 1, 3, 5])  # no padding: mask None must equal an all-True mask
        c1 = KVCache(cache.k[:, unpadded].clone(), cache.v[:, unpadded].clone())
        c2 = KVCache(cache.k[:, unpadded].clone(), cache.v[:, unpadded].clone())
        torch.testing.assert_close(packed(tokens[unpadded], positions[unpadded], c1, None, S - 1),
                                   packed(tokens[unpadded], positions[unpadded], c2, valid[unpadded], S - 1),
                                   rtol=0, atol=atol)
    model.float()


def test_bf16_rollout_of_an_fp32_model(decoder):
    """dtype=bf16 (the rollout of `train.bf16`): log-probs within bf16 rounding of the fp32
    training forward's, and not equal to them (bf16 did run)."""
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([6, 3, 11, 6], seed=1)
    out = generate(model, prompts, 4, 40, eos_token_ids=list(range(1, 9)), pad_token_id=PAD,
                   temperature=0.8, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    m = out.completion_mask.bool()
    diff = (out.sampling_logprobs - training_logprobs(model, out, 0.8))[m].abs()
    assert 1e-5 < diff.max().item() < 1e-2


def spied_bf16_rollout(model, monkeypatch):
    """A seeded bf16 rollout of `model` on its device, and the list each call's prefill appends the
    dtypes of layer 0's q_proj weight and bias and of the lm_head weight to."""
    seen, real_prefill = [], engine.prefill

    def spying_prefill(*args):
        q_proj = model.model.layers[0].self_attn.q_proj  # the module in place during the rollout
        seen.append((q_proj.weight.dtype, q_proj.bias.dtype, model.lm_head_weight.dtype))
        return real_prefill(*args)

    monkeypatch.setattr(engine, "prefill", spying_prefill)
    prompts, device = random_prompts([6, 3, 11, 6], seed=1), model.inv_freq.device

    def rollout():
        return generate(model, prompts, 4, 40, eos_token_ids=list(range(1, 9)), pad_token_id=PAD, temperature=0.8,
                        generator=torch.Generator(device).manual_seed(0), dtype=torch.bfloat16)

    return rollout, seen


def assert_same_rollout(a: Rollout, b: Rollout) -> None:
    for field in ("completion_ids", "completion_mask", "sampling_logprobs"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_a_bf16_rollout_on_the_module_path_casts_the_layer_weights_once_with_autocasts_results(monkeypatch):
    """Off CPU (the module decoding step), dtype=bf16 puts linears holding bf16 copies of the layers'
    weights and biases in their modules' places for the rollout instead of letting autocast cast them
    at every call: the same completions and log-probs, bit for bit; the model's own modules and fp32
    parameters are back afterwards, and after a rollout that fails."""
    monkeypatch.setattr(engine, "use_packed_decoder", lambda device: False)
    model = rlcore_model(make_hf_model("qwen2"))  # qkv biases: cast too
    q_proj = model.model.layers[0].self_attn.q_proj
    own = {name: (p, p.data_ptr(), p.dtype) for name, p in model.named_parameters()}

    def unchanged():  # the same Parameter objects (the optimizer's, with any hooks), data and dtype
        return all(p is own[name][0] and (p.data_ptr(), p.dtype) == own[name][1:]
                   for name, p in model.named_parameters())

    fired = []  # a hook on q_proj.weight's gradient accumulator (held, as DDP holds its) survives rollouts
    accumulator = q_proj.weight.view_as(q_proj.weight).grad_fn.next_functions[0][0]
    accumulator.register_hook(lambda *grads: fired.append(1))
    rollout, seen = spied_bf16_rollout(model, monkeypatch)
    cast_once = rollout()
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.float32)]  # embeddings and norms keep fp32
    assert unchanged()
    monkeypatch.setattr(engine, "matmul_weights_in", lambda model, dtype: contextlib.nullcontext())
    autocast_each_call = rollout()
    assert seen[1] == (torch.float32, torch.float32, torch.float32)
    assert_same_rollout(cast_once, autocast_each_call)

    monkeypatch.setattr(engine, "matmul_weights_in", matmul_weights_in)
    monkeypatch.setattr(engine, "sample", lambda *a: (_ for _ in ()).throw(RuntimeError("stopped mid-rollout")))
    with pytest.raises(RuntimeError, match="stopped mid-rollout"):
        rollout()
    assert seen[2][0] == torch.bfloat16
    assert unchanged()
    (q_proj.weight * 2).sum().backward()
    assert fired == [1]


def test_packed_decoder_casts_fp32_weights_as_converting_the_model_does():
    """PackedDecoder(dtype=bf16) of an fp32 model gives the step of the model converted to bf16."""
    model = rlcore_model(make_hf_model("qwen2"))
    B = 3
    tokens, positions = torch.tensor([5, 7, 9]), torch.tensor([2, 2, 2])
    caches = [KVCache.empty(model.config, B, 3, torch.bfloat16) for _ in range(2)]
    for c in caches:
        c.k.normal_(generator=torch.Generator().manual_seed(1))
        c.v.normal_(generator=torch.Generator().manual_seed(2))
    cast = PackedDecoder(model, B, torch.bfloat16)(tokens, positions, caches[0], None, 2)
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    bf16_model.inv_freq = model.inv_freq  # fp32, as load_model(dtype=bf16) keeps it
    converted = PackedDecoder(bf16_model, B)(tokens, positions, caches[1], None, 2)
    assert torch.equal(cast, converted) and torch.equal(caches[0].k, caches[1].k)


def test_stops_at_eos_and_keeps_it_in_the_mask():
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([5])
    free = generate(model, prompts, 1, 12, eos_token_ids=[], pad_token_id=PAD, temperature=0.0)
    first = free.completion_ids[0].tolist()
    k = 4
    eos = first[k]
    k = first.index(eos)  # the first occurrence is where it must stop
    out = generate(model, prompts, 1, 12, eos_token_ids=[eos], pad_token_id=PAD, temperature=0.0)
    assert out.completion_ids[0].tolist() == first[:k + 1]
    assert out.lengths.tolist() == [k + 1] and out.completion_mask.sum() == k + 1
    assert out.truncated.tolist() == [False]


def test_progress_hears_the_tokens_and_finished_rows_at_each_check(monkeypatch):
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([3, 5, 7, 9, 4, 6, 8, 2], seed=5)

    def run():
        heard = []
        out = generate(model, prompts, 1, 40, eos_token_ids=list(range(1, 9)), pad_token_id=PAD, temperature=0.0,
                       progress=lambda *a: heard.append(a))
        return heard, out.lengths.tolist()

    heard, lengths = run()  # rows stop at different lengths, so the batch is compacted on the way
    assert engine.CHECK_EVERY == 8 and max(lengths) > 32  # checks after 8, 16, 24, 32 tokens (40 ends the loop)
    assert heard == [(t, sum(n <= t for n in lengths)) for t in (8, 16, 24, 32)]  # the rows stopped by then
    assert len({f for _, f in heard}) > 2
    monkeypatch.setattr(engine, "COMPACT_FRACTION", 0)  # every row kept to the end: the same counts
    assert run() == (heard, lengths)


def test_stop_sequence_ends_the_row_after_the_whole_sequence():
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([5, 8])
    free = generate(model, prompts, 1, 12, eos_token_ids=[], pad_token_id=PAD, temperature=0.0)
    row0 = free.completion_ids[0].tolist()
    stop = row0[5:7]
    out = generate(model, prompts, 1, 12, eos_token_ids=[], pad_token_id=PAD, temperature=0.0,
                   stop_sequences=[stop, [127, 127, 127]])
    end = next(i for i in range(1, 12) if row0[i - 1:i + 1] == stop) + 1
    assert out.completion_ids[0, :end].tolist() == row0[:end]
    assert out.lengths[0] == end and not out.truncated[0]
    assert (out.completion_ids[0, end:] == PAD).all() and out.completion_mask[0, end:].sum() == 0


def test_max_new_tokens_marks_rows_truncated():
    model = rlcore_model(make_hf_model("qwen2"))
    out = generate(model, random_prompts([4, 6]), 2, 9, eos_token_ids=[], pad_token_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    assert out.completion_ids.shape == (4, 9)
    assert out.lengths.tolist() == [9] * 4 and out.truncated.all() and out.completion_mask.all()


def test_truncated_is_per_row_no_eos_within_max_new_tokens():
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([3, 5, 7, 9, 4, 6, 8, 2], seed=5)
    out = generate(model, prompts, 1, 12, eos_token_ids=list(range(1, 9)), pad_token_id=PAD, temperature=0.0)
    ended = [any(t in range(1, 9) for t in row[:n]) for row, n in zip(out.completion_ids.tolist(), out.lengths.tolist())]
    assert 0 < sum(ended) < len(ended)  # some rows stop at EOS, some run to the limit
    assert out.truncated.tolist() == [not e for e in ended]
    assert all(n == 12 for n, e in zip(out.lengths.tolist(), ended) if not e)


def test_a_row_ending_with_eos_on_the_last_allowed_token_is_not_truncated():
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([5])
    free = generate(model, prompts, 1, 6, eos_token_ids=[], pad_token_id=PAD, temperature=0.0)
    last = free.completion_ids[0, -1].item()
    if last in free.completion_ids[0, :-1].tolist():
        pytest.skip("the last greedy token also appears earlier; pick another seed")
    out = generate(model, prompts, 1, 6, eos_token_ids=[last], pad_token_id=PAD, temperature=0.0)
    assert out.lengths.tolist() == [6] and out.truncated.tolist() == [False]


def test_same_seed_same_completions_other_seed_different():
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([4, 6])

    def run(seed):
        return generate(model, prompts, 4, 16, eos_token_ids=[1], pad_token_id=PAD, top_p=0.9,
                        generator=torch.Generator().manual_seed(seed))

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.sampling_logprobs, b.sampling_logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_a_sampled_rollout_draws_one_key_from_its_generator_and_a_greedy_one_nothing():
    """What a saved generator state needs to resume the rollouts exactly, and why a greedy
    evaluation between rollouts (generator=None) leaves torch's global RNG as it found it."""
    model = rlcore_model(make_hf_model("qwen2"))
    g = torch.Generator().manual_seed(0)
    before, global_before = g.get_state(), torch.get_rng_state()
    generate(model, random_prompts([4, 6]), 2, 8, eos_token_ids=[1], pad_token_id=PAD, temperature=0.0, generator=g)
    generate(model, random_prompts([4, 6]), 2, 8, eos_token_ids=[1], pad_token_id=PAD, temperature=0.0)
    assert torch.equal(g.get_state(), before) and torch.equal(torch.get_rng_state(), global_before)
    generate(model, random_prompts([4, 6]), 2, 8, eos_token_ids=[1], pad_token_id=PAD, generator=g)
    one_key = torch.Generator().set_state(before)
    torch.randint(2**31 - 1, (2,), generator=one_key)  # what sampling_key draws
    assert not torch.equal(g.get_state(), before) and torch.equal(g.get_state(), one_key.get_state())


def test_rows_of_one_prompt_sample_independently():
    model = rlcore_model(make_hf_model("qwen2"))
    out = generate(model, random_prompts([4]), 8, 16, eos_token_ids=[], pad_token_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    assert len({tuple(r) for r in out.completion_ids.tolist()}) == 8


def test_bad_arguments_are_errors_naming_the_value():
    model = rlcore_model(make_hf_model("qwen2"))
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[3]], 2, 4, eos_token_ids=[1], pad_token_id=PAD, top_p=0.0)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[3], []], 2, 4, eos_token_ids=[1], pad_token_id=PAD)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[3]], 2, 0, eos_token_ids=[1], pad_token_id=PAD)


def test_compacting_finished_rows_changes_no_result(monkeypatch):
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([3, 5, 7, 9, 4, 6, 8, 2], seed=5)
    eos = list(range(1, 9))

    def run():
        return generate(model, prompts, 1, 40, eos_token_ids=eos, pad_token_id=PAD, temperature=0.0)

    allocations, repacked = [], []
    empty, repack = KVCache.empty, PackedDecoder.repack
    monkeypatch.setattr(engine.KVCache, "empty", lambda *a, **k: allocations.append(1) or empty(*a, **k))
    monkeypatch.setattr(PackedDecoder, "repack", lambda self, b: repacked.append(b) or repack(self, b))
    compacted = run()
    assert len(allocations) > 2  # prefill cache, decode cache, at least one compaction
    # the CPU decoder is laid out again for each smaller batch
    assert repacked[0] == 8 and len(repacked) == len(allocations) - 1 and repacked == sorted(repacked, reverse=True)
    allocations.clear()
    monkeypatch.setattr(engine, "COMPACT_FRACTION", 0)  # n_done * 0 >= rows never holds: no compaction
    plain = run()
    assert len(allocations) == 2  # prefill cache and decode cache only
    assert torch.equal(compacted.completion_ids, plain.completion_ids)
    torch.testing.assert_close(compacted.sampling_logprobs, plain.sampling_logprobs, rtol=0, atol=1e-6)


def test_a_repeated_prompt_is_prefilled_once_and_gets_its_own_rows(monkeypatch):
    model = rlcore_model(make_hf_model("qwen2"))
    a, b = random_prompts([4, 6], seed=6)
    prefilled = []  # the prompt lists engine.prefill receives
    monkeypatch.setattr(engine, "prefill", lambda m, ps, *r: prefilled.append(ps) or prefill(m, ps, *r))
    out = generate(model, [a, b, a], 2, 8, eos_token_ids=[1], pad_token_id=PAD, temperature=0.0)
    assert prefilled == [[a, b]]
    assert out.prompt_ids == [a, a, b, b, a, a]
    single = generate(model, [a, b], 2, 8, eos_token_ids=[1], pad_token_id=PAD, temperature=0.0)
    assert torch.equal(out.completion_ids[:4], single.completion_ids)
    assert torch.equal(out.completion_ids[4:], single.completion_ids[:2])


def test_non_finite_logits_are_an_error_not_a_token():
    """NaN weights give NaN logits, from which inverse-CDF sampling would return id V."""
    model = rlcore_model(make_hf_model("qwen2"))
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.raises(FloatingPointError, match="logits are not finite"):
        generate(model, random_prompts([4, 6], seed=0), 2, 3, eos_token_ids=[1], pad_token_id=PAD)


def test_a_dtype_wider_than_the_model_is_an_error_naming_both():
    model = rlcore_model(make_hf_model("qwen2")).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"dtype torch\.float32 is wider than the model's torch\.bfloat16"):
        generate(model, [[3, 4]], 2, 2, eos_token_ids=[1], pad_token_id=PAD, dtype=torch.float32)


def test_decoding_on_cuda_leaves_cudnn_attention_out():
    """cuDNN's attention plans every new key length on the CPU (~1.8 ms a call on an H200), and
    decoding lengthens the keys every step: CUDA decoding steps may use the other kernels only."""
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with engine.decoding_attention(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with engine.decoding_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_matmul_weights_in_swaps_lora_layers_for_their_merged_weights_and_back():
    """Inside the block a decoding step meets no adapter path: each LoRA layer is a plain linear
    holding W + s*B@A in the rollout's dtype; after it, the model's own modules are back."""
    from rlcore.models.lora import LoraLinear, apply_lora, lora_layers
    model = rlcore_model(make_hf_model("qwen2"))
    apply_lora(model, r=4, alpha=8)
    for layer in lora_layers(model).values():
        torch.nn.init.normal_(layer.lora_B)
    before = dict(lora_layers(model))
    merged = {n: (m.base.weight + m.scaling * m.lora_B @ m.lora_A).detach() for n, m in before.items()}
    with matmul_weights_in(model, torch.bfloat16):
        assert not any(isinstance(m, LoraLinear) for m in model.modules())
        for name, weight in merged.items():
            swapped = model.get_submodule(name)
            assert swapped.weight.dtype == torch.bfloat16
            torch.testing.assert_close(swapped.weight, weight.to(torch.bfloat16), rtol=0, atol=0)
    assert lora_layers(model) == before


# ----------------------------------------------------------------------------- the static step

SAMPLINGS = [dict(temperature=0.8), dict(temperature=1.3, top_k=20, top_p=0.9, repetition_penalty=1.3),
             dict(temperature=0.0, stop_sequences=[[5, 6], [7]])]


def use_static_step(monkeypatch) -> list[int]:
    """Make `generate` decode with the static step on CPU; returns the list of the batch sizes it
    decodes at (its first batch's, then one per compaction)."""
    sizes, compact = [], engine.compact
    monkeypatch.setattr(engine, "use_packed_decoder", lambda device: False)
    monkeypatch.setattr(engine, "compact", lambda batch, size, *a, **k: sizes.append(size) or compact(batch, size, *a, **k))
    return sizes


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "filters-penalty", "greedy-stops"])
def test_the_static_step_gives_the_packed_engines_tokens_and_logprobs(sampling, monkeypatch):
    """Same seed, fp32: the static step (whole-buffer attention, finished rows masked, batch dropped to
    power-of-two buckets) samples exactly the tokens of today's CPU engine (PackedDecoder over the
    filled slots, finished rows dropped exactly); the log-probs differ only by the rounding of other
    matmul layouts."""
    model = rlcore_model(make_hf_model("qwen2"))
    prompts = random_prompts([6, 3, 11, 6], seed=1)

    def run():
        return generate(model, prompts, 4, 40, eos_token_ids=list(range(1, 9)), pad_token_id=PAD,
                        generator=torch.Generator().manual_seed(0), **sampling)

    packed = run()
    sizes = use_static_step(monkeypatch)
    static = run()
    assert sizes and sizes[0] < 16 and all(s & (s - 1) == 0 for s in sizes)  # padded to buckets on the way
    assert len(set(static.lengths.tolist())) > 3
    assert torch.equal(static.completion_ids, packed.completion_ids)
    assert torch.equal(static.completion_mask, packed.completion_mask)
    assert torch.equal(static.truncated, packed.truncated)
    torch.testing.assert_close(static.sampling_logprobs, packed.sampling_logprobs, rtol=0, atol=1e-6)
    if packed.full_logprobs is not None:
        torch.testing.assert_close(static.full_logprobs, packed.full_logprobs, rtol=0, atol=1e-6)


def test_masking_dropping_or_padding_finished_rows_changes_no_token(monkeypatch):
    """The static step with the batch compacted to buckets (padding rows included) against the same
    step keeping every row to the end: identical tokens (a row's sampling noise does not depend on
    the other rows) and log-probs but for the rounding of matmuls over another row count."""
    model = rlcore_model(make_hf_model("qwen3"))
    prompts = random_prompts([3, 5, 7, 9, 4, 6, 8, 2], seed=5)
    sizes = use_static_step(monkeypatch)

    def run():
        return generate(model, prompts, 2, 40, eos_token_ids=list(range(1, 9)), pad_token_id=PAD, temperature=1.0,
                        top_p=0.95, generator=torch.Generator().manual_seed(2))

    compacted = run()
    assert len(sizes) >= 2 and sizes == sorted(sizes, reverse=True) and sizes[-1] < 16
    sizes.clear()
    monkeypatch.setattr(engine, "COMPACT_FRACTION", 0)
    kept = run()
    assert sizes == []
    for field in ("completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(compacted, field), getattr(kept, field)), field
    for field in ("sampling_logprobs", "full_logprobs"):
        torch.testing.assert_close(getattr(compacted, field), getattr(kept, field), rtol=0, atol=1e-6)


def test_the_static_step_compiles_in_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) of `decode_one_token` (which raises at any graph break), with
    every sampling option and a stop sequence, through a compaction (a new batch shape); the compiled
    step gives the eager step's rollout bit for bit. aot_eager traces what Inductor would compile
    (Dynamo's graph and its functionalised mutations) without generating code: seconds, not minutes."""
    model = rlcore_model(make_hf_model("qwen3"))
    prompts = random_prompts([6, 3, 5], seed=1)
    sizes = use_static_step(monkeypatch)

    def run():
        return generate(model, prompts, 2, 24, eos_token_ids=list(range(1, 9)), pad_token_id=PAD, temperature=0.8,
                        top_k=20, min_p=0.01, repetition_penalty=1.2, stop_sequences=[[5, 6]],
                        generator=torch.Generator().manual_seed(0))

    eager = run()
    assert sizes  # the batch shrank: the compiled step met a second shape
    compiled_steps = []
    compiled = torch.compile(engine.decode_one_token, fullgraph=True, backend="aot_eager")
    monkeypatch.setattr(engine, "decode_one_token", lambda *a: compiled_steps.append(1) or compiled(*a))
    torch._dynamo.reset()
    got = run()
    assert len(compiled_steps) == 23
    for field in ("completion_ids", "completion_mask", "sampling_logprobs", "full_logprobs"):
        assert torch.equal(getattr(got, field), getattr(eager, field)), field


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (14, 2), (8, 1)])
def test_decode_attention_twin_equals_the_fp64_definition(heads, kv_heads):
    """softmax(q k^T / sqrt(D)) v over each row's own slots start..end-1 of the whole buffer, query
    head h on kv head h // (heads / kv_heads), in fp64 by hand; rows of many lengths, one of a slot."""
    from rlcore.rollout.attention import decode_attention_twin

    g = torch.Generator().manual_seed(0)
    B, S, D = 5, 37, 16
    q = torch.randn(B, heads, 1, D, generator=g)
    k, v = torch.randn(B, kv_heads, S, D, generator=g), torch.randn(B, kv_heads, S, D, generator=g)
    start, end = torch.tensor([0, 3, 10, 36, 0]), torch.tensor([37, 20, 11, 37, 1])
    got = decode_attention_twin(q, k, v, start, end)
    for b in range(B):
        for h in range(heads):
            keys = slice(int(start[b]), int(end[b]))
            kv = h // (heads // kv_heads)
            scores = k[b, kv, keys].double() @ q[b, h, 0].double() / D ** 0.5
            want = scores.softmax(0) @ v[b, kv, keys].double()
            torch.testing.assert_close(got[b, h, 0].double(), want, rtol=0, atol=1e-6)
