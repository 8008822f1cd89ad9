"""Writes a small dataset in veRL's parquet format, standing in for your own: `prompt` as chat messages,
the answer in `reward_model.ground_truth`, `data_source` and `extra_info` (both reach a veRL-style reward
function), and veRL's `ability`, which rlsys ignores.

    python examples/own_reward/make_data.py [OUT_DIR]     (default examples/own_reward/data)
"""
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        question = f"Ann has {a} apples and buys {b} more. How many apples does she have now?"
        out.append({"data_source": "own_apples",
                    "prompt": [{"role": "user", "content": question + " Put the final answer in \\boxed{}."}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                    "extra_info": {"index": i}})
    return out


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, n, seed in [("train", 512, 0), ("eval", 64, 1)]:
        pq.write_table(pa.Table.from_pylist(rows(n, seed)), out_dir / f"{split}.parquet")
        print(f"wrote {out_dir / f'{split}.parquet'} ({n} rows)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data")
