"""Fit the tree to the heads and the hardware.

Glossary: K heads, R ranks measured per head (10), n tree nodes (root included).

1. accuracy: how often rank r of head k is the token the base model emits k+1 steps later,
   on the base model's own greedy answers to calibration prompts (Medusa's measurement);
2. latency: t(n) / t(1), the cost of verifying n tokens at once on this device and dtype;
3. trees: for every size, the tree that maximises the expected accepted length, by greedy
   expansion on the product of accuracies along a path (Medusa's method). Greedy expansion
   is optimal here: a path's score never exceeds its parent's, so the best frontier node is
   always addable, and the n best paths form a tree. Sequoia's dynamic program earns its
   cost only with position-dependent acceptance, which these marginal accuracies do not have;
4. choose n maximising expected accepted length / cost and save it with the whole curve.
"""

from __future__ import annotations

import functools
import heapq
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .config import NgramConfig
from .costs import BUDGETS, interpolate, measure, timed
from .drafters import keep_order
from .proposers import ACCEPTANCE_NAME, Drafter, Proposer, chain_settings
from .proposers.ngram import agreed, lookup
from .tree import build_tree
from .verifiers.transformers import TransformersVerifier

RANKS = 10
PROMPTS = 24  # calibration prompts (`medusa calibrate --limit`)
ANSWER_TOKENS = 128  # tokens of each calibration answer
SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


@dataclass
class Calibration:
    # [K, R] accuracy[k][r]: P(rank r of head k+1 is the token emitted k+2 steps later)
    accuracy: list[list[float]]
    # verification latency relative to one token, by tree size
    latency: dict[int, float]
    heads_cost: list[float]  # heads_cost[k-1]: time of the first k heads, relative to a one-token step
    curve: list[dict] = field(default_factory=list)  # n, paths, expected tau, cost, speed-up
    best: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"paths": self.best["paths"], "best": {k: v for k, v in self.best.items() if k != "paths"},
                "accuracy": self.accuracy, "latency": self.latency, "heads_cost": self.heads_cost,
                "curve": [{k: v for k, v in c.items() if k != "paths"} for c in self.curve]}


@torch.no_grad()
def head_accuracy(model, heads, sequences: list[tuple[int, torch.Tensor]], ranks: int = RANKS) -> list[list[float]]:
    """sequences: (prompt_len, ids [T]) of prompts followed by the base model's greedy answer.
    One forward per sequence gives every position's hidden state; head k at position t is
    scored against token t+k+1 (the answer's tokens only)."""
    k_heads = heads.num_heads
    hits = torch.zeros(k_heads, ranks)
    count = torch.zeros(k_heads)
    lm_head = model.get_output_embeddings()
    for prompt_len, ids in sequences:
        hidden = model.get_decoder()(input_ids=ids[None].to(model.device)).last_hidden_state[0]  # [T, D]
        top = heads(hidden[prompt_len - 1 :], lm_head).topk(ranks, dim=-1).indices.cpu()  # [K, T', R]
        for k in range(k_heads):
            target = ids[prompt_len + k + 1 :]  # head k+1 at position t guesses token t+k+2
            guesses = top[k, : len(target)]  # [T'', R]
            hits[k] += (guesses == target[:, None]).float().sum(0)
            count[k] += len(target)
    return (hits / count.clamp(min=1)[:, None]).tolist()


