"""A distillation folder's portable formats: `pack` (its conversations as token ids, small enough
to keep in git), `unpack` (the folder rebuilt from them) and `answers_of` (its answers, what
`medusa datastore` stores)."""

from __future__ import annotations

import array
import base64
import gzip
import json
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from .config import DistillConfig, MedusaError
from .data import FEATURES_DIR, conversations, normalize
from .datastore import LEAD
from .distill import FEATURE_DTYPE, _Conversation, _Folder


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
