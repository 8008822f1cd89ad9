"""Why a warm-started model does or does not use its calculator (docs/performance.md "Tools").

    python benchmarks/tool_copy.py --name NAME [--prompts N] [key=value ...]

Builds (or finds in the cache) the model of configs/tool_arith.yaml with the overrides, then, on N held-out
prompts, measures with HF generate:
  call_exact   greedy from the prompt: the call written is the demonstration's, expression and all;
  copy_back    greedy after the demonstration's call and the calculator's answer: the final answer is the
               calculator's, copied back (what final_answer rewards);
  call_rate    one sample at temperature 1: the response starts with `<tool_call>` (how often the policy
               starts out calling).
Adds the model's figures under NAME to benchmarks/results/tool_copy_cpu.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsys.bench import machine
from rlsys.data import load_datasets
from rlsys.data.tool_tasks import demonstrate
from rlsys.models import prepare_model
from rlsys.models.warm_start import one_thread
from rlsys.startup import load_config
from rlsys.tools.format import CALL_OPEN

CONFIG = "configs/tool_arith.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "tool_copy_cpu.json"


def generate(model, tokenizer, texts: list[str], max_new_tokens: int, sample: bool) -> list[str]:
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    options = {"do_sample": True, "temperature": 1.0, "top_k": 0} if sample else {"do_sample": False}
    out = model.generate(**batch, max_new_tokens=max_new_tokens, **options)
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


@one_thread()
@torch.no_grad()
def measure(model_dir: Path, prompts, batch_size: int = 50) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    right = {"call_exact": 0, "copy_back": 0, "call_rate": 0}
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        call, response = zip(*((parts[0][0], parts[1][0]) for parts in map(demonstrate, chunk)))
        calls = generate(model, tokenizer, [p.text for p in chunk], max(map(len, call)), sample=False)
        right["call_exact"] += sum(c[:len(want)] == want for c, want in zip(calls, call))  # what follows: unread
        contexts = [p.text + c + r for p, c, r in zip(chunk, call, response)]
        finals = generate(model, tokenizer, contexts, max(len(p.answer) for p in chunk) + 1, sample=False)
        right["copy_back"] += sum(f == p.answer for f, p in zip(finals, chunk))
        starts = generate(model, tokenizer, [p.text for p in chunk], len(CALL_OPEN), sample=True)
        right["call_rate"] += sum(s.startswith(CALL_OPEN) for s in starts)
    return {k: v / len(prompts) for k, v in right.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()
    cfg = load_config(CONFIG, args.overrides)
    _, evals = load_datasets(cfg.data)
    figures = {"overrides": args.overrides, "warm_start": cfg.model.warm_start.model_dump(),
               **measure(prepare_model(cfg), evals[:args.prompts])}
    report = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"results": {}}
    report["results"][args.name] = figures
    report.update(command=f"python benchmarks/tool_copy.py --name NAME --prompts {args.prompts} [overrides]",
                  config=CONFIG, prompts=args.prompts, machine=machine())
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(args.name, {k: v for k, v in figures.items() if k in ("call_exact", "copy_back", "call_rate")})


if __name__ == "__main__":
    main()
