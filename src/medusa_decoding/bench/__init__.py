"""`medusa bench`: decoding methods side by side on the same prompts -> results.json, report.md, plots.

Five parts, each testable alone (one file each):
1. prompts: Spec-Bench-shaped JSONL, HumanEval's prompts or held-out ShareGPT turns -> [Prompt]
2. methods: `plain` / `medusa[:tree]` (our engine) and `hf` / `hf-pld` (transformers generate);
   `run_method` asks one method every turn of one prompt -> a Record
3. summary: pure arithmetic over Records: medians, per-prompt speed-up ratios, token identity
4. report: results.json, report.md, PNG plots, the overall table
5. batch (with --batch-sizes): plain vs medusa under continuous batching at each batch size B
   (batch.BatchDecoder, greedy, first turns) -> throughput, latency, speed-up, token identity

Speed-ups are medians of per-prompt ratios, each ratio taken within one prompt and one repeat
round (methods run interleaved, so a machine that drifts slows every method of a round alike).
"mean accepted length" counts tokens per verification step, bonus token included.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ..config import MedusaError

from .batch import BatchRun, batch_inputs, run_batch_bench, run_batched, summarize_batch, parse_batch_sizes
from ..spec import EXACT
from .config import BASELINE, DEFAULT_METHODS, PLD_TOKENS, REFERENCE, WARMUP_TOKENS, BenchConfig
from .methods import build_methods, run_method
from .records import Generate, Record
from .prompts import BUILTIN, SUITES, Prompt, load_jsonl_prompts, load_suite, select
from .report import (BATCH_HEADER, OVERALL_HEADER, batch_identity_line, batch_table_rows, fitted_line, identity_line, machine_info,
                     method_row, text_table, write_plots, write_report, validity_line, grammar_line)
from .summary import first_difference, fitted_vs_shipped, identity_check, identity_reference, per_prompt_speedups, summarize

log = logging.getLogger("medusa_decoding.bench")


# the run ---------------------------------------------------------------------------------------

def run_bench(cfg: BenchConfig) -> dict:
    """Run every method on every prompt, interleaved, then (with batch sizes) the batched runs;
    write the outputs; return the results."""
    if cfg.prompts:
        prompts = load_jsonl_prompts(Path(cfg.prompts))
    else:
        prompts = load_suite(cfg.suite or BUILTIN, cfg.limit)
    prompts = select(prompts, cfg.limit, cfg.turns)
    if not prompts:
        raise MedusaError("no prompt to run")
    model, methods, default = build_methods(cfg)
    unconstrained = [name for name, g in methods.items() if not getattr(g, "constrains", False)]
    if any(p.schema is not None for p in prompts) and unconstrained:
        raise MedusaError(f"these prompts carry JSON schemas, which {', '.join(unconstrained)} cannot decode under: "
                          "use this engine's methods (plain, default, ...)")
    if any(p.schema is not None for p in prompts) and cfg.batch_sizes:
        raise MedusaError("the batched runs do not take schemas: drop --batch-sizes")
    out = Path(cfg.out or Path("bench_out") / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    results = {"config": asdict(cfg) | {"out": str(out)}, "machine": machine_info(model), "prompts": len(prompts)}
    if methods:
        try:
            results |= compare_methods(cfg, model, methods, prompts)
        finally:  # methods that run another engine in its own process (vLLM) end it
            for generate in methods.values():
                getattr(generate, "close", lambda: None)()
    if cfg.batch_sizes:
        results["batch"] = run_batch_bench(cfg, model, default, prompts)
    results["plots"] = write_plots(out, results)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_report(out / "report.md", results)

    if methods:
        rows = [[m] + method_row(results["summary"]["overall"][m], results["identity"].get(m)) for m in methods]
        print(text_table(OVERALL_HEADER, rows))
        print(identity_line(results["identity"]))
        if results.get("validity"):
            print(validity_line(results["validity"]))
        if results.get("grammar_ms_per_step"):
            print(grammar_line(results["grammar_ms_per_step"]))
        if results["fitted_vs_shipped"]:
            print(fitted_line(results["fitted_vs_shipped"]))
    if cfg.batch_sizes:
        print(text_table(BATCH_HEADER, batch_table_rows(results["batch"]["rows"])))
        print(batch_identity_line(results["batch"]))
    log.info("wrote %s: results.json, report.md, %s", out, ", ".join(results["plots"]) or "no plot")
    return results


def compare_methods(cfg: BenchConfig, model, methods: dict[str, Generate], prompts: list[Prompt]) -> dict:
    """Every method on every prompt, interleaved -> the per-prompt part of results.json."""
    from tqdm import tqdm

    warm = Prompt(prompts[0].id, prompts[0].category, prompts[0].turns[:1], prompts[0].chat)
    for name, generate in methods.items():  # first calls pay one-off costs (allocations, kernels)
        run_method(name, generate, model, warm, min(cfg.max_new_tokens, WARMUP_TOKENS), seed=cfg.seed)
    records = []
    with tqdm(total=len(prompts) * cfg.repeats * len(methods), desc="bench", unit="gen", file=sys.stderr) as bar:
        for i, prompt in enumerate(prompts):
            for repeat in range(cfg.repeats):
                for name, generate in methods.items():  # interleaved: drift hits every method alike
                    seed = cfg.seed + 1_000_003 * repeat + i
                    records.append(run_method(name, generate, model, prompt, cfg.max_new_tokens, repeat, seed))
                    bar.update()

    names = list(methods)
    categories = list(dict.fromkeys(p.category for p in prompts))
    compiled = model.backend.stats()
    if cfg.temperature > 0:
        identity = {m: {"skipped": "sampling (temperature > 0): outputs are not expected to match"}
                    for m in names if m != REFERENCE}
    else:
        identity = {m: identity_check(records, m, identity_reference(m, names))
                    for m in names if identity_reference(m, names) not in (m, None)}
    return {"methods": names, "categories": categories, "summary": summarize(records, names, categories),
            "fitted_vs_shipped": fitted_vs_shipped(records, names),
            "engine": compiled,
            # the @compiled methods' backend (its graphs), when any ran
            "compiled_engine": next((g.backend.stats() for g in methods.values()
                                     if hasattr(g, "backend") and g.backend.compiled), None),
            "identity": identity, "validity": validity(records, names), "grammar_ms_per_step": grammar_cost(records, names),
            "records": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in records]}


def grammar_cost(records: list[Record], names: list[str]) -> dict[str, float]:
    """Per method that decoded under grammars in our engine: milliseconds in the grammar per step
    (the prefill counted as one), over its records."""
    out = {}
    for name in names:
        timed = [r for r in records if r.method == name and r.grammar_s is not None and r.accepted_lengths is not None]
        if timed:
            steps = sum(len(r.accepted_lengths) + len(r.token_ids) for r in timed)
            out[name] = 1000 * sum(r.grammar_s for r in timed) / max(steps, 1)
    return out


def validity(records: list[Record], names: list[str]) -> dict[str, dict[str, int]]:
    """Per method, answers valid under their prompt's schema (empty where no prompt has one)."""
    out = {}
    for name in names:
        checked = [r.valid for r in records if r.method == name and r.valid is not None]
        if checked:
            out[name] = {"valid": sum(checked), "checked": len(checked)}
    return out
