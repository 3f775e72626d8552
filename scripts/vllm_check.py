"""Our Medusa heads served by vLLM, checked end to end on this machine: greedy output and acceptance.

    make vllm                                  # once: vLLM in its own environment (~2 min)
    .venv/bin/python scripts/vllm_check.py --heads DIR --limit 4 -n 96

One interleaved `medusa bench` run on the built-in prompts (--suite to change) of these methods:
plain and medusa:chainK (our engine, the heads drafting a chain of their K top-1 guesses, which is
what vLLM drafts with Medusa heads), vllm (vLLM's plain decoding) and vllm-medusa (the heads
exported with `medusa export --format vllm` and served by vLLM). It then checks, prompt by prompt:
  - vllm-medusa's tokens equal vllm's (vLLM's speculation is lossless) and ours;
  - vLLM's mean accepted length is within --tolerance of ours at the same chain length.
Writes check.json beside the bench's results.json; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from medusa_decoding.bench import run_bench
from medusa_decoding.bench.config import BenchConfig
from medusa_decoding.bench.vllm_methods import medusa_folder, setup_env
from medusa_decoding.config import DEFAULT_MODEL
from medusa_decoding.spec import VLLM, VLLM_MEDUSA


def chain_tree(depth: int, out: Path) -> Path:
    """A tree file of one chain: each depth's top-1 guess under the one before."""
    path = out / f"chain{depth}.json"
    path.write_text(json.dumps({"paths": [[0] * d for d in range(1, depth + 1)]}) + "\n")
    return path


def check(results: dict, ours: str, tolerance: float) -> dict:
    """Per-prompt token identity between the methods, and the two accepted lengths."""
    by = {(r["prompt"], r["method"]): r["token_ids"] for r in results["records"] if r["repeat"] == 0}
    prompts = sorted({p for p, _ in by})
    pairs = {"vllm-medusa = vllm": (VLLM_MEDUSA, VLLM), "vllm = plain": (VLLM, "plain"),
             "vllm-medusa = plain": (VLLM_MEDUSA, "plain"), f"{ours} = plain": (ours, "plain")}
    same = {name: sum(by[(p, a)] == by[(p, b)] for p in prompts) for name, (a, b) in pairs.items()}
    overall = results["summary"]["overall"]
    tau_ours, tau_vllm = overall[ours]["mean_accepted_length"], overall[VLLM_MEDUSA]["mean_accepted_length"]
    return {"prompts": len(prompts), "identical": same, "tau": {ours: tau_ours, VLLM_MEDUSA: tau_vllm},
            "tau_ratio": tau_vllm / tau_ours, "tolerance": tolerance,
            "ok": same["vllm-medusa = vllm"] == len(prompts) and abs(tau_vllm / tau_ours - 1) <= tolerance}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default=None, help="residual Medusa heads (default: the shipped residual ones)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--suite", default=None)
    ap.add_argument("--limit", type=int, default=4, help="prompts per category")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--tolerance", type=float, default=0.10, help="largest relative gap of the accepted lengths")
    ap.add_argument("--out", default="bench_out/vllm-check")
    ap.add_argument("--setup", action="store_true", help="make vLLM's environment first")
    args = ap.parse_args()
    if args.setup:
        print(f"vLLM environment: {setup_env()}", file=sys.stderr)
    heads = medusa_folder(args.heads, args.model)
    depth = json.loads((heads / "config.json").read_text())["medusa_num_heads"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tree = chain_tree(depth, out)
    cfg = BenchConfig(model=args.model, heads=str(heads), suite=args.suite, limit=args.limit, turns=1,
                      max_new_tokens=args.max_new_tokens, methods=f"plain,medusa,{VLLM},{VLLM_MEDUSA}",
                      trees=[str(tree)], out=str(out))
    results = run_bench(cfg)
    report = check(results, f"medusa:{tree.stem}", args.tolerance)
    (out / "check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
