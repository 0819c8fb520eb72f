"""Multi-turn rows: what the engine does when a row's turn ends and the caller has more to say.

`EndOfTurn` is the caller's side (rlcore.tools.turns.ToolTurns is one): given a row whose turn
ended, the ids to append (tool results, the next assistant header). `continue_turns` is the
engine's side, run after a decoding step: it queues those ids as the row's next forced tokens
(`Decoding.forced`) and wakes the row, so the same static step feeds them through the model and
writes their keys/values into the cache like any sampled token's. The conversation is never
prefilled again, and the other rows decode meanwhile.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlcore.rollout.decoding import Batch, Decoding

EndOfTurn = Callable[[int, list[int]], list[int] | None]
"""`end_of_turn(row, completion_ids)`: called on the host for global row `row` whose turn just
ended (EOS or a stop sequence, the last of `completion_ids`, its completion so far); returns the
ids to append (the tool results and the next assistant header), or None to let the row stop."""


def continue_turns(batch: Batch, decoding: Decoding, step: int, was_done: torch.Tensor, end_of_turn: EndOfTurn,
                   turn_counts: list[int], max_turns: int | None, room: list[int]) -> None:
    """After token `step` of every row is sampled: each row it stopped (done now, not in `was_done`
    `[B]`) whose appends so far (`turn_counts[row]`) are fewer than `max_turns` (None: no limit) gets
    `end_of_turn`'s ids queued as its next tokens and decodes on; `turn_counts[row]` counts them. Ids
    that do not fit in max_new_tokens, or that would take the row to the `room[row]` positions its
    prompt leaves in the model's max_position_embeddings, are dropped and the row stops, as TRL drops
    such tool results (after running the calls). One host sync per step, to find the rows, and one
    per row whose turn ended."""
    ended = (batch.done & ~was_done).nonzero()[:, 0]
    if len(ended) == 0:
        return
    max_new_tokens = decoding.completion.shape[1]
    for i, row in zip(ended.tolist(), batch.rows[ended].tolist()):
        if max_turns is not None and turn_counts[row] >= max_turns:
            continue
        ids = end_of_turn(row, decoding.completion[row, :step + 1].tolist())
        if not ids or step + 1 + len(ids) > max_new_tokens or step + 1 + len(ids) >= room[row]:
            continue
        if min(ids) < 0:
            raise ValueError(f"end_of_turn returned a negative token id for row {row} ({min(ids)}); return the ids of "
                             f"the text to append, as the tokenizer encodes it")
        decoding.forced[row, step + 1:step + 1 + len(ids)] = torch.tensor(ids, device=decoding.forced.device)
        batch.done[i] = False
        decoding.stopped[row] = False
        turn_counts[row] += 1
