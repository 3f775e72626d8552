"""Self-distillation: the base model's own answers to ShareGPT's user turns, decoded by the
engine's batched decoder, with the base's features of every token recorded as it decodes, written
to a folder that training reads (the base never runs again)."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import DistillConfig, GenerationConfig, MedusaError, SamplingConfig
from .data import (FEATURES_DIR, Contamination, StopSignal, assistant_spans, conversations, is_held_out, normalize,
                   render_ids)
from .drafters import fused_layers
from .proposers import Drafter, Proposer

log = logging.getLogger(__name__)

FEATURE_DTYPE = torch.bfloat16  # features are stored in bf16: 3 layers of SmolLM2 take 3.5 KB a token


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


class Distillation:
    """One run of `distill`: the folder, the decoder, and the conversations in flight. The loop
    (`run`) admits follow-up turns first, then new conversations, while the batch has room, steps
    the decoder, and ends each turn (`end_turn`): the next user turn is asked, or the finished
    conversation is written with the features recorded as it decoded."""

    def __init__(self, model_name: str, out: Path, source: str, limit: int | None, cfg: DistillConfig,
                 exclude: Contamination | None, dtype: str, device: str, progress: bool):
        from tqdm import tqdm

        from .engine import Decoder, MedusaModel, Method
        from .models import load_base
        from .verifiers.transformers import TransformersVerifier

        if out.suffix == ".jsonl":
            raise MedusaError(f"--out is a folder (features, data.jsonl, manifest.json), not {out.name}")
        model, self.tokenizer, _ = load_base(model_name, dtype=dtype, device=device)
        if self.tokenizer.chat_template is None:
            raise MedusaError(f"{model_name} has no chat template: self-distillation needs a chat model")
        depth = model.config.get_text_config().num_hidden_layers
        layers = tuple(cfg.layers) if cfg.layers else tuple(fused_layers(depth))
        if layers[-1] != depth:
            raise MedusaError(f"the last feature layer must be the base's last ({depth}): training reads it")
        self.folder = _Folder(out, {"model": model_name, "dtype": str(model.dtype), "layers": list(layers),
                                    "feature_dtype": str(FEATURE_DTYPE), "max_new_tokens": cfg.max_new_tokens,
                                    "temperature": cfg.temperature, "turns": cfg.turns, "max_length": cfg.max_length},
                              len(layers), cfg.shard_size)
        self.counts = self.folder.counts
        self.cfg, self.source, self.limit, self.exclude = cfg, source, limit, exclude
        self.recording = _Recording(layers)
        plain = MedusaModel(model, self.tokenizer)
        self.eos = plain.eos_token_ids
        verifier = TransformersVerifier(plain.backend, rows_hint=cfg.batch_size, feature_layers=layers)
        self.decoder = Decoder(verifier, Method(self.recording), self.eos, max_batch_size=cfg.batch_size)
        self.gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
        self.sampling = SamplingConfig(temperature=cfg.temperature)
        self.bar = tqdm(total=limit, initial=min(self.folder.written, limit or self.folder.written), desc="distill",
                        unit="conv", disable=not progress)
        self.t0, self.tokens, self.first_written = time.perf_counter(), 0, self.folder.written
        self.follow_ups: list[tuple[_Conversation, object]] = []  # (conversation, Request) of its next turn
        # id -> (conversation, recorder, prompt ids, new tokens) of the turns being decoded
        self.live: dict[str, tuple[_Conversation, _Recorder, list[int], list[int]]] = {}
        self.exhausted = False  # the source has no more conversations

    def request_of(self, conv: _Conversation, ids: list[int] | None = None):
        """The Request of the conversation's next turn (ids: its prompt, when already rendered);
        None where prompt and answer would not fit cfg.max_length."""
        from .engine import Request

        ids = ids if ids is not None else render_ids(self.tokenizer, conv.messages(with_next=True), True)
        if len(ids) + self.cfg.max_new_tokens > self.cfg.max_length:
            return None
        return Request(torch.tensor(ids), self.gen, self.sampling, id=conv.id)

    def candidates(self) -> Iterator[tuple[_Conversation, list[int]]]:
        """New conversations to distill: not written yet, not empty, not a duplicate, not a
        benchmark prompt, a first prompt that fits; each with its rendered first prompt."""
        cfg, counts, folder = self.cfg, self.counts, self.folder
        for rid, messages in conversations(self.source, counts, split="all"):
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
            hit = next((h for h in map(self.exclude.match, users) if h), None) if self.exclude is not None else None
            if hit is not None:
                counts["matches a benchmark prompt"] += 1
                log.info("skipped %s: matches benchmark prompt %s", rid, hit)
                continue
            ids = render_ids(self.tokenizer, [{"role": "user", "content": users[0]}], True)
            if len(ids) > cfg.max_prompt_tokens:
                counts[f"prompt over {cfg.max_prompt_tokens} tokens"] += 1
                continue
            folder.seen.add(key)
            yield _Conversation(rid, users), ids

    def end_turn(self, cid: str, reason: str) -> None:
        """A turn ended: ask the conversation's next user turn, or write the conversation."""
        conv, recorder, prompt, new = self.live.pop(cid)
        answer = [t for t in new if t not in self.eos] if reason == "stop" else new
        conv.answers.append(self.tokenizer.decode(answer, skip_special_tokens=True))
        conv.finish.append(reason)
        if len(conv.answers) < len(conv.users):
            request = self.request_of(conv)
            if request is not None:
                self.follow_ups.append((conv, request))
                return
            self.counts[f"follow-up turn not asked (over {self.cfg.max_length} tokens)"] += 1
        ids = prompt + new
        mask = [False] * len(ids)
        for start, end in assistant_spans(self.tokenizer, conv.messages(with_next=False)[:-1]):
            mask[start:end] = [True] * (end - start)
        mask[len(prompt):] = [True] * len(new)
        self.counts[f"{len(conv.answers)}-turn conversations"] += 1
        written = self.folder.written
        self.folder.add(conv, ids, mask, recorder.features(len(ids)))
        if self.folder.written != written:
            self.folder.write_manifest(time.perf_counter() - self.t0, self.tokens)
        self.bar.update(1)

    def room(self) -> bool:
        """Is there room under `limit` for one more conversation?"""
        folder = self.folder
        in_flight = len(self.live) + len(self.follow_ups) + sum(len(v) for v in folder.pending.values())
        return self.limit is None or folder.written + in_flight < self.limit

    def admit(self, source: Iterator, stopper: StopSignal) -> None:
        """Fill the batch: follow-up turns first, then new conversations while `limit` leaves room."""
        decoder = self.decoder
        while decoder.has_room and not stopper.requested:
            if self.follow_ups:
                conv, request = self.follow_ups.pop(0)
            elif not self.exhausted and self.room():
                conv, ids = next(source, (None, None))
                if conv is None:
                    self.exhausted = True
                    break
                request = self.request_of(conv, ids)  # the first prompt, rendered once
                if request is None:
                    self.counts[f"prompt + answer over {self.cfg.max_length} tokens"] += 1
                    continue
            else:
                break
            first = decoder.add(request)
            self.live[conv.id] = (conv, self.recording.made.pop(), request.input_ids.tolist(), list(first.tokens))
            if first.finished:
                self.end_turn(conv.id, first.finish_reason)

    def run(self, stop_after: int | None = None) -> Counter:
        """Decode until `limit` conversations are written, the source ends, or a stop (SIGINT,
        SIGTERM, stop_after) -> the counts; what was finished is written either way."""
        folder, decoder = self.folder, self.decoder
        source, stopper = self.candidates(), StopSignal()
        try:
            while True:
                self.admit(source, stopper)
                if not decoder.seqs:
                    break
                for o in decoder.step():
                    self.live[o.id][3].extend(o.tokens)
                    self.tokens += len(o.tokens)
                    if o.finished:
                        self.end_turn(o.id, o.finish_reason)
                done_now = folder.written + sum(len(v) for v in folder.pending.values()) - self.first_written
                if stopper.requested or (stop_after is not None and done_now >= stop_after):
                    self.counts["interrupted (not written; resumed next run)"] += len(self.live) + len(self.follow_ups)
                    decoder.close()
                    break
        finally:
            stopper.restore()
            for split in folder.pending:
                folder.flush(split)
            folder.write_manifest(time.perf_counter() - self.t0, self.tokens)
            self.bar.close()
        self.counts["written"] = folder.written - self.first_written
        return self.counts


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
    return Distillation(model_name, Path(out), source, limit, cfg or DistillConfig(), exclude, dtype, device,
                        progress).run(stop_after)
