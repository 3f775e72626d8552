"""4. report: results.json, report.md, PNG plots, the tables printed at the end."""

from __future__ import annotations

import logging
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from .batch import BATCH_HEADER, BATCH_METHODS, BATCH_PLOT
from .config import BASELINE, REFERENCE

log = logging.getLogger("medusa_decoding.bench")


# 4. report -------------------------------------------------------------------------------------

def _fmt(x, digits=2, suffix="") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def method_row(fig: dict, identity: dict | None) -> list[str]:
    t = fig["tokens_per_s"]
    same = "-" if not identity or not identity.get("compared") else f"{identity['compared'] - identity['differ']}/{identity['compared']}"
    return [_fmt(t["median"], 1), f"{_fmt(t['q1'], 1)}-{_fmt(t['q3'], 1)}",
            _fmt(fig["speedup_vs_plain"]["median"], 2, "x"), _fmt(fig["speedup_vs_hf"]["median"], 2, "x"),
            _fmt(fig.get("speedup_vs_llama.cpp", {}).get("median"), 2, "x"),
            _fmt(fig.get("speedup_vs_vllm", {}).get("median"), 2, "x"), _fmt(fig.get("mean_accepted_length")), same]


OVERALL_HEADER = ["method", "tok/s", "IQR", "vs plain", "vs hf", "vs llama.cpp", "vs vllm", "tau", "identical"]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in [header, *rows])


def fitted_line(fitted: dict) -> str:
    """The budget fitted to this machine against the checkpoint's own, paired per prompt."""
    return "fitted to this machine vs shipped budget (median per-prompt ratio): " + "; ".join(
        f"{m} {_fmt(f['median'], 2, 'x')} (IQR {_fmt(f['q1'])}-{_fmt(f['q3'])})" for m, f in fitted.items())


def identity_line(identity: dict) -> str:
    parts = []
    for method, ident in identity.items():
        if "skipped" in ident:
            return f"token identity vs {REFERENCE}: skipped ({ident['skipped']})"
        part = f"{method} {ident['differ']}/{ident['compared']} prompts differ"
        if ident.get("reference", REFERENCE) != REFERENCE:
            part += f" from {ident['reference']}"
        if ident["first"]:
            f = ident["first"]
            part += (f" (first: prompt {f['prompt']} [{f['category']}], turn {f['turn'] + 1}, token {f['index']}:"
                     f" {f['reference_token']} vs {f['token']})")
        parts.append(part)
    return f"token identity vs {REFERENCE}: " + ("; ".join(parts) if parts else "no method to compare")


def grammar_line(cost: dict) -> str:
    """Time in the grammar per step, per method that decoded under one."""
    return "grammar per step: " + "; ".join(f"{m} {ms:.2f} ms" for m, ms in cost.items())


def validity_line(validity: dict) -> str:
    """Answers valid under their prompt's JSON schema, per method."""
    return "schema validity: " + "; ".join(f"{m} {v['valid']}/{v['checked']}" for m, v in validity.items())


def write_report(path: Path, results: dict) -> None:
    out = [f"# medusa bench: {results['config']['model']}", ""]
    if "summary" in results:
        out += method_report(results)
    else:
        out += [f"{results['prompts']} prompts, {results['machine']['dtype']} on {results['machine']['device']}.", ""]
    if "batch" in results:
        out += batch_report(results["batch"])
    path.write_text("\n".join(out))


def engine_line(engine: dict | None) -> str:
    if not engine or engine.get("backend") != "compiled":
        return f"Engine: eager ({(engine or {}).get('cache', 'slot')} cache)."
    how = "frozen, compiled by this process" if engine.get("frozen") else f"{engine.get('loaded', 0)} loaded from the cache"
    return (f"Engine: compiled verify step, {engine['graphs']} graphs (rows, nodes, width, slots; {how}), "
            f"{engine['compile_s']:.0f} s compiling or loading them, left out of the timings.")


def method_report(results: dict) -> list[str]:
    summary, methods = results["summary"], results["methods"]
    cats = list(summary)
    out = [f"{results['prompts']} prompts, {results['config']['repeats']} repeat(s), max {results['config']['max_new_tokens']} "
           f"new tokens per turn, temperature {results['config']['temperature']}, {results['machine']['dtype']} on "
           f"{results['machine']['device']}. Speed-ups: median of per-prompt ratios. {engine_line(results.get('engine'))}", "",
           "## Overall", "", markdown_table(OVERALL_HEADER, [[m] + method_row(summary["overall"][m], results["identity"].get(m))
                                                           for m in methods]), "",
           identity_line(results["identity"]), ""] + ([validity_line(results["validity"]), ""] if results.get("validity") else [])
    if results.get("grammar_ms_per_step"):
        out += [grammar_line(results["grammar_ms_per_step"]), ""]
    if results.get("fitted_vs_shipped"):
        out += [fitted_line(results["fitted_vs_shipped"]), ""]
    for title, key, digits in (("Tokens/s (median over prompts)", "tokens_per_s", 1), ("Speed-up vs plain", "speedup_vs_plain", 2),
                               ("Speed-up vs hf", "speedup_vs_hf", 2), ("Speed-up vs llama.cpp", "speedup_vs_llama.cpp", 2),
                               ("Speed-up vs vLLM", "speedup_vs_vllm", 2), ("Mean accepted length (tau)", None, 2)):
        if key is not None and not any(key in summary["overall"][m] for m in methods):
            continue  # no llama.cpp or vLLM in this run
        rows = [[c] + [_fmt(summary[c][m].get("mean_accepted_length") if key is None else summary[c][m].get(key, {}).get("median"),
                            digits) for m in methods] for c in cats]
        out += [f"## {title}", "", markdown_table(["category", *methods], rows), ""]
    depth = [[m, " ".join(_fmt(a) for a in summary["overall"][m]["acceptance_per_depth"])]
             for m in methods if summary["overall"][m].get("acceptance_per_depth")]
    if depth:
        out += ["## Acceptance per depth (overall)", "", markdown_table(["method", "depth 1, 2, ..."], depth), ""]
    return out


