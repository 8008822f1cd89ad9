"""Supervised warm start: a short fine-tune on prompt + answer + eos, so RL starts from a partly right
policy (as it does in practice, from an instruction-tuned model). Plain torch; loss on answer tokens only
(and, in a tool-use demonstration, not on the tool's answer).
"""
from __future__ import annotations

import math
import random
import string
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsys.config import WarmStartConfig
from rlsys.errors import UserError
from rlsys.types import Prompt

Example = tuple[list[int], int]  # token ids of prompt + answer + eos, and the prompt's length
Labelled = tuple[list[int], list[int]]  # token ids, and their labels (IGNORE where there is no loss)

IGNORE = -100  # label value the HF loss skips
MICRO_BATCH = 16
PROBES = 3  # steps timed to state a warm start's cost (one alone said 7 minutes for 4 on a loaded CPU)
MICRO_TOKENS = 4096  # padded tokens a micro-batch holds at most: 16 of rep_long's longest would need ~80 GB at 0.47B


def near_miss(answer: str, rng: random.Random) -> str:
    """`answer` with one character replaced, dropped or doubled (never equal to it)."""
    if not answer:
        return rng.choice(string.ascii_lowercase)
    i = rng.randrange(len(answer))
    edit = rng.choice(("replace", "drop", "double"))
    if edit == "drop" and len(answer) > 1:
        return answer[:i] + answer[i + 1:]
    if edit == "double":
        return answer[:i] + answer[i] + answer[i:]
    pool = string.digits if answer[i].isdigit() else string.ascii_lowercase
    return answer[:i] + rng.choice(pool.replace(answer[i], "")) + answer[i + 1:]


def guess(answer: str, rng: random.Random) -> str:
    """As many random characters as `answer` has, each from its own kind (digit, letter, else kept)."""
    def one(ch: str) -> str:
        if ch.isdigit():
            return rng.choice(string.digits)
        return rng.choice(string.ascii_lowercase) if ch.isalpha() else ch
    return "".join(map(one, answer))


NOISE = {"near_miss": near_miss, "guess": guess}  # model.warm_start.noise -> what replaces an answer


def encode_examples(tokenizer, prompts: list[Prompt], max_len: int
                    ) -> tuple[list[tuple[list[int], int]], list[Prompt], int]:
    """(token ids of prompt + answer + eos, prompt length) per kept prompt, the kept prompts, and how many
    were dropped for being longer than max_len."""
    prompt_ids = tokenizer([p.text for p in prompts])["input_ids"]
    answer_ids = tokenizer([p.answer for p in prompts])["input_ids"]
    examples = [(q + a + [tokenizer.eos_token_id], len(q)) for q, a in zip(prompt_ids, answer_ids)]
    kept = [(e, p) for e, p in zip(examples, prompts) if len(e[0]) <= max_len]
    return [e for e, _ in kept], [p for _, p in kept], len(examples) - len(kept)


def encode_demonstration(tokenizer, prompt_ids: list[int], parts: list[tuple[str, bool]]) -> Labelled:
    """A tool-use conversation after its prompt, each part tokenized on its own as a rollout appends it (the
    tool's answer once, as ids), labelled where it is the model's; eos closes it."""
    ids, labels = list(prompt_ids), [IGNORE] * len(prompt_ids)
    for text, the_models in parts:
        part = tokenizer(text)["input_ids"]
        ids += part
        labels += part if the_models else [IGNORE] * len(part)
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]


def draw_batch(rng: random.Random, examples: list[Example], prompts: list[Prompt], cfg: WarmStartConfig,
               tokenizer, demos: list[Labelled] | None = None) -> list[Labelled]:
    """`cfg.batch_size` examples drawn with replacement: a `tool_share` of them their tool-use demonstration
    (`demos`, one per example), the others answered directly, a `label_noise` share of those replaced by
    `noise` (a near miss is always wrong, a guess rarely right)."""
    batch = []
    for i in rng.choices(range(len(examples)), k=cfg.batch_size):
        if demos and rng.random() < cfg.tool_share:
            batch.append(demos[i])
            continue
        ids, n_prompt = examples[i]
        if cfg.label_noise and rng.random() < cfg.label_noise:
            wrong = tokenizer(NOISE[cfg.noise](prompts[i].answer, rng))["input_ids"]
            ids = ids[:n_prompt] + wrong + [tokenizer.eos_token_id]
        batch.append((ids, [IGNORE] * n_prompt + ids[n_prompt:]))
    return batch


