"""A learned reward model (veRL's reward_model): a Hugging Face sequence-classification model with one label, loaded
from a local folder in each reward actor and scored there in batches.

Its input is the prompt as the policy was given it and the response: rendered as a user message and an assistant
message with the reward model's chat template when its tokenizer has one, else the two texts joined as they are
(the conversation the policy's own template wrote, when the prompts were rendered with it). The score is the
model's logit at the last token of the text, as AutoModelForSequenceClassification reads it.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlsys.config import RewardModelConfig
from rlsys.models import validate_model_dir

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class RewardModel:
    def __init__(self, cfg: RewardModelConfig):
        path = validate_model_dir(cfg.path, "reward.model.path")
        self.batch_size, self.device = cfg.batch_size, torch.device(cfg.device)
        dtype = DTYPES.get(cfg.dtype) or (torch.float32 if cfg.device == "cpu" else torch.bfloat16)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype,
                                                                        use_safetensors=True)  # never a pickle
        if self.tokenizer.pad_token is None:  # a batch needs one; the model finds each text's last token by it
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))
        self.model.to(self.device).eval()

    def text(self, prompt: str, response: str) -> str:
        """What the model reads for one sample (module docstring)."""
        if self.templated:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
        return prompt + response

    @torch.no_grad()
    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """The score of each (prompt, response), `batch_size` texts per forward."""
        texts = [self.text(p, r) for p, r in pairs]
        scores = []
        for start in range(0, len(texts), self.batch_size):
            # a chat template writes its own special tokens (a BOS among them), a plain text gets the tokenizer's
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   add_special_tokens=not self.templated)
            logits = self.model(**batch.to(self.device)).logits
            scores += logits[:, 0].float().tolist()
        return scores
