"""Reward models as reward functions: a `loss.reward_funcs` entry that is a checkpoint directory of
a sequence classifier (rlcore.models.classifier) scores each completion as TRL's GRPOTrainer
scores with a reward model:

- the text is the prompt and the completion rendered together by the reward model's own chat
  template (`add_generation_prompt=False`, with data.chat_template_kwargs) when the prompt is a list
  of messages (TRL looks at the first prompt), else the prompt string followed by the completion;
- it is tokenized by the reward model's own tokenizer, without special tokens added (a template
  writes its own), right-padded with its pad token (EOS when it has none, as TRL sets it);
- the reward is the classifier's single output, `logits[:, 0]`, read at each row's rightmost token
  that is not the pad id (the pad id TRL gives the model).

The model is loaded frozen, in its own copy on the run's device (never sharded or given LoRA
adapters), and scores `batch_size` completions per forward pass. Its name in the metrics is the
directory's name, as TRL names a reward model after its `_name_or_path`'s last part.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlcore.models.classifier import SequenceClassifier, load_classifier
from rlcore.models.hf_checkpoint import resolve_dtype
from rlcore.models.tokenizer import Tokenizer, check_vocab_fits


class RewardModel:
    """A reward function (called as TRL calls one) that scores with a sequence classifier."""

    def __init__(self, model: SequenceClassifier, tok: Tokenizer, name: str, batch_size: int,
                 chat_template_kwargs: dict | None = None):
        self.model, self.tok, self.batch_size = model, tok, batch_size
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.__name__ = name  # the metrics' name, and what errors call it

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu", dtype: str = "float32",
             batch_size: int = 8, chat_template_kwargs: dict | None = None, conversational: bool = False
             ) -> RewardModel:
        """The reward model in checkpoint directory `path`, with its tokenizer, frozen on `device` in
        `dtype` (model.dtype; 'auto': its own). `conversational`: the prompts are lists of messages,
        so its chat template is needed."""
        path = Path(path)
        model = load_classifier(path, resolve_dtype(dtype, path), device).eval().requires_grad_(False)
        try:
            tok = Tokenizer.from_dir(path)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"reward model {path}: {err}; a reward model scores text with its own "
                                    f"tokenizer (TRL's reward_processing_classes)") from None
        check_vocab_fits(tok, model.config.vocab_size, path)
        if conversational and tok.chat_template is None:
            raise ValueError(f"{path / 'tokenizer_config.json'}: the reward model has no chat template (no "
                             f"chat_template.jinja, no 'chat_template' here), and the prompts are chat messages, "
                             f"which it scores rendered with its template, as TRL does: copy the template it was "
                             f"trained with into {path / 'chat_template.jinja'}")
        return cls(model, tok, Path(os.path.abspath(path)).name, batch_size, chat_template_kwargs)

    def texts(self, prompts: list, completions: list) -> list[str]:
        """What the model reads: each prompt and completion in its chat template, or concatenated."""
        if isinstance(prompts[0], list):  # conversational, as TRL's is_conversational decides
            return [self.tok.apply_chat_template(p + c, add_generation_prompt=False, **self.chat_template_kwargs)
                    for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        ids = [self.tok.encode(text, add_special_tokens=False) for text in self.texts(prompts, completions)]
        pad, device, scores = self.tok.pad_token_id, self.model.inv_freq.device, []
        for i in range(0, len(ids), self.batch_size):  # right-padded to the batch's longest row
            rows = ids[i:i + self.batch_size]
            width = max(len(row) for row in rows)
            input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows], device=device)
            attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows], device=device)
            scores += self.model(input_ids, attention_mask, pad)[:, 0].float().tolist()  # one host sync per batch
        return scores
