"""Per-token log-probabilities and entropies without materialising [B, T, V] logits.

logp[b, t] = log softmax((h[b, t] @ W.T + bias) / temperature)[targets[b, t]]   (SPEC section 3)

The naive version, `log_softmax(h @ W.T).gather(...)`, holds several fp32 [B*T, V] tensors at
once (logits, log-softmax, and their gradients in backward): for 4 x 1024 tokens and a 152k
vocabulary that is 2.5 GB each. Here the flattened [N, H] rows are processed in chunks of
`chunk_size`, so the extra memory is O(chunk_size x V), and backward recomputes each chunk's
logits instead of saving them (one extra [chunk, H] x [H, V] matmul per chunk, about a third
more FLOPs than the naive forward + backward).

This is the plain-PyTorch twin of a fused CUDA kernel: the CPU path and its test oracle.
"""

import torch
from torch import Tensor


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """[C, H] rows -> [C, V] temperature-scaled logits in the dtype of `weight`, a fresh buffer."""
    logits = h.to(weight.dtype) @ weight.T  # the only big allocation: C x V
    if bias is not None:
        logits += bias
    if temperature != 1.0:
        logits /= temperature
    return logits


class ChunkedTokenLogprobs(torch.autograd.Function):
    """Autograd function over flattened rows: (h[N, H], W[V, H], bias[V] | None, targets[N]) ->
    (logp[N], entropy[N]). Saves only h, W, bias, targets and the [N] log-sum-exp."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        # Compute in fp32 at least (bf16 logits lose ~0.1 nats at |logit| ~ 20); fp64 stays fp64
        # so gradcheck works. Upcasting a bf16 W costs one fp32 V x H copy per call, not per chunk.
        dtype = torch.promote_types(weight.dtype, torch.float32)
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n, dtype=dtype)
        lse = hidden.new_empty(n, dtype=dtype)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden[rows], w, b, temperature)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            logits -= lse[rows, None]  # in place: now the full log-softmax of the chunk
            logp[rows] = logits.gather(1, targets[rows, None]).squeeze(1)
            # H = -sum_v p_v log p_v; p * log p is formed in place so the chunk peaks at two C x V
            entropy[rows] = -logits.exp().mul_(logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        dtype = lse.dtype
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(w) if need_w else None  # accumulated in fp32 across chunks
        grad_b = torch.zeros_like(b) if need_b else None
        grad_logp = grad_logp.to(dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows].to(dtype)
            g = grad_logp[rows, None]
            # d logp / d logits = onehot(target) - softmax; the recompute is the price of not
            # saving N x V logits in forward.
            grad_z = _chunk_logits(h, w, b, temperature)
            grad_z -= lse[rows, None]
            grad_z.exp_().mul_(-g)
            grad_z.scatter_add_(1, targets[rows, None], g)
            grad_z /= temperature  # chain rule through logits = (h @ W.T + b) / temperature
            if need_h:
                grad_h[rows] = (grad_z @ w).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(grad_z.T, h)  # [V, C] x [C, H], accumulated in place
            if need_b:
                grad_b += grad_z.sum(0)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 256,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-probability of `targets` and entropy of softmax((hidden @ weight.T + bias) / temperature).

    hidden [B, T, H] (final-norm hidden states at the positions that predict `targets`),
    weight [V, H] (the lm_head / tied embedding), targets [B, T] int64 in [0, V), bias [V] or None.
    Returns logp [B, T] (fp32, differentiable w.r.t. hidden, weight and bias) and entropy [B, T]
    (fp32, no grad). Padding positions need a valid token id; mask them in the loss.
    bf16 inputs are computed in fp32 per chunk and receive grads in bf16.
    Extra memory is about 2 x chunk_size x V fp32 (forward) plus an fp32 grad of `weight`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, time, size = hidden.shape
    if weight.shape[1] != size:
        raise ValueError(f"hidden size {size} does not match weight {tuple(weight.shape)}")
    if targets.shape != (batch, time):
        raise ValueError(f"targets {tuple(targets.shape)} must have shape [B, T] = {(batch, time)}")
    logp, entropy = ChunkedTokenLogprobs.apply(
        hidden.reshape(batch * time, size), weight, bias, targets.reshape(-1).long(),
        float(temperature), int(chunk_size),
    )
    return logp.view(batch, time), entropy.view(batch, time)