def plot_name(method: str) -> str:
    return method.replace(":", "-").replace("/", "-")


def write_plots(folder: Path, results: dict) -> list[str]:
    """speedup.png (grouped bars: category x method, vs plain, else vs hf), one accepted-length
    histogram per medusa method, throughput_vs_batch.png with a batch part. Agg canvas, no
    pyplot: nothing global changes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = [write_batch_plot(folder, results["batch"])] if "batch" in results else []
    if "summary" not in results:
        return written
    summary = results["summary"]
    ref = REFERENCE if REFERENCE in results["methods"] else BASELINE
    bars = [m for m in results["methods"] if m != ref]
    if ref in results["methods"] and bars:
        cats = list(summary)
        fig = Figure(figsize=(max(6, 1.2 * len(cats) * max(1, len(bars)) / 2), 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        width = 0.8 / len(bars)
        for i, m in enumerate(bars):
            values = [summary[c][m][f"speedup_vs_{ref}"]["median"] or 0 for c in cats]
            ax.bar(np.arange(len(cats)) + i * width - 0.4 + width / 2, values, width, label=m)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(np.arange(len(cats)), cats, rotation=30, ha="right")
        ax.set_ylabel(f"speed-up vs {ref} (median of per-prompt ratios)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "speedup.png", dpi=100)
        written.append("speedup.png")
    for m in results["methods"]:
        hist = summary["overall"][m].get("accepted_length_hist")
        if m in (REFERENCE, BASELINE, "hf-pld") or not hist:
            continue
        fig = Figure(figsize=(5, 3.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        total = sum(hist.values())
        lengths = [int(k) for k in hist]
        ax.bar(lengths, [v / total for v in hist.values()])
        ax.set_xticks(range(1, max(lengths) + 1))
        ax.set_xlabel("tokens per step (bonus included)")
        ax.set_ylabel("share of steps")
        ax.set_title(f"{m}: mean accepted length {summary['overall'][m]['mean_accepted_length']:.2f}")
        fig.tight_layout()
        name = f"accepted_{plot_name(m)}.png"
        fig.savefig(folder / name, dpi=100)
        written.append(name)
    return written


def machine_info(model) -> dict:
    import transformers

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "dtype": str(model.base.dtype).removeprefix("torch."), "device": str(model.device),
            "attention": model.base.config._attn_implementation,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,  # other jobs skew timings
            "git_commit": git("rev-parse", "HEAD"), "git_dirty": None if status is None else bool(status),
            "command": shlex.join(sys.argv)}


def batch_table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for row in rows:
        ident = row["identity"]
        same = f"{ident['compared'] - ident['differ']}/{ident['compared']}" if ident["compared"] else "-"
        out.append([str(row["batch_size"]), _fmt(row["plain"]["tokens_per_s"], 1), _fmt(row["default"]["tokens_per_s"], 1),
                    _fmt(row["speedup"], 2, "x"), _fmt(row["plain"]["latency_s"], 3), _fmt(row["default"]["latency_s"], 3),
                    _fmt(row["default"]["mean_accepted_length"]), same])
    return out


def batch_identity_line(batch: dict) -> str:
    total = batch["identity"]
    parts = ", ".join(f"B={r['batch_size']} {r['identity']['differ']}/{r['identity']['compared']}" for r in batch["rows"])
    line = f"batched token identity, default vs plain ({batch['dtype']}): {parts} prompts differ"
    first = next((r["identity"]["first"] for r in batch["rows"] if r["identity"]["first"]), None)
    if first:
        line += f" (first: prompt {first['prompt']}, token {first['index']}: {first['reference_token']} vs {first['token']})"
    if total["differ"] and batch["dtype"] != "float32":
        line += "; reported only: in reduced precision a batch's rows may round differently"
    return line


def batch_report(batch: dict) -> list[str]:
    return ["## Throughput vs batch size", "",
            f"Continuous batching (engine.Decoder): the first turns of {batch['prompts']} prompts, all submitted at once, "
            f"at most B decoded together; greedy, max {batch['max_new_tokens']} new tokens; default: {batch['method']}, "
            "its tree budget chosen per step from measured throughput at the number of active rows. tok/s: all new tokens / wall time; latency: median per "
            f"sequence from its add() to its finish; medians over {batch['repeats']} round(s); speed-up: median of "
            "per-round ratios.", "",
            markdown_table(BATCH_HEADER, batch_table_rows(batch["rows"])), "", batch_identity_line(batch), ""]


def write_batch_plot(folder: Path, batch: dict) -> str:
    """throughput_vs_batch.png: tokens/s of both methods (left) and the default's speed-up (right) vs B."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sizes = [r["batch_size"] for r in batch["rows"]]
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for method in BATCH_METHODS:
        left.plot(sizes, [r[method]["tokens_per_s"] or 0 for r in batch["rows"]], marker="o", label=method)
    left.set_ylim(bottom=0)
    left.set_ylabel("tokens/s (all sequences)")
    left.legend()
    right.plot(sizes, [r["speedup"] or 0 for r in batch["rows"]], marker="o", color="C2")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set_ylabel("speed-up of default vs plain")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size")
    fig.tight_layout()
    fig.savefig(folder / BATCH_PLOT, dpi=100)
    return BATCH_PLOT