def collate(examples: list[Labelled], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), IGNORE)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(examples):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, :len(ids)] = torch.tensor(row_labels)
        mask[row, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def micro_batches(batch: list[Labelled]) -> list[list[Labelled]]:
    """A length-sorted batch cut in order into micro-batches of at most MICRO_BATCH examples and MICRO_TOKENS
    padded tokens (an example longer than that alone): the rare long answer pads neither the batch nor memory."""
    out: list[list[Labelled]] = []
    for example in batch:
        last = out[-1] if out else None
        if last and len(last) < MICRO_BATCH and (len(last) + 1) * len(example[0]) <= MICRO_TOKENS:
            last.append(example)
        else:
            out.append([example])
    return out


def trained_tokens(example: Labelled) -> int:
    return sum(label != IGNORE for label in example[1])


def draw(rng: random.Random, examples, prompts, cfg: WarmStartConfig, tokenizer, demos) -> list[Labelled]:
    """draw_batch, sorted by length (micro_batches cuts it in order)."""
    return sorted(draw_batch(rng, examples, prompts, cfg, tokenizer, demos), key=lambda e: len(e[0]))


def backward(model, batch: list[Labelled], pad_id: int, device: torch.device) -> float:
    """The gradients of one batch's token-mean answer loss, accumulated over its micro-batches; the loss."""
    n_answer = sum(map(trained_tokens, batch))
    loss_sum = 0.0
    for micro in micro_batches(batch):
        share = sum(map(trained_tokens, micro)) / n_answer
        batch_tensors = {k: v.to(device) for k, v in collate(micro, pad_id).items()}
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type != "cpu"):  # fp32 weights kept
            loss = model(**batch_tensors).loss * share  # token-mean overall
        loss.backward()
        loss_sum += loss.item()
    return loss_sum


def step_seconds(model, batch: list[Labelled], pad_id: int, device: torch.device) -> float:
    """What one step costs on this machine now: the median of PROBES backward passes of `batch`, whose gradients
    are dropped and whose random draws are undone, so the weights trained after are those trained without it."""
    times = []
    with torch.random.fork_rng(devices=[]):  # the CPU generator: a GPU draws nothing in these models (no dropout)
        for _ in range(PROBES):
            start = time.time()
            backward(model, batch, pad_id, device)
            times.append(time.time() - start)
    model.zero_grad(set_to_none=True)
    return sorted(times)[PROBES // 2]


def about(seconds: float) -> str:
    """A duration as a person plans with it: under a minute, about 12 minutes, about 1.5 hours."""
    minutes = round(seconds / 60)
    if minutes < 1:
        return "under a minute"
    if minutes < 90:
        return f"about {minutes} minute{'s' * (minutes > 1)}"
    return f"about {seconds / 3600:.1f} hours"


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


def training_device(name: str) -> torch.device:
    """model.warm_start.device, refused by name where this process sees no GPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("model.warm_start.device=cuda: the process that builds the model sees no CUDA device "
                        "(torch.cuda.is_available() is false); set model.warm_start.device=cpu, or build it on a "
                        "GPU host")
    return torch.device(name)


def release(device: torch.device) -> None:
    """Give the warm start's cached GPU blocks back: the engine and trainer ranks need that memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_start(model_dir: str | Path, train_prompts: list[Prompt], cfg: WarmStartConfig,
               demonstrate: Callable[[Prompt], list[tuple[str, bool]]] | None = None, progress: bool = False) -> dict:
    """Fine-tune the model in `model_dir` for `cfg.steps` steps on `cfg.device` and save it back; returns loss
    figures. `demonstrate` gives a prompt's tool-use conversation (rlsys.data.demonstrations), for `cfg.tool_share`.
    `progress`: a bar of the steps with the loss, as training's (minutes on a CPU are not spent in silence)."""
    if not train_prompts:
        raise ValueError("warm start: the training split is empty")
    device = training_device(cfg.device)
    try:
        with one_thread():
            return _train(model_dir, train_prompts, cfg, demonstrate, device, progress)
    finally:
        release(device)


