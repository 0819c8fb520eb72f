"""token_logprobs (chunked, custom autograd) against the naive fp64 log_softmax reference."""

import pytest
import torch

from rlcore.losses import logprobs
from rlcore.losses.logprobs import token_logprobs

B, T, H, V = 3, 5, 16, 37  # N = 15 rows: chunk sizes 1, 4, 7 leave a ragged last chunk


def make_inputs(dtype=torch.float64, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5
    b = torch.randn(V, generator=gen, dtype=torch.float64) if bias else None
    targets = torch.randint(V, (B, T), generator=gen)
    leaves = [x.to(dtype).requires_grad_() for x in (hidden, weight) + ((b,) if bias else ())]
    return leaves, targets


def naive_fp64(hidden, weight, targets, temperature=1.0, bias=None):
    """The definition: full [B, T, V] log-softmax in fp64, gathered at the targets."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    logp = logprobs.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logp, entropy


def grads(outputs, inputs, upstream):
    return torch.autograd.grad(outputs, inputs, upstream, retain_graph=True)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 15, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_logp_entropy_and_grads_match_naive_fp64(chunk_size, temperature, bias, recompute):
    (hidden, weight, *b), targets = make_inputs(bias=bias)
    b = b[0] if bias else None
    logp, entropy = token_logprobs(hidden, weight, targets, temperature, chunk_size, bias=b,
                                   recompute=recompute)
    ref_logp, ref_entropy = naive_fp64(hidden, weight, targets, temperature, b)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-12, atol=1e-12)

    upstream = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    up_entropy = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    inputs = [hidden, weight] + ([b] if bias else [])
    for got, want in zip(grads(logp, inputs, upstream), grads(ref_logp, inputs, upstream)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the entropy's gradient, alone and together with logp's (loss.entropy_coef's bonus)
    for got, want in zip(grads(entropy, inputs, up_entropy), grads(ref_entropy, inputs, up_entropy)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    both, ref_both = (logp * upstream + entropy * up_entropy).sum(), (ref_logp * upstream + ref_entropy * up_entropy).sum()
    for got, want in zip(grads(both, inputs, None), grads(ref_both, inputs, None)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recompute", [True, False])
def test_gradcheck_fp64(recompute):
    (hidden, weight, bias), targets = make_inputs(bias=True)
    fn = lambda h, w, b: token_logprobs(h, w, targets, temperature=0.8, chunk_size=4, bias=b,
                                        recompute=recompute)
    assert torch.autograd.gradcheck(lambda h, w, b: fn(h, w, b)[0], (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda h, w, b: fn(h, w, b)[1], (hidden, weight, bias))
    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))  # both outputs


@pytest.mark.parametrize("recompute", [True, False])
def test_fp32_matches_fp64_reference(recompute):
    (hidden, weight), targets = make_inputs(dtype=torch.float32)
    logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=4, recompute=recompute)
    ref_logp, ref_entropy = naive_fp64(hidden, weight, targets)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recompute", [True, False])
def test_entropy_and_its_gradient_stay_finite_where_the_fp32_softmax_underflows(recompute):
    """docs/losses.md: the entropy's backward uses xlogy(q, q), so a q that underflowed to 0 adds 0
    (q * log q would be 0 * -inf = NaN). fp32 logits with gaps of ~300 (exp(-300) is 0 in fp32, not in
    fp64) against the naive fp64 log_softmax: entropy and both gradients finite and close."""
    logits = torch.tensor([[[0.0, 0.7, -1.2, -300.0, -600.0, 2.0, -310.0, 0.3],
                            [-300.0, -650.0, 1.0, 1.5, -320.0, -900.0, 0.2, -610.0],
                            [5.0, -295.0, -600.0, -300.0, 4.5, -305.0, -580.0, 4.0]]])
    assert (torch.softmax(logits, -1) == 0).sum() >= 12  # the fp32 softmax underflows
    hidden = logits.clone().requires_grad_()
    weight = torch.eye(8).requires_grad_()  # logits = hidden: the gradient w.r.t. hidden is the logits'
    targets = torch.tensor([[1, 3, 0]])  # row 1's target has q = 0: logp = -301.5..., still finite
    logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=2, recompute=recompute)
    hidden64, weight64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    ref_logp, ref_entropy = naive_fp64(hidden64, weight64, targets)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-4)
    up_logp, up_entropy = torch.tensor([[0.5, -1.0, 2.0]]), torch.tensor([[-0.3, 1.2, 0.8]])
    loss = (logp * up_logp + entropy * up_entropy).sum()
    ref_loss = (ref_logp * up_logp + ref_entropy * up_entropy).sum()
    for got, want in zip(grads(loss, [hidden, weight], None), grads(ref_loss, [hidden64, weight64], None)):
        assert got.isfinite().all()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)  # |h| up to 900 in grad_W
    for got, want in zip(grads(entropy.sum(), [hidden], None), grads(ref_entropy.sum(), [hidden64], None)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)  # the entropy's term alone


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("block_rows", [1024, 8], ids=["one-block", "ragged-blocks"])
def test_bf16_inputs_compute_in_fp32_and_return_bf16_grads(recompute, block_rows, monkeypatch):
    """bf16 h and W: logits are formed in fp32 from the bf16 values, so the only error left
    is fp32 rounding; grads come back in bf16 (one bf16 rounding of the fp64 grad). W is cast a
    block of rows at a time, in one block or in five (V = 37, the last ragged)."""
    monkeypatch.setattr(logprobs, "WEIGHT_BLOCK_ROWS", block_rows)
    (hidden, weight), targets = make_inputs(dtype=torch.bfloat16)
    logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=4, recompute=recompute)
    hidden64, weight64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    ref_logp, ref_entropy = naive_fp64(hidden64, weight64, targets)  # the same bf16 values
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)

    upstream = torch.ones(B, T)
    grad_h, grad_w = grads(logp, [hidden, weight], upstream)
    ref_h, ref_w = grads(ref_logp, [hidden64, weight64], upstream.double())
    assert grad_h.dtype == torch.bfloat16 and grad_w.dtype == torch.bfloat16
    torch.testing.assert_close(grad_h.double(), ref_h, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_w.double(), ref_w, rtol=1e-2, atol=1e-2)
    grad_h_entropy, = grads(entropy, [hidden], upstream)
    ref_h_entropy, = grads(ref_entropy, [hidden64], upstream.double())
    torch.testing.assert_close(grad_h_entropy.double(), ref_h_entropy, rtol=1e-2, atol=1e-2)


def saved_shapes(**kwargs):
    """Shapes of the tensors token_logprobs saves for backward, in any order."""
    (hidden, weight), targets = make_inputs()
    saved = []

    def pack(x):
        saved.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        token_logprobs(hidden, weight, targets, chunk_size=4, **kwargs)
    return sorted(saved)


INPUTS_AND_LSE = [(B * T, H), (V, H), (B * T,), (B * T,), (B * T,)]  # h, W, targets, lse, entropy


def test_recompute_saves_inputs_and_logsumexp_but_no_logits():
    assert saved_shapes(recompute=True) == sorted(INPUTS_AND_LSE)


def test_no_recompute_saves_exactly_one_n_by_v_softmax():
    assert saved_shapes(recompute=False) == sorted(INPUTS_AND_LSE + [(B * T, V)])


def test_automatic_recompute_saves_softmax_up_to_the_byte_limit(monkeypatch):
    softmax_bytes = B * T * V * 8  # fp64 inputs compute in fp64
    monkeypatch.setattr(logprobs, "SAVE_PROBS_MAX_BYTES", softmax_bytes)
    assert saved_shapes() == sorted(INPUTS_AND_LSE + [(B * T, V)])
    monkeypatch.setattr(logprobs, "SAVE_PROBS_MAX_BYTES", softmax_bytes - 1)
    assert saved_shapes() == sorted(INPUTS_AND_LSE)


def test_without_grad_the_softmax_is_not_kept_even_if_asked(monkeypatch):
    """Under no_grad there is no backward, so the [N, V] softmax would be a wasted buffer."""
    passed = []
    apply = logprobs.ChunkedTokenLogprobs.apply
    spy = lambda *args: passed.append(args[-1]) or apply(*args)  # last arg: resolved recompute
    monkeypatch.setattr(logprobs.ChunkedTokenLogprobs, "apply", spy)
    (hidden, weight), targets = make_inputs()
    token_logprobs(hidden, weight, targets, recompute=False)
    with torch.no_grad():
        token_logprobs(hidden, weight, targets, recompute=False)
    assert passed == [False, True]


@pytest.mark.parametrize("recompute", [True, False])
def test_second_backward_with_retain_graph_gives_the_same_grads(recompute):
    """Backward must not overwrite what forward saved (the softmax with recompute=False)."""
    (hidden, weight, bias), targets = make_inputs(bias=True)
    logp, _ = token_logprobs(hidden, weight, targets, 0.7, chunk_size=4, bias=bias,
                             recompute=recompute)
    upstream = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    first = torch.autograd.grad(logp, [hidden, weight, bias], upstream, retain_graph=True)
    second = torch.autograd.grad(logp, [hidden, weight, bias], upstream)
    ref_logp, _ = naive_fp64(hidden, weight, targets, 0.7, bias)
    for got, want in zip(first, grads(ref_logp, [hidden, weight, bias], upstream)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_recompute_and_saved_softmax_give_the_same_grads():
    (hidden, weight, bias), targets = make_inputs(bias=True)
    upstream = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    by_mode = []
    for recompute in (True, False):
        logp, _ = token_logprobs(hidden, weight, targets, 0.7, chunk_size=4, bias=bias,
                                 recompute=recompute)
        by_mode.append(grads(logp, [hidden, weight, bias], upstream))
    for a, b in zip(*by_mode):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("recompute", [True, False])
def test_an_unused_entropy_costs_backward_nothing(recompute, monkeypatch):
    """logp alone in the loss: backward makes no entropy term (no xlogy, one exp per recomputed
    chunk), and its gradients are the fp64 reference's."""
    (hidden, weight), targets = make_inputs()
    logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=4, recompute=recompute)
    assert entropy.requires_grad
    calls = []
    for name in ("xlogy", "exp"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    got = grads(logp.sum(), [hidden, weight], None)
    monkeypatch.undo()
    assert calls == []
    ref_logp, _ = naive_fp64(hidden, weight, targets)
    for a, b in zip(got, grads(ref_logp.sum(), [hidden, weight], None)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recompute", [True, False])
def test_frozen_weight_gets_no_grad_and_hidden_grad_is_unchanged(recompute, monkeypatch):
    (hidden, weight), targets = make_inputs()
    frozen = weight.detach()
    logp, _ = token_logprobs(hidden, frozen, targets, chunk_size=4, recompute=recompute)
    # autograd would drop a [V, H] grad returned for a frozen input: check none is computed
    products, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, **k: products.append((a.shape[0], b.shape[1])) or mm(a, b, **k))
    logp.sum().backward()
    monkeypatch.undo()
    assert tuple(weight.shape) not in products
    ref_logp, _ = naive_fp64(hidden, frozen, targets)
    (ref_h,) = torch.autograd.grad(ref_logp.sum(), hidden)
    torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.0), "temperature"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_bad_arguments_raise(kwargs, message):
    (hidden, weight), targets = make_inputs()
    with pytest.raises(ValueError, match=message):
        token_logprobs(hidden, weight, targets, **kwargs)


