"""Supervised warm start: a short fine-tune on prompt + answer + eos, so RL starts from a partly right
policy (as it does in practice, from an instruction-tuned model). Plain torch; loss on answer tokens only.
"""
from __future__ import annotations

import math
import random
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsys.config import WarmStartConfig
from rlsys.types import Prompt

IGNORE = -100  # label value the HF loss skips
MICRO_BATCH = 16


def encode_examples(tokenizer, prompts: list[Prompt], max_len: int) -> tuple[list[tuple[list[int], int]], int]:
    """(token ids of prompt + answer + eos, prompt length) per prompt; sequences over max_len are dropped."""
    prompt_ids = tokenizer([p.text for p in prompts])["input_ids"]
    answer_ids = tokenizer([p.answer for p in prompts])["input_ids"]
    examples = [(q + a + [tokenizer.eos_token_id], len(q)) for q, a in zip(prompt_ids, answer_ids)]
    kept = [e for e in examples if len(e[0]) <= max_len]
    return kept, len(examples) - len(kept)


def collate(examples: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), IGNORE)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, n_prompt) in enumerate(examples):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, n_prompt:len(ids)] = torch.tensor(ids[n_prompt:])
        mask[row, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def lr_factor(step: int, total: int) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10%."""
    warmup = max(1, total // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@contextmanager
def one_thread():
    """A model this small gains little from a second thread, and OpenMP threads that share their cores
    with other processes (rollout, reward, other jobs) were measured running up to 25x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def warm_start(model_dir: str | Path, train_prompts: list[Prompt], cfg: WarmStartConfig) -> dict:
    """Fine-tune the model in `model_dir` for `cfg.steps` steps and save it back; returns loss figures."""
    if not train_prompts:
        raise ValueError("warm start: the training split is empty")
    with one_thread():
        return _train(model_dir, train_prompts, cfg)


def _train(model_dir: str | Path, train_prompts: list[Prompt], cfg: WarmStartConfig) -> dict:
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples, dropped = encode_examples(tokenizer, train_prompts, model.config.max_position_embeddings)
    if not examples:
        raise ValueError("warm start: every training example is longer than max_position_embeddings")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.steps))
    rng = random.Random(cfg.seed)
    model.train()
    losses = []
    for _ in range(cfg.steps):
        batch = sorted(rng.choices(examples, k=cfg.batch_size), key=lambda e: len(e[0]))
        n_answer = sum(len(ids) - n for ids, n in batch)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        # Length-sorted micro-batches: the rare long answer does not pad the whole batch to its length.
        for start in range(0, len(batch), MICRO_BATCH):
            micro = batch[start:start + MICRO_BATCH]
            share = sum(len(ids) - n for ids, n in micro) / n_answer
            loss = model(**collate(micro, tokenizer.pad_token_id)).loss * share  # token-mean overall
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss_sum)
    model.eval()
    model.save_pretrained(model_dir)
    head = losses[: max(1, len(losses) // 10)]
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": cfg.steps, "dropped": dropped, "seconds": time.time() - t0,
            "loss_first": sum(head) / len(head) if losses else float("nan"),
            "loss_last": sum(tail) / len(tail) if losses else float("nan")}


@one_thread()
@torch.no_grad()
def exact_match_accuracy(model_dir: str | Path, prompts: list[Prompt], temperature: float = 0.0,
                         max_new_tokens: int = 96, batch_size: int = 100, seed: int = 0) -> float:
    """Share of prompts whose generated text equals the answer (HF generate; for measurement only)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    right = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        batch = tokenizer([p.text for p in chunk], return_tensors="pt", padding=True)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {
            "do_sample": False}
        out = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling)
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        right += sum(text == p.answer for text, p in zip(texts, chunk))
    return right / max(len(prompts), 1)