def _train(model_dir: str | Path, train_prompts: list[Prompt], cfg: WarmStartConfig, demonstrate,
           device: torch.device, progress: bool = False) -> dict:
    from tqdm import tqdm

    t0 = time.time()
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    examples, kept, dropped = encode_examples(tokenizer, train_prompts, model.config.max_position_embeddings)
    if not examples:
        raise ValueError("warm start: every training example is longer than max_position_embeddings")
    demos = None
    if cfg.tool_share and demonstrate:
        demos = [encode_demonstration(tokenizer, ids[:n_prompt], demonstrate(p))
                 for (ids, n_prompt), p in zip(examples, kept)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.steps))
    model.train()
    a_step = step_seconds(model, draw(random.Random(-1), examples, kept, cfg, tokenizer, demos),
                          tokenizer.pad_token_id, device)
    print(f"warm start: {cfg.steps} steps of {cfg.batch_size} examples, {about(cfg.steps * a_step)} on this "
          f"machine ({a_step:.2f} s a step, the median of {PROBES} measured before it starts)", flush=True)
    rng = random.Random(cfg.seed)
    losses = []
    bar = tqdm(total=cfg.steps, desc="warm start", dynamic_ncols=True, disable=not progress)
    for _ in range(cfg.steps):
        batch = draw(rng, examples, kept, cfg, tokenizer, demos)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = backward(model, batch, tokenizer.pad_token_id, device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss_sum)
        bar.update()
        bar.set_postfix(loss=f"{loss_sum:.3g}", refresh=False)
        if not progress and len(losses) % max(1, cfg.steps // 10) == 0 and len(losses) < cfg.steps:
            # no bar (logging.progress=false: a bench, a log): a line at each tenth of the steps instead
            print(f"warm start: step {len(losses)}/{cfg.steps}, loss {loss_sum:.3g}, {time.time() - t0:.0f} s",
                  flush=True)
    bar.close()
    model.eval()
    model.to("cpu").save_pretrained(model_dir)
    head = losses[: max(1, len(losses) // 10)]
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": cfg.steps, "dropped": dropped, "seconds": time.time() - t0,
            "loss_first": sum(head) / len(head) if losses else float("nan"),
            "loss_last": sum(tail) / len(tail) if losses else float("nan")}


@one_thread()
@torch.no_grad()
def exact_match_accuracy(model_dir: str | Path, prompts: list[Prompt], temperature: float = 0.0,
                         max_new_tokens: int = 96, batch_size: int = 100, seed: int = 0,
                         device: str = "cpu", progress: bool = False) -> float:
    """Share of prompts whose generated text equals the answer (HF generate; for measurement only). A sample
    longer than the longest answer and its EOS cannot equal an answer, so generation stops there: a model
    built for long responses (thousands of tokens) is measured in seconds, not hours, on the CPU.
    `progress`: a bar of the prompts done (thousands take minutes on a CPU)."""
    from tqdm import tqdm

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if prompts:
        longest = max(len(ids) for ids in tokenizer([p.answer for p in prompts], add_special_tokens=False)["input_ids"])
        max_new_tokens = min(max_new_tokens, longest + 1)
    on = training_device(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(on)
    torch.manual_seed(seed)
    right = 0
    bar = tqdm(total=len(prompts), desc="greedy eval", unit="prompt", dynamic_ncols=True, disable=not progress)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        batch = tokenizer([p.text for p in chunk], return_tensors="pt", padding=True).to(on)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {
            "do_sample": False}
        out = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling)
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        right += sum(text == p.answer for text, p in zip(texts, chunk))
        bar.update(len(chunk))
    bar.close()
    del model
    release(on)
    return right / max(len(prompts), 1)