def test_recompute_that_is_not_a_bool_or_none_raises():
    (hidden, weight), targets = make_inputs()
    with pytest.raises(TypeError, match="recompute"):
        token_logprobs(hidden, weight, targets, recompute="yes")


def test_mismatched_shapes_raise():
    (hidden, weight), targets = make_inputs()
    with pytest.raises(ValueError, match="hidden size"):
        token_logprobs(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(hidden, weight, targets[:, :-1])


def test_the_default_chunk_size_keeps_a_chunk_buffer_within_its_byte_cap(monkeypatch):
    """Without chunk_size: 256 rows when a [256, V] fp32 buffer fits CHUNK_MAX_BYTES, else as many
    rows as fit (5 here, V = 37 fp32: 148 bytes a row), with the same values as the definition."""
    seen = []
    apply = logprobs.ChunkedTokenLogprobs.apply
    monkeypatch.setattr(logprobs.ChunkedTokenLogprobs, "apply", lambda *a: seen.append(a[5]) or apply(*a))
    (hidden, weight), targets = make_inputs(dtype=torch.float32)
    token_logprobs(hidden, weight, targets)
    monkeypatch.setattr(logprobs, "CHUNK_MAX_BYTES", 5 * V * 4 + 3)
    logp, entropy = token_logprobs(hidden, weight, targets)
    assert seen == [256, 5]
    ref_logp, ref_entropy = naive_fp64(hidden.detach(), weight.detach(), targets)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
