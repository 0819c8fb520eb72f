"""Sequence classifiers: the decoder's backbone with a `score` head, as transformers'
`LlamaForSequenceClassification`, `Qwen2ForSequenceClassification` and
`Qwen3ForSequenceClassification` (the form reward models take, e.g. TRL's RewardTrainer's).

The checkpoint holds the backbone under `model.` and a bias-free `score.weight` `[num_labels, H]`
where a causal LM holds `lm_head.weight`. The score of a row is the head applied to the final
hidden state of its rightmost token that is not the pad id, as transformers reads it: a row may be
padded on either side, and a real token equal to the pad id at the very end of a row is passed over.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from rlcore.models.hf_checkpoint import CheckpointError, load_model, load_model_config, open_weights, weight_files
from rlcore.models.transformer import ModelConfig, Transformer, padded_causal_mask

CLASSIFIERS = ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")


class SequenceClassifier(Transformer):
    """A `Transformer` whose head is `score` `[num_labels, H]` in place of `lm_head`."""

    def __init__(self, cfg: ModelConfig, num_labels: int = 1):
        super().__init__(dataclasses.replace(cfg, tie_word_embeddings=True))  # no lm_head: `score` is the head
        self.score = nn.Linear(cfg.hidden_size, num_labels, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int) -> torch.Tensor:
        """Scores `[B, num_labels]` of the rows `input_ids` `[B, T]` (attention_mask `[B, T]`: 1 on
        real tokens), each read at its rightmost token that is not `pad_token_id`."""
        mask, positions = padded_causal_mask(attention_mask)
        hidden = super().forward(input_ids, positions, mask)  # [B, T, H]
        columns = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (columns * (input_ids != pad_token_id)).argmax(-1)  # [B]
        return self.score(hidden[torch.arange(len(input_ids), device=input_ids.device), last])


def load_classifier(path: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                    device: torch.device | str = "cpu") -> SequenceClassifier:
    """Load a one-label sequence classifier (a reward model) of the three families from a checkpoint
    directory; a causal LM or a classifier of several labels is a CheckpointError that says so."""
    path = Path(path)
    architectures = load_model_config(path).raw.get("architectures") or []
    files = weight_files(path)
    if "score.weight" not in files:
        what = f"a {architectures[0]}" if architectures else "not a sequence classifier"
        raise CheckpointError(f"{path} is {what} (no score.weight in its weights), and a reward model is a sequence "
                              f"classifier: one of {', '.join(CLASSIFIERS)}, the backbone with a one-output score "
                              f"head (what TRL's RewardTrainer trains); give such a checkpoint, or score with a "
                              f"Python function")
    with open_weights(files["score.weight"]) as f:
        num_labels = f.get_slice("score.weight").get_shape()[0]
    if num_labels != 1:
        raise CheckpointError(f"{files['score.weight']}: score.weight has {num_labels} rows, a classifier of "
                              f"{num_labels} labels (config.json's id2label), and a reward model has one output "
                              f"(TRL loads it with num_labels=1): use a reward model's checkpoint")
    return load_model(path, dtype, device, model_class=SequenceClassifier)
