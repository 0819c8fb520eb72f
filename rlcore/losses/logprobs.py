"""Per-token log-probabilities and entropies without materialising [B, T, V] logits.

logp[b, t] = log softmax((h[b, t] @ W.T + bias) / temperature)[targets[b, t]]   (SPEC section 3)
entropy[b, t] = -sum_v q_v log q_v, q = that softmax  (differentiable: loss.entropy_coef's bonus)

The naive version, `log_softmax(h @ W.T).gather(...)`, holds several fp32 [B*T, V] tensors at
once (logits, log-softmax, and their gradients in backward): for 4 x 1024 tokens and a 152k
vocabulary that is 2.5 GB each. Here the flattened [N, H] rows are processed in chunks of
`chunk_size` through [chunk_size, V] buffers allocated once per call (a fresh large tensor
per chunk costs page faults on CPU). Backward needs d logp / d logits = onehot(target) - softmax
per chunk (and, when the entropy is in the loss, d H / d logits = -q * (log q + H)), and
`recompute` picks how it gets the softmax:

- recompute=True: forward saves the inputs and the [N] log-sum-exp and entropy (O(N) extra
  memory) and backward recomputes each chunk's logits: one more [chunk, H] x [H, V] matmul per
  chunk, a quarter of the matmul FLOPs of forward + backward.
- recompute=False: forward saves the [N, V] softmax in the compute dtype (fp32: 262 MB for
  2048 tokens and a 32000 vocabulary) and backward skips that matmul. Forward writes all N
  rows' logits into that buffer with one matmul and turns them into the softmax chunk by chunk.
- recompute=None (default): save when the softmax takes at most SAVE_PROBS_MAX_BYTES, else
  recompute; 4096 tokens x 151936 vocabulary (Qwen, 2.5 GB) is recomputed.

The matmuls are PyTorch's (cuBLAS, MKL). The passes over each [chunk, V] block of logits that
follow are `chunk_stats` (forward) and `chunk_grad_` (backward, when recomputing): on CUDA they
run as one fused kernel each (`rlcore/cuda/token_logprobs.cu`, SPEC section 3), and these two
functions are those kernels' plain-PyTorch twins, the CPU path and the kernels' test oracle.
"""

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from rlcore import cuda

SAVE_PROBS_MAX_BYTES = 512 * 2**20
"""Largest [N, V] softmax that recompute=None keeps for backward instead of recomputing logits."""

CHUNK_MAX_BYTES = 64 * 2**20
"""Largest [chunk_size, V] buffer of the default chunk_size: 256 rows up to a 65k vocabulary,
fewer beyond (110 at Qwen's 151,936), where a chunk's matmul is still large enough to run at speed."""


WEIGHT_BLOCK_ROWS = 16384
"""Rows of a weight narrower than the compute dtype (a bf16 output layer) cast per matmul: it is
never copied whole (an fp32 copy of Qwen2.5's 151,936 x 896 embedding is 0.54 GB), at the price of
casting it once per chunk, which costs time next to the matmul but no memory."""


def _times_weight_t(h: Tensor, weight: Tensor, dtype: torch.dtype, out: Tensor) -> Tensor:
    """`out [C, V] = h [C, H] @ weight.T` in `dtype`, casting `weight` [V, H] a block of rows at a time."""
    if weight.dtype == dtype:
        return torch.mm(h, weight.T, out=out)
    for start in range(0, weight.shape[0], WEIGHT_BLOCK_ROWS):
        block = slice(start, start + WEIGHT_BLOCK_ROWS)
        out[:, block] = h @ weight[block].to(dtype).T
    return out


