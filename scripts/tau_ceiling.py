"""How far the drafted trees reach: accepted length (tau) by tree budget, up to trees no CPU affords,
with n-gram chains of several lengths beside them, by category.

    .venv/bin/python scripts/tau_ceiling.py --suite spec-bench --limit 4 --width 8
    .venv/bin/python scripts/tau_ceiling.py --suite spec-bench --limit 4 --width 4 --heads DIR

On the built-in model, greedy, fp32. Each prompt is decoded once with the drafter at the largest
budget; the smaller budgets and the chains are counted from its steps as `medusa calibrate` counts
them (calibrate.record_acceptance and chain_tau: a budget keeps the best-scored nodes of the largest tree, a chain
the longer of its match and the tree's at each step, copy steps where the setting has them). Tau is
the mean over a category's prompts, and overall the mean over categories. No timing: what the
budget and the chain cost is the machine's (scripts/replay_ngram.py replays settings with it).
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter, defaultdict

import torch

from medusa_decoding import calibrate as cal
from medusa_decoding.bench.prompts import load_suite, select
from medusa_decoding.config import NgramConfig
from medusa_decoding.engine import MedusaModel

BUDGETS = (2, 4, 8, 16, 32, 64, 128)
CHAINS = {  # name -> the n-gram branch's setting ("+copy": copy steps after a chain accepted copy_run tokens)
    "2+copy": NgramConfig(),  # the default
    "8": NgramConfig(length=8, copy_run=0),
    "8+copy": NgramConfig(length=8, copy_run=4),
    "16": NgramConfig(length=16, copy_run=0),
}


@torch.inference_mode()
def measure(model: MedusaModel, texts: list[str], max_new_tokens: int) -> dict:
    """One category's prompts -> {"tau": {budget: tau}, chain name: {budget: tau} (budget 1: the chain
    alone), "accepted": {budget: Counter of tree nodes accepted a step}}."""
    tau, recorders, _ = cal.record_acceptance(model, [model.encode(t) for t in texts], max_new_tokens, BUDGETS)
    out = {"tau": tau} | {name: cal.chain_tau(tau, recorders, chain) for name, chain in CHAINS.items()}
    out["accepted"] = {b: Counter(step[b] for r in recorders for _, step in r.steps) for b in BUDGETS}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="spec-bench", help="spec-bench, sharegpt (held-out first turns) or humaneval")
    ap.add_argument("--limit", type=int, default=4, help="prompts a category (spec-bench), else prompts")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--width", type=int, default=8, help="nodes expanded per depth (the checkpoint's own: 4)")
    ap.add_argument("--heads", default="shipped", help="a hydra/eagle checkpoint (default: the shipped one)")
    args = ap.parse_args()
    model = MedusaModel.from_pretrained("smollm2-135m-instruct", heads=args.heads, ngram=None, compile="off",
                                        exact=False, calibration="shipped", dtype="float32", device="cpu")
    model.drafter.width = args.width
    prompts = select(load_suite(args.suite), args.limit, 1) if args.suite == "spec-bench" else \
        load_suite(args.suite, args.limit)[: args.limit]
    by = defaultdict(list)
    for p in prompts:
        by[p.category].append(p.turns[0])
    rows = {}
    for category, texts in by.items():
        rows[category] = measure(model, texts, args.max_new_tokens)
        print(f"{category}: " + " | ".join(f"{k} " + " ".join(f"{b}:{v:.2f}" for b, v in rows[category][k].items())
                                         for k in ["tau", *CHAINS]), flush=True)
    print(f"\nwidth {args.width}, {len(prompts)} prompts, {args.max_new_tokens} tokens; tau by budget, mean over categories")
    print("| branch | " + " | ".join(str(b) for b in (1, *BUDGETS)) + " |")
    for k in ["tau", *CHAINS]:
        means = {b: statistics.fmean(r[k][b] for r in rows.values()) for b in rows[category][k]}
        print(f"| {'tree alone' if k == 'tau' else 'chain ' + k} | " +
              " | ".join(f"{means[b]:.2f}" if b in means else "-" for b in (1, *BUDGETS)) + " |")
    steps = sum((r["accepted"][BUDGETS[-1]] for r in rows.values()), Counter())
    total = sum(steps.values())
    print(f"tree nodes accepted a step at budget {BUDGETS[-1]}: " +
          " ".join(f"{n}: {steps[n] / total:.2f}" for n in sorted(steps)))
    if len(rows) > 1:
        print("\n| category | tree alone | " + " | ".join(f"chain {k}" for k in CHAINS) + f" | (budget 16 / {BUDGETS[-1]})")
        for category, r in rows.items():
            print(f"| {category} | " + " | ".join(f"{r[k][16]:.2f} / {r[k][BUDGETS[-1]]:.2f}" for k in ["tau", *CHAINS]) + " |")


if __name__ == "__main__":
    main()
