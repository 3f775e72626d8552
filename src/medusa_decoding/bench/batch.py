"""5. throughput vs batch size (with --batch-sizes): plain vs default under continuous batching
at each batch size B (engine.Decoder, greedy, first turns) -> throughput, latency, speed-up, identity."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import GenerationConfig, MedusaError, SamplingConfig
from .config import WARMUP_TOKENS, BenchConfig
from .records import sync
from .prompts import Prompt
from .summary import _token_at, first_difference

log = logging.getLogger("medusa_decoding.bench")


# 5. throughput vs batch size -------------------------------------------------------------------

BATCH_METHODS = ("plain", "default")  # interleaved in this order at every batch size
BATCH_HEADER = ["batch", "plain tok/s", "default tok/s", "speed-up", "plain latency s", "default latency s", "tau",
                "identical"]
BATCH_PLOT = "throughput_vs_batch.png"


def parse_batch_sizes(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4], sorted, duplicates dropped; anything but integers >= 1 is an error."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise MedusaError(f"--batch-sizes takes comma-separated integers >= 1 (e.g. 1,2,4,8,16), got {text!r}")
    return sorted(set(sizes))


@dataclass
class BatchRun:
    """One method decoding every prompt with continuous batching at one batch size, one repeat round."""

    method: str
    batch_size: int
    repeat: int
    wall_s: float  # first add() to the last sequence's finish
    token_ids: list[list[int]]  # per prompt, in prompt order; up to and including the first EOS
    latency_s: list[float]  # per prompt: from its add() to its finish (queueing for a slot excluded)
    accepted_lengths: list[int] = field(default_factory=list)  # tokens per step, every sequence, bonus included

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def batch_inputs(model, prompts: list[Prompt]) -> list[torch.Tensor]:
    """The first turn of every prompt -> input_ids [T] each (chat template where the prompt is a chat)."""
    chat = model.tokenizer.chat_template is not None
    return [(model.encode([{"role": "user", "content": p.turns[0]}]) if p.chat and chat
             else model.encode(p.turns[0], chat=False))[0] for p in prompts]


def run_batched(model, method: str, inputs: list[torch.Tensor], batch_size: int, max_new_tokens: int,
                repeat: int = 0, policy=None) -> BatchRun:
    """Greedy-decode every input with a decoder kept full: all are submitted at once, a sequence
    joins as soon as a place frees up. method "plain" or "default" (the model's method; policy:
    its load policy, e.g. one engine.AdaptiveSpeculation kept across runs as a server keeps it;
    None: the method's own budget at every step)."""
    from ..engine import Request

    speculative = method == "default"
    decoder = model.decoder(batch_size, use_medusa=speculative, policy=policy)
    generation, greedy = GenerationConfig(max_new_tokens=max_new_tokens), SamplingConfig()
    pending = list(enumerate(inputs))
    tokens: dict[int, list[int]] = {}
    started, latency, lengths = {}, {}, []

    def collect(outputs) -> None:
        now = time.perf_counter()  # add() and step() end on a .tolist(): the device is synchronized
        for out in outputs:
            tokens[out.id] += out.tokens
            if out.finished:
                latency[out.id] = now - started[out.id]
                lengths.extend(out.stats.accepted_lengths)

    sync(model.device)
    t0 = time.perf_counter()
    while pending or len(decoder):
        while pending and decoder.has_room:
            i, ids = pending.pop(0)
            tokens[i], started[i] = [], time.perf_counter()
            collect([decoder.add(Request(ids, generation, greedy, id=i))])
        collect(decoder.step())
    sync(model.device)
    wall = time.perf_counter() - t0
    order = range(len(inputs))
    return BatchRun(method, batch_size, repeat, wall, [tokens[i] for i in order], [latency[i] for i in order], lengths)


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def batch_identity(reference: BatchRun | None, run: BatchRun | None, prompt_ids: list[str] | None = None) -> dict:
    """Per-prompt token identity of `run` vs `reference` -> {compared, differ, first mismatch}."""
    if reference is None or run is None:
        return {"compared": 0, "differ": 0, "first": None}
    compared, differ, first = 0, 0, None
    for i, (ours, theirs) in enumerate(zip(reference.token_ids, run.token_ids)):
        compared += 1
        where = first_difference([ours], [theirs])
        if where is not None:
            differ += 1
            if first is None:
                index = where[1]
                first = {"prompt": prompt_ids[i] if prompt_ids else str(i), "index": index,
                         "reference_token": _token_at([ours], 0, index), "token": _token_at([theirs], 0, index)}
    return {"compared": compared, "differ": differ, "first": first}


def summarize_batch(runs: list[BatchRun], prompt_ids: list[str] | None = None) -> list[dict]:
    """One row per batch size: each method's medians over repeat rounds (throughput = all new
    tokens / wall time of the run; latency = the run's median per-sequence latency), medusa's
    speed-up (median of per-round ratios, as for prompts), token identity of default vs plain per
    prompt (first round)."""
    rows = []
    for size in sorted({r.batch_size for r in runs}):
        mine = [r for r in runs if r.batch_size == size]
        row: dict = {"batch_size": size}
        for method in BATCH_METHODS:
            rs = [r for r in mine if r.method == method]
            lengths = [n for r in rs for n in r.accepted_lengths]
            row[method] = {"runs": len(rs), "tokens_per_s": _median([r.tokens_per_s for r in rs]),
                           "wall_s": _median([r.wall_s for r in rs]), "new_tokens": _median([r.new_tokens for r in rs]),
                           "latency_s": _median([float(np.median(r.latency_s)) for r in rs if r.latency_s]),
                           "mean_accepted_length": sum(lengths) / len(lengths) if lengths else None}
        plain = {r.repeat: r for r in mine if r.method == "plain"}
        ratios = [r.tokens_per_s / plain[r.repeat].tokens_per_s for r in mine
                  if r.method == "default" and r.repeat in plain and plain[r.repeat].tokens_per_s > 0]
        row["speedup"] = _median(ratios)
        first_round = {r.method: r for r in mine if r.repeat == 0}
        row["identity"] = batch_identity(first_round.get("plain"), first_round.get("default"), prompt_ids)
        rows.append(row)
    return rows


def run_batch_bench(cfg: BenchConfig, model, default, prompts: list[Prompt]) -> dict:
    """Every batch size, plain then default (the `default` MedusaModel), `repeats` rounds -> the
    "batch" part of results.json."""
    from tqdm import tqdm

    sizes = cfg.batch_sizes or []
    inputs = batch_inputs(model, prompts)
    if max(sizes) > len(inputs):
        log.warning("note: only %d prompts: batches above %d are never full", len(inputs), len(inputs))
    warm = min(max(sizes), len(inputs))
    policy = default.method().adaptive()  # one for the whole bench, as `medusa serve` keeps one
    for method in BATCH_METHODS:  # one-off costs (allocations, kernels) at the largest batch
        run_batched(default, method, inputs[:warm], warm, min(cfg.max_new_tokens, WARMUP_TOKENS), policy=policy)
    runs = []
    with tqdm(total=cfg.repeats * len(sizes) * len(BATCH_METHODS), desc="batch", unit="run", file=sys.stderr) as bar:
        for repeat in range(cfg.repeats):
            for size in sizes:
                for method in BATCH_METHODS:  # interleaved: drift hits both methods alike
                    runs.append(run_batched(default, method, inputs, size, cfg.max_new_tokens, repeat, policy))
                    bar.update()
    rows = summarize_batch(runs, [p.id for p in prompts])
    return {"batch_sizes": sizes, "prompts": len(inputs), "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats,
            "method": default.method().describe(), "dtype": str(model.base.dtype).removeprefix("torch."), "rows": rows,
            "policy": policy.table() if policy else None,
            "identity": {"compared": sum(r["identity"]["compared"] for r in rows),
                         "differ": sum(r["identity"]["differ"] for r in rows)},
            "runs": [{"method": r.method, "batch_size": r.batch_size, "repeat": r.repeat, "wall_s": r.wall_s,
                      "new_tokens": r.new_tokens, "tokens_per_s": r.tokens_per_s, "steps": len(r.accepted_lengths),
                      "latency_s": r.latency_s} for r in runs]}
