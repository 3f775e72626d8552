"""bf16 (packed linears) against fp32 (the GGUF's blocks) on one CPU: plain and the default method in
each dtype, interleaved prompt by prompt in one process, so the two dtypes are compared as ratios.

    .venv/bin/python scripts/dtype_ab.py --limit 1 -n 96      # 13 Spec-Bench first turns

Prints each method's median tok/s, its median per-prompt ratio to bf16 plain, and how many answers
equal fp32 plain's and bf16 plain's. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from medusa_decoding.bench.prompts import load_suite, select
from medusa_decoding.engine import MedusaModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1, help="Spec-Bench prompts per category")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {}
    for dtype in ("bfloat16", "float32"):
        model = MedusaModel.from_pretrained(heads="shipped", ngram=True, dtype=dtype)
        print(dtype, model.fit_to_machine().line, flush=True)
        model.generate("Hello", max_new_tokens=16)  # warm up both paths
        model.generate("Hello", max_new_tokens=16, use_medusa=False)
        models[dtype] = model
    rows = []
    for prompt in select(load_suite("spec-bench"), args.limit, 1):
        row = {}
        for dtype, model in models.items():
            for kind in ("plain", "default"):
                start = time.perf_counter()
                out = model.generate(prompt.turns[0], max_new_tokens=args.max_new_tokens, use_medusa=kind == "default")
                row[f"{dtype}/{kind}"] = (len(out.token_ids) / (time.perf_counter() - start), out.token_ids)
        rows.append(row)
        print(prompt.id, prompt.category, {k: round(v[0], 1) for k, v in row.items()}, flush=True)
    for key in rows[0]:
        tps = statistics.median(r[key][0] for r in rows)
        ratio = statistics.median(r[key][0] / r["bfloat16/plain"][0] for r in rows)
        same = {ref: sum(r[key][1] == r[f"{ref}/plain"][1] for r in rows) for ref in models}
        print(f"{key:18s} {tps:6.1f} tok/s  {ratio:5.2f}x bf16 plain  identical to fp32 plain "
              f"{same['float32']}/{len(rows)}, to bf16 plain {same['bfloat16']}/{len(rows)}")


if __name__ == "__main__":
    main()
