"""The training forward: a round's rows packed as left-padded prompt + right-padded completion,
run through the model, and each completion token's log-prob and entropy under it.

`completion_logprobs` is what the loop calls for the current, old and reference log-probs; it
runs each distinct prompt of a micro-batch once (`completion_hidden`), and with `SharedPrompts`
once per optimizer step (docs/losses.md, "The training forward"). The SFT warm start
(`rlcore/sft.py`) trains through the same functions.
"""

from __future__ import annotations

import torch

from rlcore.losses.logprobs import token_logprobs
from rlcore.models.transformer import PrefixKV, Transformer, padded_causal_mask


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """Left-pad prompts, right-pad completions: ids `[B, Lp+Tc]`, attention `[B, Lp+Tc]`,
    completion ids `[B, Tc]` and completion mask `[B, Tc]`, with the prompt length Lp."""
    Lp, Tc = max(map(len, prompts)), max(map(len, completions))
    B = len(prompts)
    ids = torch.full((B, Lp + Tc), pad_id, dtype=torch.long)
    attn = torch.zeros(B, Lp + Tc, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, Lp - len(p):Lp] = torch.tensor(p)
        ids[i, Lp:Lp + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[i, Lp - len(p):Lp + len(c)] = 1
    return ids, attn, ids[:, Lp:], attn[:, Lp:].float(), Lp


def completion_logprobs(model: Transformer, ids, attn, Lp: int, completion_ids,
                        temperature: float = 1.0, autocast: torch.dtype | None = None,
                        shared: "SharedPrompts | None" = None):
    """Log-probs and entropies `[B, Tc]` of the completion tokens under `model`.

    ids/attn `[B, Lp + Tc]` as `pack` builds them. Rows with the same prompt (GRPO's G samples)
    share one forward pass over it; see `completion_hidden`. With `shared`, the prompts' pass is
    the one `shared` ran for several micro-batches, this one's among them.
    With `autocast` (bf16 or fp16) the body runs under autocast to that dtype while the log-probs
    are computed from fp32 hidden states and the fp32 output weight.
    """
    with torch.autocast(ids.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if shared is None:
            h = completion_hidden(model, ids, attn.to(ids.device), Lp)
        else:
            h = shared.completion_hidden(ids, attn.to(ids.device))
    if autocast is not None:
        h = h.float()
    return token_logprobs(h, model.lm_head_weight, completion_ids, temperature)


def _prompt_keys(ids, attn, Lp: int):
    """`[B, Lp]` prompt ids with -1 on padding, so equal keys mean equal (left-padded) prompts."""
    return ids[:, :Lp].masked_fill(attn[:, :Lp] == 0, -1)


def completion_hidden(model: Transformer, ids, attn, Lp: int):
    """Final hidden states `[B, Tc, H]` at the positions that predict the completion tokens.

    The hidden state at t predicts token t+1, so positions Lp-1 .. Lp+Tc-2 predict the
    completion. When rows repeat a prompt, each distinct prompt runs once (a `PrefixKV` pass)
    and the completions attend to its keys/values: the same numbers as the full `[B, Lp + Tc]`
    pass (gradients into the prompt are summed over its rows) with U/B of the prompt's FLOPs
    (U distinct prompts) instead of all of them; for 16 rows of 64 + 128 tokens from 2 prompts,
    29% fewer in the body.
    """
    distinct, rows = torch.unique(_prompt_keys(ids, attn, Lp), dim=0, return_inverse=True)
    if len(distinct) == len(ids):  # nothing to share
        # The last token predicts nothing here: the pass stops before it.
        mask, pos = padded_causal_mask(attn[:, :-1])
        return model(ids[:, :-1], pos, mask)[:, Lp - 1:]
    last, prefix = _prompt_pass(model, distinct)
    return _completion_pass(model, ids, attn, Lp, last, prefix, rows)


def _prompt_pass(model: Transformer, distinct):
    """Run the U distinct prompts `[U, Lp]` (left-padded, -1 on padding) once: the hidden state
    `[U, H]` of each one's last position and every layer's keys/values (a `PrefixKV`)."""
    prefix = PrefixKV()
    p_mask, p_pos = padded_causal_mask((distinct >= 0).long())
    return model(distinct.clamp(min=0), p_pos, p_mask, prefix=prefix)[:, -1], prefix


def _completion_pass(model: Transformer, ids, attn, Lp: int, last, prefix: PrefixKV, rows):
    """Hidden states `[B, Tc, H]` predicting the completions of rows `[B, Lp + Tc]`, row b
    continuing prompt `rows[b]` of `_prompt_pass`'s `last` and `prefix`. Distinct prompts keep
    their rows' left padding, so mask columns 0..Lp-1 line up with them. The last completion
    token predicts nothing, so the pass runs tokens Lp .. Lp+Tc-2."""
    if ids.shape[1] == Lp + 1:  # one completion token: the prompt's last position predicts it
        return last[rows, None]
    ids, attn = ids[:, :-1], attn[:, :-1]
    mask, pos = padded_causal_mask(attn)
    h = model(ids[:, Lp:], pos[:, Lp:], mask[:, :, Lp:], prefix=prefix, prefix_rows=rows)
    return torch.cat((last[rows, None], h), dim=1)


class SharedPrompts:
    """One forward pass over the distinct prompts of several micro-batches, shared by all of them.

    `completion_hidden` shares a prompt among the rows of one micro-batch; an optimizer step of
    GA micro-batches of shuffled rows meets each prompt in several of them. This runs each
    distinct prompt of the whole step once. The micro-batches attend to detached copies of its
    keys/values (and of the last prompt position's hidden state), whose gradients accumulate
    over their backward passes; `backward()`, called once after the last one, sends the sum on
    through the prompt pass. The parameters' gradients are then those of running every row in
    full: gradients add, and the prompt pass's weights are the same in every micro-batch
    (the optimizer steps only after the last of them).

        shared = SharedPrompts.build(model, ids[step_rows], attn[step_rows], Lp)  # None: nothing repeats
        for r in the_steps_micro_batches:
            completion_logprobs(model, ids[r], attn[r], Lp, completion_ids[r], shared=shared) ... backward()
        if shared is not None:
            shared.backward()
    """

    def __init__(self, model: Transformer, distinct: torch.Tensor, Lp: int):
        self.model, self.distinct, self.Lp = model, distinct, Lp
        last, prefix = _prompt_pass(model, distinct)
        self.outputs = [last] + prefix.k + prefix.v  # the prompt pass's graph ends here
        self.inputs = [o.detach().requires_grad_(o.requires_grad) for o in self.outputs]
        n = len(prefix.k)
        self.last, self.prefix = self.inputs[0], PrefixKV(self.inputs[1:1 + n], self.inputs[1 + n:])

    @classmethod
    def build(cls, model: Transformer, ids, attn, Lp: int, autocast: torch.dtype | None = None,
              max_prompts: int | None = None):
        """For the rows `ids`/`attn` `[n, Lp + Tc]` of the micro-batches that will share it.

        None when no prompt repeats (sharing saves nothing) or when there are more than
        `max_prompts` distinct prompts: the prompt pass's activations are kept until the last
        micro-batch's backward, and the loop caps them at one micro-batch's worth of prompts
        (per_device_train_batch_size), the most a micro-batch's own prompt pass holds."""
        distinct = torch.unique(_prompt_keys(ids, attn, Lp), dim=0)
        if len(distinct) == len(ids) or (max_prompts is not None and len(distinct) > max_prompts):
            return None
        with torch.autocast(ids.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            return cls(model, distinct, Lp)

    def completion_hidden(self, ids, attn):
        """`completion_hidden` for micro-batch rows `[B, Lp + Tc]` whose prompts were given."""
        same = (_prompt_keys(ids, attn, self.Lp)[:, None] == self.distinct[None]).all(-1)  # [B, U], U distinct
        if not same.any(1).all():
            raise ValueError("a row's prompt is not among the prompts this SharedPrompts ran")
        return _completion_pass(self.model, ids, attn, self.Lp, self.last, self.prefix, same.int().argmax(1))

    def backward(self) -> None:
        """Back-propagate the gradients the micro-batches left on the shared keys/values."""
        pairs = [(o, i.grad) for o, i in zip(self.outputs, self.inputs) if i.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.outputs = self.inputs = self.prefix = self.last = None  # free the graph
