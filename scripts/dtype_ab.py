"""bf16 (packed linears) against fp32 (the GGUF's blocks) on one CPU: plain and the default method in
each dtype, interleaved prompt by prompt in one process, so the two dtypes are compared as ratios.

    .venv/bin/python scripts/dtype_ab.py --limit 1 -n 96              # 13 Spec-Bench first turns
    .venv/bin/python scripts/dtype_ab.py --limit 1 -n 96 --compiled   # + fp32 on saved compiled graphs

Prints each method's median tok/s, its median per-prompt ratio to bf16 plain, tau, and how many
answers equal fp32 plain's and bf16 plain's. `--compiled` adds `float32@compiled`: the fp32 model's
methods on saved graphs (what compile mode auto loads once they are built), with the budget fitted
to the eager fp32 step as `generate` does; a graph built during a call is not timed (bench's rule).
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from medusa_decoding.bench.methods import backend_method, engine_method
from medusa_decoding.bench.prompts import load_suite, select
from medusa_decoding.engine import MedusaModel
from medusa_decoding.verifiers.compiled import CompiledBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1, help="Spec-Bench prompts per category")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compiled", action="store_true", help="also fp32 on saved compiled graphs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models, methods = {}, {}
    for dtype in ("bfloat16", "float32"):
        model = MedusaModel.from_pretrained(heads="shipped", ngram=True, compile="off", exact=False,
                                            calibration="shipped", dtype=dtype)
        print(dtype, model.fit_to_machine().line, flush=True)
        model.generate("Hello", max_new_tokens=16)  # warm up both paths
        model.generate("Hello", max_new_tokens=16, use_medusa=False)
        models[dtype] = model
        for kind in ("plain", "default"):
            methods[f"{dtype}/{kind}"] = engine_method(model, kind == "default", 0.0)
    if args.compiled:
        graphs = CompiledBackend(models["float32"].base, freeze=False)
        for kind in ("plain", "default"):
            methods[f"float32@compiled/{kind}"] = backend_method(graphs, methods[f"float32/{kind}"])
    rows = []
    for prompt in select(load_suite("spec-bench"), args.limit, 1):
        row = {}
        for key, run in methods.items():
            input_ids = models[key.split("/")[0].split("@")[0]].encode(prompt.turns[0])
            turn = run(input_ids, args.max_new_tokens, 0)
            row[key] = (len(turn.token_ids) / turn.wall_s, turn.token_ids, turn.accepted_lengths)
        rows.append(row)
        print(prompt.id, prompt.category, {k: round(v[0], 1) for k, v in row.items()}, flush=True)
    for key in rows[0]:
        tps = statistics.median(r[key][0] for r in rows)
        ratio = statistics.median(r[key][0] / r["bfloat16/plain"][0] for r in rows)
        steps = [n for r in rows for n in r[key][2]]
        same = {ref: sum(r[key][1] == r[f"{ref}/plain"][1] for r in rows) for ref in models}
        print(f"{key:24s} {tps:6.1f} tok/s  {ratio:5.2f}x bf16 plain  tau {sum(steps) / len(steps):4.2f}  "
              f"identical to fp32 plain {same['float32']}/{len(rows)}, to bf16 plain {same['bfloat16']}/{len(rows)}")


if __name__ == "__main__":
    main()
