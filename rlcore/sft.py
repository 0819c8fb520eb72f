"""Supervised fine-tuning on (prompt, completion) token pairs: the warm start before RL.

Cross-entropy on completion tokens only, computed through the training forward the RL loop uses
(`rlcore/forward.py`: the chunked log-prob function), so a large vocabulary never materialises
`[B, T, V]` logits.
"""

from __future__ import annotations

import math
import time

import torch

from rlcore.forward import completion_logprobs, pack
from rlcore.models.transformer import Transformer


def sft(model: Transformer, prompts: list[list[int]], completions: list[list[int]], *,
        pad_id: int, steps: int, batch_size: int, lr: float, seed: int = 0,
        log_every: int = 50, masks: list[list[int]] | None = None) -> list[float]:
    """Train `model` in place for `steps` AdamW steps (cosine LR); returns the loss per step.
    `masks` (1 = trained on), one per completion, leave tokens the model does not write (tool
    results) out of the loss; None trains on every completion token."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    losses, t0 = [], time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        rows = torch.randint(len(prompts), (batch_size,), generator=generator).tolist()
        ids, attn, completion_ids, completion_mask, Lp = pack([prompts[i] for i in rows],
                                                              [completions[i] for i in rows], pad_id)
        logp, _ = completion_logprobs(model, ids.to(device), attn, Lp, completion_ids.to(device))
        if masks is not None:
            for j, i in enumerate(rows):
                completion_mask[j, :len(masks[i])] *= torch.tensor(masks[i], dtype=completion_mask.dtype)
        completion_mask = completion_mask.to(device)
        loss = -(logp * completion_mask).sum() / completion_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"  sft step {step + 1}/{steps}  loss {loss.item():.4f}  ({time.time() - t0:.0f}s)",
                  flush=True)
    return losses
