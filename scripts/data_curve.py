"""Held-out top-1 per depth against data size: a markdown table of training runs.

    python scripts/data_curve.py runs/curve/hydra-500 runs/curve/hydra-1000 runs/curve/eagle3-1000

Each run folder holds metrics.json (held-out top-1 / top-5 per head or unrolled pass),
train_config.json and log.jsonl (the last logged training top-1: the training vs held-out gap).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(folder: Path) -> str:
    metrics = json.loads((folder / "metrics.json").read_text())
    cfg = json.loads((folder / "train_config.json").read_text())
    log = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines() if line.strip()]
    ev = metrics["eval"]
    kind = cfg["drafter"] + (f" ({cfg['recipe']}, {cfg['unroll']} passes)" if cfg["drafter"] == "eagle" else "")
    held = " / ".join(f"{x:.3f}" for x in ev["top1"])
    train = " / ".join(f"{x:.2f}" for x in log[-1]["top1"]) if log else "-"
    gap = f"{log[-1]['top1'][0] - ev['top1'][0]:+.2f}" if log else "-"
    return (f"| {kind} | {cfg['max_conversations'] or 'all'} | {cfg['epochs']:g} | {held} | {train} | {gap} | "
            f"{metrics['steps']} | {ev['positions'][0]} |")


def main(folders: list[str]) -> None:
    print("| drafter | conversations | epochs | held-out top-1 by depth | training top-1 (last batch) "
          "| gap at depth 1 | steps | held-out positions |")
    print("|---|---|---|---|---|---|---|---|")
    for f in folders:
        if (Path(f) / "metrics.json").is_file():
            print(row(Path(f)))


if __name__ == "__main__":
    main(sys.argv[1:])