def _times_weight(grad_z: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """`grad_z [C, V] @ weight [V, H]` in `dtype`, casting `weight` a block of rows at a time."""
    if weight.dtype == dtype:
        return grad_z @ weight
    out = None
    for start in range(0, weight.shape[0], WEIGHT_BLOCK_ROWS):
        block = slice(start, start + WEIGHT_BLOCK_ROWS)
        part = grad_z[:, block] @ weight[block].to(dtype)
        out = part if out is None else out.add_(part)
    return out


def _chunk_logits(
    h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, buf: Tensor
) -> Tensor:
    """[C, H] rows -> [C, V] temperature-scaled logits in the dtype of `buf`, written into the
    first C rows of the reusable buffer `buf` [chunk_size, V]."""
    logits = _times_weight_t(h.to(buf.dtype), weight, buf.dtype, buf[: h.shape[0]])
    if bias is not None:
        logits += bias
    if temperature != 1.0:
        logits /= temperature
    return logits


def chunk_stats(z: Tensor, targets: Tensor, p_buf: Tensor, write_probs: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Twin of the CUDA kernel `softmax_stats`. Logits z [C, V] and targets [C] -> log-sum-exp,
    log-probability of the target and entropy, each [C]. Overwrites z: with the softmax when
    `write_probs`, else with scratch; p_buf [C, V] is scratch."""
    m = z.amax(-1, keepdim=True)
    z -= m  # max-subtracted, so exp cannot overflow
    p = torch.exp(z, out=p_buf)
    s = p.sum(-1, keepdim=True)
    log_s = s.log()
    lse = (m + log_s).squeeze(1)
    logp = (z.gather(1, targets[:, None]) - log_s).squeeze(1)
    # H = -sum_v q_v log q_v with q = p / s and log q = z - log s, so
    # H = log s - sum_v p_v z_v / s; z.mul_(p) reuses the logits, done with here
    entropy = (log_s - z.mul_(p).sum(-1, keepdim=True) / s).squeeze(1)
    if write_probs:
        torch.div(p, s, out=z)
    return lse, logp, entropy


def chunk_grad_(z: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, g: Tensor, g_h: Tensor | None,
                q_buf: Tensor | None) -> Tensor:
    """Twin of the CUDA kernel `logit_grad_`. Logits z [C, V] -> d loss / d z, in place, given the
    forward's lse and entropy [C] and the upstream gradients g = d loss / d logp and g_h =
    d loss / d entropy [C] (None: the loss has no entropy term; else q_buf [C, V] is scratch).
    d logp / d z = onehot(target) - q and d H / d z = -q * (log q + H), so
    grad_z = g * onehot - q * (g + g_h * (log q + H))."""
    z -= lse[:, None]  # log q
    if g_h is None:
        z.exp_().mul_(-g[:, None])
    else:
        q = torch.exp(z, out=q_buf)
        z.add_(entropy[:, None]).mul_(g_h[:, None]).add_(g[:, None]).mul_(q).neg_()
    return z.scatter_add_(1, targets[:, None], g[:, None])


class ChunkedTokenLogprobs(torch.autograd.Function):
    """Autograd function over flattened rows: (h[N, H], W[V, H], bias[V] | None, targets[N]) ->
    (logp[N], entropy[N]). Saves h, W, bias, targets, the [N] log-sum-exp and entropy, and with
    recompute=False also the [N, V] softmax, which backward reads but never overwrites. An
    output the loss does not use gets no gradient term (no work for the entropy's)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, recompute):
        # Compute in fp32 at least (bf16 logits lose ~0.1 nats at |logit| ~ 20); fp64 stays fp64
        # so gradcheck works. A bf16 W is cast block by block (WEIGHT_BLOCK_ROWS), never whole.
        dtype = torch.promote_types(weight.dtype, torch.float32)
        b = None if bias is None else bias.to(dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        logp = hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n, dtype=dtype)
        lse = hidden.new_empty(n, dtype=dtype)
        kernel = cuda.kernels("token_logprobs", hidden.device)
        chunk = (min(chunk_size, n), vocab)
        buf = hidden.new_empty(chunk, dtype=dtype) if recompute or kernel is None else None  # logits, or exp
        exp_buf = hidden.new_empty(chunk, dtype=dtype) if recompute and kernel is None else None
        probs = None if recompute else hidden.new_empty(n, vocab, dtype=dtype)
        if not recompute:  # every row's logits at once, into the softmax's buffer: one large matmul runs
            _chunk_logits(hidden, weight, b, temperature, probs)  # faster than chunk-sized ones (~70 ms of 340)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            if recompute:
                z, p_buf = _chunk_logits(hidden[rows], weight, b, temperature, buf), exp_buf
            else:
                z, p_buf = probs[rows], buf
            if kernel is None:
                stats = chunk_stats(z, targets[rows], p_buf[: len(z)], write_probs=not recompute)
            else:
                stats = kernel.softmax_stats(z, targets[rows], not recompute)
            lse[rows], logp[rows], entropy[rows] = stats  # without recompute, z is now the softmax in `probs`
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, probs)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy, probs = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        dtype = lse.dtype
        b = None if bias is None else bias.to(dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        # accumulated in fp32 across chunks; the first chunk writes it (no rows: zeros)
        grad_w = (weight.new_empty(weight.shape, dtype=dtype) if n else weight.new_zeros(weight.shape, dtype=dtype)
                  ) if need_w else None
        grad_b = torch.zeros_like(b) if need_b else None
        # chain rule through logits = (h @ W.T + b) / temperature, applied to the [N] upstreams
        grad_logp = lse.new_zeros(n) if grad_logp is None else grad_logp.to(dtype) / temperature
        grad_ent = None if grad_entropy is None else grad_entropy.to(dtype) / temperature
        buf = hidden.new_empty(min(chunk_size, n), weight.shape[0], dtype=dtype)
        kernel = None if probs is not None else cuda.kernels("token_logprobs", hidden.device)
        q_buf = None if grad_ent is None or probs is not None or kernel is not None else torch.empty_like(buf)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows].to(dtype)
            g = grad_logp[rows, None]
            g_h = None if grad_ent is None else grad_ent[rows]  # [C]; chunk_grad_ says what backward computes
            if probs is None:  # recompute: the price of not saving N x V in forward
                grad_z = _chunk_logits(h, weight, b, temperature, buf)
                if kernel is None:
                    chunk_grad_(grad_z, targets[rows], lse[rows], entropy[rows], grad_logp[rows], g_h,
                                None if q_buf is None else q_buf[: h.shape[0]])
                else:
                    kernel.logit_grad_(grad_z, targets[rows], lse[rows], entropy[rows], grad_logp[rows], g_h)
            elif g_h is None:  # into buf, never in place: a retain_graph backward reads probs again
                grad_z = torch.mul(probs[rows], -g, out=buf[: h.shape[0]])
                grad_z.scatter_add_(1, targets[rows, None], g)
            else:  # q log q as xlogy: 0 where q underflowed to 0
                q = probs[rows]
                grad_z = torch.xlogy(q, q, out=buf[: h.shape[0]]).mul_(g_h[:, None])
                grad_z.addcmul_(q, g + g_h[:, None] * entropy[rows, None]).neg_()
                grad_z.scatter_add_(1, targets[rows, None], g)
            if need_h:
                grad_h[rows] = _times_weight(grad_z, weight, dtype).to(hidden.dtype)
            if need_w and start == 0:  # written, not added: no pass to zero [V, H] first
                torch.mm(grad_z.T, h, out=grad_w)
            elif need_w:
                grad_w.addmm_(grad_z.T, h)  # [V, C] x [C, H], accumulated in place
            if need_b:
                grad_b += grad_z.sum(0)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    bias: Tensor | None = None,
    recompute: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-probability of `targets` and entropy of softmax((hidden @ weight.T + bias) / temperature).

    hidden [B, T, H] (final-norm hidden states at the positions that predict `targets`),
    weight [V, H] (the lm_head / tied embedding), targets [B, T] int64 in [0, V), bias [V] or None.
    Returns logp [B, T] and entropy [B, T] (fp32, both differentiable w.r.t. hidden, weight and
    bias; backward does the entropy's extra [chunk, V] work only when the loss uses it).
    Padding positions need a valid token id; mask them in the loss.
    bf16 inputs are computed in fp32 per chunk and receive grads in bf16.

    `chunk_size` (default: 256, or fewer so that a buffer takes at most CHUNK_MAX_BYTES) rows per
    pass. Extra memory is at most two chunk_size x V fp32 buffers (one through the CUDA kernels), an
    fp32 grad of `weight` when it requires grad (a bf16 `weight` is never copied whole to fp32:
    WEIGHT_BLOCK_ROWS), and, until backward, whatever `recompute` keeps: True keeps O(N),
    and backward recomputes the logits (one more chunk x H x V matmul per chunk); False keeps the
    fp32 [N, V] softmax and backward skips that matmul; None keeps it when it is at most
    SAVE_PROBS_MAX_BYTES (512 MiB: 2048 x 32000 is kept, 4096 x 151936 is recomputed). Without
    grad (no_grad, or no input requiring grad) nothing is kept, whatever `recompute` says.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is None:
        itemsize = torch.promote_types(weight.dtype, torch.float32).itemsize
        chunk_size = max(1, min(256, CHUNK_MAX_BYTES // (weight.shape[0] * itemsize)))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if recompute is not None and not isinstance(recompute, bool):
        raise TypeError(f"recompute must be True, False or None (automatic), got {recompute!r}")
    batch, time, size = hidden.shape
    if weight.shape[1] != size:
        raise ValueError(f"hidden size {size} does not match weight {tuple(weight.shape)}")
    if targets.shape != (batch, time):
        raise ValueError(f"targets {tuple(targets.shape)} must have shape [B, T] = {(batch, time)}")
    leaves = (hidden, weight) if bias is None else (hidden, weight, bias)
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in leaves)):
        recompute = True  # no backward will run: a saved softmax would be a wasted N x V buffer
    elif recompute is None:
        itemsize = torch.promote_types(weight.dtype, torch.float32).itemsize
        recompute = batch * time * weight.shape[0] * itemsize > SAVE_PROBS_MAX_BYTES
    logp, entropy = ChunkedTokenLogprobs.apply(
        hidden.reshape(batch * time, size), weight, bias, targets.reshape(-1).long().contiguous(),
        float(temperature), int(chunk_size), recompute,
    )
    return logp.view(batch, time), entropy.view(batch, time)