def best_trees(accuracy: list[list[float]], max_nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """Greedy expansion: the max_nodes - 1 paths of highest joint accuracy, in the order added,
    each with its score (the probability the path is accepted under independence)."""
    k_heads, ranks = len(accuracy), len(accuracy[0])
    frontier = [(-accuracy[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(frontier)
    chosen = []
    while frontier and len(chosen) < max_nodes - 1:
        neg, path = heapq.heappop(frontier)
        chosen.append((path, -neg))
        if len(path) < k_heads:
            for r in range(ranks):
                heapq.heappush(frontier, (neg * accuracy[len(path)][r], path + (r,)))
    return chosen


def verify_latency(backend, sizes=SIZES, prefix_len: int = 256, repeats: int = 9) -> dict[int, float]:
    """t(n) / t(1): median wall time of one verification step of n tree tokens after a prefix of
    prefix_len cached tokens, through the verifier the engine uses (backend: a verifiers backend),
    sizes interleaved so drift hits all alike (costs.measure, without a drafter)."""
    return measure(backend, None, sorted(set(sizes) | {1}), (), repeats, prefix=prefix_len)[1]


@torch.inference_mode()
def heads_latency(backend, heads, repeats: int = 20) -> list[float]:
    """The heads' time per step when the first k heads run (k = 1..K; a tree of depth d runs
    d heads), relative to a one-token verification step; measured, because on a CPU the
    heads' vocabulary projections are a visible part of a step."""
    model, device = backend.model, backend.device
    hidden = torch.randn(model.config.get_text_config().hidden_size, device=device, dtype=model.dtype)
    lm_head = model.get_output_embeddings()
    verifier = TransformersVerifier(backend)
    row, _, _ = verifier.add(torch.zeros(8, dtype=torch.long, device=device), 2)
    root, one = torch.zeros(1, dtype=torch.long, device=device), build_tree([]).to(device)
    t_heads: list[list[float]] = [[] for _ in range(heads.num_heads)]
    t_step = []
    for _ in range(repeats):
        for k in range(heads.num_heads):
            t_heads[k].append(timed(lambda: heads(hidden, lm_head, num_heads=k + 1).topk(RANKS, dim=-1), device))
        t_step.append(timed(lambda: verifier.verify([row], [root], [one]), device))
    verifier.release(row)
    step = statistics.median(t_step)
    return [statistics.median(t) / step for t in t_heads]


def fit(accuracy, latency: dict[int, float], heads_cost: list[float]) -> Calibration:
    """Expected tau, cost and speed-up for every tree size; the best one is kept. A tree's
    cost is its verification plus the heads its depth needs."""
    chosen = best_trees(accuracy, max(latency))
    curve = []
    for n in sorted(latency):
        paths = [p for p, _ in chosen[: n - 1]]
        tau = 1.0 + sum(score for _, score in chosen[: n - 1])
        depth = max((len(p) for p in paths), default=0)
        cost = interpolate(latency, n) + (heads_cost[depth - 1] if depth else 0.0)
        curve.append({"n": n, "paths": paths, "expected_tau": tau, "cost": cost, "expected_speedup": tau / cost})
    best = max(curve, key=lambda c: c["expected_speedup"])
    return Calibration(accuracy=accuracy, latency=latency, heads_cost=heads_cost, curve=curve, best=best)


def save(calibration: Calibration, out: Path) -> None:
    out.write_text(json.dumps(calibration.to_json(), indent=1) + "\n")


def calibration_prompts(path: Path | None, limit: int = PROMPTS) -> list[str]:
    """First user turns: from a JSONL file (Spec-Bench's "turns", or "prompt"), or by default
    from held-out ShareGPT conversations (never the benchmark's own questions)."""
    from collections import Counter

    from .config import MedusaError
    from .data import conversations

    if path is None:
        counts: Counter = Counter()
        texts = []
        for _, messages in conversations("sharegpt", counts, split="eval"):
            first = next(m["content"] for m in messages if m["role"] == "user")
            if first.strip() and len(first) < 2000:
                texts.append(first)
            if len(texts) == limit:
                break
        return texts
    if not Path(path).is_file():
        raise MedusaError(f"prompts file {path} does not exist")
    texts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text = record["turns"][0] if "turns" in record else record["prompt"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise MedusaError(f"{path}:{n}: expected a JSON object with 'turns' or 'prompt'") from None
        texts.append(text)
        if len(texts) == limit:
            break
    if not texts:
        raise MedusaError(f"{path} holds no prompts")
    return texts


# Path-aware drafters (hydra, eagle): acceptance by budget ------------------------------------------
# EAGLE-2's rule keeps the b - 1 best-scored nodes of one candidate set whatever b is, and a child
# scores below its parent: the b-node tree is the top of the 32-node one. So one greedy run at the
# largest budget tells, for every smaller budget, how many of each step's accepted nodes it kept.
# The n-gram chain is counted the same way, from the answer once it is known: under the root beside
# the tree, it would have been accepted as far as it matches what the base emitted after the root,
# and the step keeps the longer of the two branches (the largest budget's steps); the copy steps
# that follow a step the chain won are counted from the answer too (without them the figures
# tell the fit that a short chain never pays, and it switches a paying branch off); the chain
# alone is decoded over the answer.


class _Recorder(Proposer):
    """A row's proposer at the largest budget, counting per budget the accepted nodes it would keep."""

    def __init__(self, inner: Proposer, budgets: list[int], counts: dict):
        self.inner, self.budgets, self.counts = inner, budgets, counts
        self.depth_limit = inner.depth_limit
        self.rank: torch.Tensor | None = None  # [N] each node's rank by score (root: -1)
        self.context: list[int] = []  # prompt and emitted tokens, the root last
        self.steps: list[tuple[int, dict[int, int]]] = []  # (context length at propose, budget -> kept)

    def start(self, prompt):
        self.context = prompt.tolist()
        self.inner.start(prompt)

    def propose(self, root, budget=None):
        p = self.inner.propose(root, max(self.budgets))
        self.rank = None
        if p is not None and p.score is not None:
            order = keep_order(p.score[1:], p.tree.depth[1:]).argsort(descending=True)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(len(order), device=order.device)
            self.rank = torch.cat([rank.new_full((1,), -1), rank])
        return p

    def observe(self, hidden, next_tokens, nodes):
        if nodes is not None:
            kept = self.rank[nodes[1:]] if self.rank is not None else torch.zeros(0)  # [A - 1] accepted nodes' ranks
            step = {b: int((kept < b - 1).sum()) for b in self.budgets}
            for b, n in step.items():
                self.counts[b] += n
            self.counts["steps"] += 1
            self.steps.append((len(self.context), step))
        self.context += (next_tokens[-1:] if nodes is None else next_tokens).tolist()
        self.inner.observe(hidden, next_tokens, nodes)

    def chain_gain(self, config: NgramConfig) -> dict[int, float]:
        """Once the answer is complete: budget -> tokens a step gains from the n-gram branch of
        `config` beside the tree, on average over this answer. A budget >= 2 keeps its steps of this
        run (their starts are where the drafter stopped) and the longer of its tree and the chain at
        each; after a step the chain won with copy_run tokens or more, copy steps follow as the
        branch runs them (the copy chain alone, each counted as one step, while they accept
        copy_run or more), and the recorded steps they pass over are left out; so are the recorded
        steps a chain went past when it accepted more than the recorded step did (counted again, they
        would overstate a long chain's gain). Budget 1, the chain alone, is decoded over the answer as it
        would have gone (each step advances by its match + 1)."""
        context = np.asarray(self.context, dtype=np.int64)

        def match(at: int, length: int) -> int | None:  # chain tokens the base accepts after the root at `at` - 1
            chain = lookup(context[:at], config, length)
            return None if chain is None else agreed(chain, context[at:])

        @functools.cache
        def copies(at: int) -> tuple[int, int, int]:  # copy steps from `at` -> (steps, tokens, where they end)
            steps = tokens = 0
            while at < len(context) and (found := match(at, config.copy_chain)) is not None:
                steps, tokens, at = steps + 1, tokens + found + 1, at + found + 1
                if not config.copies_after(found):
                    break
            return steps, tokens, at

        def copying_after(found: int, kept: int) -> bool:  # the chain won the step, and enough of it for copy steps
            return config.copies_after(found) and found > kept

        out = dict.fromkeys(self.budgets, 0.0)
        if self.steps:
            founds = [match(at, config.length) or 0 for at, _ in self.steps]
            largest = max(self.budgets)  # the recorded run's budget: its steps kept every accepted node
            for b in out:
                steps = tokens = plain = 0
                until = 0  # the recorded steps before this position were passed over (by the chain or copy steps)
                for (at, step), found in zip(self.steps, founds):
                    plain += step[b] + 1
                    if at < until:
                        continue
                    steps, tokens = steps + 1, tokens + max(step[b], found) + 1
                    if copying_after(found, step[b]):
                        n, got, until = copies(at + found + 1)
                        steps, tokens = steps + n, tokens + got
                    elif found > step[largest]:  # the chain went past where the recorded run's next step starts
                        until = at + found + 1
                out[b] = tokens / steps - plain / len(self.steps)
            at, steps, tokens = self.steps[0][0], 0, 0
            while at < len(context):
                found = match(at, config.length) or 0
                steps, tokens, at = steps + 1, tokens + found + 1, at + found + 1
                if copying_after(found, 0):
                    n, got, at = copies(at)
                    steps, tokens = steps + n, tokens + got
            out[1] = tokens / steps - 1
        return out


class _Recording(Drafter):
    def __init__(self, drafter: Drafter, budgets: list[int], counts: dict):
        self.inner, self.budgets, self.counts = drafter, budgets, counts
        self.kind, self.weights, self.feature_layers = drafter.kind, drafter.weights, drafter.feature_layers
        self.made: list[_Recorder] = []

    def proposer(self) -> Proposer:
        self.made.append(_Recorder(self.inner.proposer(), self.budgets, self.counts))
        return self.made[-1]

    def tree_sizes(self) -> set[int]:
        return {max(self.budgets)}


def chained_tau(tau: dict[int, float], gains: dict[int, list[float]]) -> dict[int, float]:
    """tau(b) (budget -> accepted per step) and the chain's gain per prompt (budget -> [tokens a step]; budget 1:
    the chain alone) -> tau(b) with the chain beside the tree."""
    # the chain's gain per prompt, then its mean: the gain comes in bursts, on the answers that copy their
    # prompt (or loop), and a throughput is a mean: the median of such a gain is near zero and would
    # tell the fit that a chain never pays
    return {b: tau.get(b, 1.0) + (statistics.fmean(g) if g else 0.0) for b, g in gains.items()}


def record_acceptance(model, inputs: list[torch.Tensor], max_new_tokens: int, budgets,
                      progress=None) -> tuple[dict[int, float], list[_Recorder], int]:
    """model: a MedusaModel holding a hydra/eagle drafter; inputs: input_ids [1, T] each, decoded greedily
    with the drafter alone at the largest budget -> ({budget: mean accepted length per step, bonus
    included}, one recorder a prompt (its steps and answer, for chain_tau), steps)."""
    from .engine import MedusaModel

    budgets = sorted(budgets)
    counts = dict.fromkeys(budgets, 0) | {"steps": 0}
    recording = _Recording(model.drafter, budgets, counts)
    runner = MedusaModel(model.base, model.tokenizer, heads=recording, backend=model.backend)
    for i, ids in enumerate(inputs):
        runner.generate(ids, max_new_tokens=max_new_tokens)
        if progress:
            progress(i + 1)
    steps = max(counts["steps"], 1)
    return {b: 1.0 + counts[b] / steps for b in budgets}, recording.made, counts["steps"]


def chain_tau(tau: dict[int, float], recorders: list[_Recorder], ngram: NgramConfig) -> dict[int, float]:
    """record_acceptance's tau and recorders -> tau(b) with the n-gram branch of `ngram` beside each
    tree (budget 1: the chain alone), its gain counted from the same steps, copy steps included."""
    gains = {b: [] for b in [1, *tau]}
    for recorder in recorders:
        if recorder.steps:
            for b, gain in recorder.chain_gain(ngram).items():
                gains[b].append(gain)
    return chained_tau(tau, gains)


def acceptance_curve(model, inputs: list[torch.Tensor], max_new_tokens: int = ANSWER_TOKENS, budgets=BUDGETS,
                     progress=None, ngram: NgramConfig | None = None) -> dict:
    """model: a MedusaModel holding a hydra/eagle drafter; inputs: input_ids [1, T] each ->
    {"expected_tau": {budget: mean accepted length per step, bonus included}, "steps", ...}:
    greedy, the drafter alone (no n-gram branch), every prompt decoded at the largest budget.
    ngram: also "expected_tau_ngram", the same with an n-gram chain of its length beside each tree
    (budget 1: the chain alone): tau(b) plus the chain's gain counted from the same steps (its copy
    steps included), the mean over prompts (default: NgramConfig())."""
    ngram = ngram or NgramConfig()
    tau, recorders, steps = record_acceptance(model, inputs, max_new_tokens, budgets, progress)
    return {"expected_tau": tau,
            "expected_tau_ngram": chain_tau(tau, recorders, ngram),
            "ngram": chain_settings(ngram), "steps": steps, "prompts": len(inputs),
            "max_new_tokens": max_new_tokens,
            "drafted_at_budget": max(budgets), "dtype": str(model.base.dtype).removeprefix("torch."),
            "data": "first user turns of held-out ShareGPT conversations, greedy"}


def save_acceptance(result: dict, folder: Path) -> None:
    (folder / ACCEPTANCE_NAME).write_text(json.dumps(result, indent=1) + "\n")


# Path-aware drafters (hydra, eagle): the end-to-end grid ---------------------------------------------
# Their cost is sequential: one drafter call per depth, inside the step. Rather than model it,
# measure it: generate with each drafting setting, interleaved with plain decoding prompt by
# prompt, and keep the setting with the best median speed-up.

DRAFT_GRID = tuple((depth, width, budget) for depth in (3, 4, 5, 6) for width in (4,) for budget in (6, 8, 12, 16))


def fit_drafter(model, inputs: list[torch.Tensor], max_new_tokens: int = ANSWER_TOKENS, grid=DRAFT_GRID,
                progress=None) -> dict:
    """model: a MedusaModel holding a hydra/eagle drafter (and its n-gram branch, if any, as
    generate runs it); inputs: input_ids [1, T] each.
    -> {"grid": [{depth, width, budget, median_speedup, mean_accepted_length, tokens_per_s}], "best": ...}.
    Greedy; each prompt runs plain once, then every setting (a first warm-up prompt is dropped)."""
    from . import proposers
    from .engine import MedusaModel

    def run(module, prompt):
        if module is None:
            return model.generate(prompt, max_new_tokens=max_new_tokens, use_medusa=False).stats
        variant = MedusaModel(model.base, model.tokenizer, heads=proposers.wrap(module, model.base),
                              ngram=model.ngram, backend=model.backend)
        return variant.generate(prompt, max_new_tokens=max_new_tokens).stats

    drafter, cfg = model.heads, model.heads.config
    if drafter.max_depth is not None:  # e.g. hydra: one depth per head
        grid = tuple(dict.fromkeys((min(d, drafter.max_depth), w, b) for d, w, b in grid))
    saved = (cfg.draft_depth, cfg.draft_width, cfg.draft_budget)
    ratios: dict[tuple, list[float]] = {g: [] for g in grid}
    taus: dict[tuple, list[float]] = {g: [] for g in grid}
    speeds: dict[tuple, list[float]] = {g: [] for g in grid}
    try:
        for i, prompt in enumerate(inputs):
            plain = run(None, prompt)
            for g in grid:
                cfg.draft_depth, cfg.draft_width, cfg.draft_budget = g
                stats = run(drafter, prompt)
                if i == 0 and len(inputs) > 1:
                    continue  # warm-up
                ratios[g].append(stats.tokens_per_s / plain.tokens_per_s)
                taus[g].append(stats.mean_accepted_length)
                speeds[g].append(stats.tokens_per_s)
            if progress:
                progress(i + 1)
    finally:
        cfg.draft_depth, cfg.draft_width, cfg.draft_budget = saved
    rows = [{"depth": d, "width": w, "budget": b, "median_speedup": statistics.median(ratios[(d, w, b)]),
             "mean_accepted_length": statistics.fmean(taus[(d, w, b)]),
             "tokens_per_s": statistics.median(speeds[(d, w, b)])} for d, w, b in grid]
    return {"grid": rows, "best": max(rows, key=lambda r: r["median_speedup"]), "prompts": len(inputs),
            "max_new_tokens": max_new_tokens}


def save_drafter_fit(fit_result: dict, folder: Path) -> None:
    """Write the best setting into the drafter's config.json and the whole grid beside it."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    best = fit_result["best"]
    config.update(draft_depth=best["depth"], draft_width=best["width"], draft_budget=best["budget"])
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (folder / "calibration.json").write_text(json.dumps(fit_result, indent=1) + "\n")
