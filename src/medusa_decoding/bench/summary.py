"""3. summary: pure arithmetic over Records: medians, per-prompt speed-up ratios, token identity."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from ..spec import AT_INT8, AT_SHIPPED, COMPILED, EXACT, SERVED, STOCK
from .config import BASELINE, OTHER_ENGINES, REFERENCE
from .records import Record

log = logging.getLogger("medusa_decoding.bench")


# 3. summary (pure) -----------------------------------------------------------------------------

def _spread(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None}
    q1, med, q3 = np.percentile(values, [25, 50, 75]).tolist()
    return {"median": med, "min": min(values), "max": max(values), "q1": q1, "q3": q3}


def per_prompt_speedups(records: list[Record], method: str, reference: str) -> dict[str, float]:
    """{prompt: median over repeats of tokens/s(method) / tokens/s(reference), same prompt and round}."""
    ref = {(r.prompt, r.repeat): r.tokens_per_s for r in records if r.method == reference}
    ratios: dict[str, list[float]] = {}
    for r in records:
        base = ref.get((r.prompt, r.repeat))
        if r.method == method and base:
            ratios.setdefault(r.prompt, []).append(r.tokens_per_s / base)
    return {p: float(np.median(v)) for p, v in ratios.items()}


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(turn, token index) of the first difference between two per-turn token lists, or None."""
    for turn, (x, y) in enumerate(zip(a, b)):
        i = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if i is None and len(x) != len(y):
            i = min(len(x), len(y))
        if i is not None:
            return turn, i
    return None if len(a) == len(b) else (min(len(a), len(b)), 0)


def identity_reference(method: str, names: list[str]) -> str | None:
    """The method whose greedy tokens `method`'s should equal: plain decoding in the same numerics and
    run mode where the run has it (plain@int8@compiled, plain@int8, plain@exact), else plain; None where
    the run has none. plain@int8 and plain@exact are compared with plain: what the mode changes."""
    int8 = AT_INT8 if AT_INT8 in method else ""
    mode = next((m for m in (EXACT, COMPILED, STOCK, SERVED) if method.endswith(m)), "")
    for ref in (REFERENCE + int8 + mode, REFERENCE + int8, REFERENCE):
        if ref in names and ref != method:
            return ref
    return None


def identity_check(records: list[Record], method: str, reference: str = REFERENCE) -> dict:
    """Greedy token identity vs the reference, on the first repeat round of every prompt."""
    ref = {r.prompt: r for r in records if r.method == reference and r.repeat == 0}
    compared, differ, first = 0, 0, None
    for r in records:
        if r.method != method or r.repeat != 0 or r.prompt not in ref:
            continue
        compared += 1
        where = first_difference(ref[r.prompt].token_ids, r.token_ids)
        if where is not None:
            differ += 1
            if first is None:
                turn, index = where
                ours, theirs = ref[r.prompt].token_ids, r.token_ids
                first = {"prompt": r.prompt, "category": r.category, "turn": turn, "index": index,
                         "reference_token": _token_at(ours, turn, index), "token": _token_at(theirs, turn, index)}
    return {"compared": compared, "differ": differ, "first": first, "reference": reference}


def _token_at(token_ids: list[list[int]], turn: int, index: int) -> int | None:
    return token_ids[turn][index] if turn < len(token_ids) and index < len(token_ids[turn]) else None


def summarize_group(records: list[Record], method: str) -> dict:
    """Figures of one method over a group of records (one category, or all)."""
    mine = [r for r in records if r.method == method]
    tps: dict[str, list[float]] = {}
    for r in mine:
        tps.setdefault(r.prompt, []).append(r.tokens_per_s)
    out = {"prompts": len(tps), "tokens_per_s": _spread([float(np.median(v)) for v in tps.values()])}
    for ref in (REFERENCE, BASELINE, *OTHER_ENGINES):
        ratios = list(per_prompt_speedups(records, method, ref).values()) if method != ref else []
        if ref not in OTHER_ENGINES or ratios:  # llama.cpp, vLLM: only in a run that has them
            out[f"speedup_vs_{ref}"] = _spread(ratios)
    lengths = [n for r in mine for n in (r.accepted_lengths or [])]
    if lengths:
        steps = len(lengths)
        depth = [sum(d) for d in zip(*[r.accepted_per_depth for r in mine if r.accepted_per_depth is not None])]
        out["mean_accepted_length"] = sum(lengths) / steps
        out["accepted_length_hist"] = {str(k): v for k, v in sorted(Counter(lengths).items())}
        out["acceptance_per_depth"] = [d / steps for d in depth]
    counted = [r for r in mine if r.steps]
    if not lengths and counted:  # another engine's counts (vLLM): tokens per step that verified a draft
        out["mean_accepted_length"] = sum(r.step_tokens for r in counted) / sum(r.steps for r in counted)
    return out


def fitted_vs_shipped(records: list[Record], methods: list[str]) -> dict[str, dict]:
    """For each method run both fitted to this machine and as shipped (`X` and `X@shipped`): the
    per-prompt ratios of their tokens/s (fitted / shipped), paired within each prompt and round."""
    out = {}
    for m in methods:
        if m + AT_SHIPPED in methods:
            out[m] = _spread(list(per_prompt_speedups(records, m, m + AT_SHIPPED).values()))
    return out


def summarize(records: list[Record], methods: list[str], categories: list[str]) -> dict:
    """{category or "overall": {method: figures}}."""
    groups = {c: [r for r in records if r.category == c] for c in categories} | {"overall": records}
    return {c: {m: summarize_group(rs, m) for m in methods} for c, rs in groups.items()}
