"""Training data and the interface a drafter kind trains through.

Glossary: H cached hidden states (every token of every conversation), P training positions,
C conversations, K heads (depths), D hidden size, V vocabulary, V' a shortlist, B a batch.

train.py runs the loop (features, optimizer, checkpoints, processes, held-out metrics); what
differs between drafter kinds is a `Trainer` (its registry entry's `trainer`,
proposers.DrafterSpec): fresh weights, the data it reads (positions or whole conversations),
its loss, its batches and its held-out scores. Medusa and hydra heads learn at positions
(`PositionTrainer`), the eagle drafter over whole conversations (proposers/eagle.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .config import MedusaError, TrainConfig
from .drafters import Shortlist

IGNORE = -100  # a label that is not learned (not an assistant token, or outside the shortlist)


@dataclass
class Positions:
    """Training positions over cached hidden states."""

    # [H, D] every cached hidden state
    hidden: torch.Tensor
    # [P] long: index into `hidden` of position t
    index: torch.Tensor
    # [P, K] long: label of head k (token t+k+1), IGNORE where it is not an assistant token
    labels: torch.Tensor
    # [P, K] long: index into `hidden` of h[t+k], whose LM-head output predicts token t+k+1
    target_index: torch.Tensor
    # [H] long: the token of every cached position (hydra heads read the branch's tokens)
    ids: torch.Tensor | None = None
    # [H, (k-1) D]: the fused features' other layers at every cached position (hydra --fused), or None
    lower: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.index.numel()

    def features(self, at: torch.Tensor) -> torch.Tensor:
        """What a drafter reads at cached positions at [B]: h [B, D], or the fused layers [B, k D]
        (the last layer's last, as the verifier returns them)."""
        if self.lower is None:
            return self.hidden[at]
        return torch.cat([self.lower[at], self.hidden[at]], dim=-1)


def read_shards(shards: list[Path], limit: int | None = None, lower: bool = False) -> Iterator[dict]:
    """The shards' tensors, the last one cut so that at most `limit` conversations are read;
    `lower` (the fused features' other layers) only when asked for."""
    left = limit
    for shard in shards:
        if left is not None and left <= 0:
            return
        data = load_file(shard)
        if not lower:
            data.pop("lower", None)
        elif "lower" not in data:
            raise MedusaError(f"{shard} has no fused features (lower layers): record them (distill-data does)")
        offsets = data["offsets"]
        n = offsets.numel() - 1
        if left is not None and n > left:
            end = int(offsets[left])
            data = {k: (v if k == "offsets" else v[:end]) for k, v in data.items()}
            data["offsets"] = offsets[: left + 1]
            n = left
        if left is not None:
            left -= n
        yield data


def load_positions(shards: list[Path], num_heads: int, limit: int | None = None, fused: bool = False) -> Positions:
    """Shards -> Positions: every token t with at least one learnable head label (fused: with the
    lower layers' features too)."""
    hidden, lower, index, labels, targets, all_ids = [], [], [], [], [], []
    base = 0
    steps = torch.arange(2, num_heads + 2)  # [K]: head k's label is token t+k+1 = t + (k-1) + 2
    for data in read_shards(shards, limit, lower=fused):
        ids, mask, offsets = data["ids"], data["mask"].bool(), data["offsets"].tolist()
        for start, end in zip(offsets[:-1], offsets[1:]):
            t = torch.arange(end - start)[:, None]  # [T, 1]
            pos = t + steps  # [T, K]: position of each head's label token
            valid = pos < end - start
            pos_c = pos.clamp(max=end - start - 1) + start
            valid &= mask[pos_c]
            keep = valid.any(-1)
            index.append(base + start + t[keep, 0])
            labels.append(torch.where(valid, ids[pos_c], IGNORE)[keep])
            targets.append((base + pos_c - 1)[keep])
        hidden.append(data["hidden"])
        lower.append(data.get("lower"))
        all_ids.append(ids)
        base += data["hidden"].shape[0]
    if not index:
        raise MedusaError("no training positions: the data has no assistant tokens")
    return Positions(torch.cat(hidden), torch.cat(index), torch.cat(labels), torch.cat(targets), torch.cat(all_ids),
                     torch.cat(lower) if fused else None)


def path_ids(pos: Positions, idx: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The tokens after each position t of idx [B]: x_{t+1} .. x_{t+K} -> [B, K] (clamped at the
    end of the cache; those heads have no label there)."""
    at = pos.index[idx, None] + torch.arange(1, num_heads + 1)  # [B, K]
    return pos.ids[at.clamp(max=pos.ids.numel() - 1)]


def shortlist_head(lm_head: torch.nn.Module, labels: torch.Tensor, size: int, keep: torch.Tensor | None = None):
    """A frozen LM head over the `size` most frequent label tokens (or the token ids `keep` [V'],
    a warm start's shortlist) -> (head [V'] outputs, label_map [V] long: a token's index in the
    shortlist, IGNORE outside it). The heads' features still meet the full LM head at inference;
    only the training loss is truncated."""
    vocab = lm_head.weight.shape[0]
    if keep is None:
        freq = torch.bincount(labels[labels != IGNORE], minlength=vocab)
        keep = freq.topk(min(size, vocab)).indices.sort().values  # [V']
    keep = keep.to(lm_head.weight.device)
    head = torch.nn.Linear(lm_head.weight.shape[1], len(keep), bias=False)
    head.weight.data = lm_head.weight.data[keep].clone()
    head.requires_grad_(False)
    label_map = torch.full((vocab,), IGNORE, dtype=torch.long)
    label_map[keep] = torch.arange(len(keep))
    return head, label_map


@dataclass
class Sequences:
    """Whole cached conversations, for a drafter that attends over the sequence (eagle)."""

    hidden: torch.Tensor  # [H, D]
    ids: torch.Tensor  # [H] long
    mask: torch.Tensor  # [H] bool: assistant tokens
    spans: torch.Tensor  # [C, 2] long: (start, end) of each conversation in H
    lower: torch.Tensor | None = None  # [H, (k-1) D]: fused features' other layers (eagle3)

    def __len__(self) -> int:
        return self.spans.shape[0]


def load_sequences(shards: list[Path], limit: int | None = None, fused: bool = False) -> Sequences:
    hidden, lower, ids, mask, spans, base = [], [], [], [], [], 0
    for data in read_shards(shards, limit, lower=fused):
        offsets = data["offsets"]
        spans.append(torch.stack([offsets[:-1], offsets[1:]], dim=-1) + base)
        hidden.append(data["hidden"])
        lower.append(data.get("lower"))
        ids.append(data["ids"])
        mask.append(data["mask"].bool())
        base += data["hidden"].shape[0]
    if not spans:
        raise MedusaError("no training conversations")
    return Sequences(torch.cat(hidden), torch.cat(ids), torch.cat(mask), torch.cat(spans),
                     torch.cat(lower) if fused else None)


def bucketed_order(lengths: torch.Tensor, group: int, generator: torch.Generator, window: int = 32) -> torch.Tensor:
    """A random order of the items whose consecutive groups of `group` have similar lengths: a random
    permutation, cut in windows of `window` groups, each sorted by length, then its groups shuffled.
    A batch pads its conversations to the longest one; random batches of ShareGPT answers wasted
    ~40% of a step on padding."""
    perm = torch.randperm(lengths.numel(), generator=generator)
    out = []
    for chunk in perm.split(group * window):
        chunk = chunk[lengths[chunk].argsort(stable=True)]
        groups = list(chunk.split(group))
        out += [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
    return torch.cat(out)


def head_losses(heads, lm_head, pos: Positions, idx: torch.Tensor, cfg: TrainConfig,
                label_map: torch.Tensor | None = None, embed: torch.nn.Module | None = None):
    """Loss and per-head top-1 on a batch of positions idx [B] -> (loss [], top1 [K]).

    The V-wide terms (tokens or kd) use the first ceil(vocab_fraction * B) positions of the
    (already shuffled) batch; the feature term, when weighted, uses all of them. With a
    shortlist, lm_head projects onto its V' tokens and label_map [V] takes a token to its
    index there (IGNORE outside it). Hydra heads also read the embeddings (`embed`, the base's
    input embedding) of the tokens after t."""
    at = pos.index[idx]  # [B]
    labels = pos.labels[idx]  # [B, K]
    if label_map is not None:
        labels = torch.where(labels == IGNORE, IGNORE, label_map[labels.clamp(min=0)])
    target_h = pos.hidden[pos.target_index[idx]].float()  # [B, K, D]
    n_vocab = max(1, math.ceil(cfg.vocab_fraction * idx.numel()))
    if embed is not None:  # hydra heads (maybe wrapped for distributed training)
        feats = heads(pos.features(at).float(), embed(path_ids(pos, idx, labels.shape[1])).float())  # [K, B, D]
        logits = lm_head(feats[:, :n_vocab])  # [K, b, V]
    else:
        feats, logits = heads(pos.hidden[at].float(), lm_head, with_features=True, vocab_rows=n_vocab)  # [K, B, D], [K, b, V]
    loss = logits.new_zeros(())
    top1 = []
    for k in range(logits.shape[0]):
        valid = labels[:, k] != IGNORE  # [B]
        sub = valid[:n_vocab]  # [b]
        term = logits.new_zeros(())
        if sub.any():
            logit_k = logits[k][sub].float()  # [b', V]
            if cfg.targets == "tokens":
                term = F.cross_entropy(logit_k, labels[:n_vocab][sub, k])
            else:
                with torch.no_grad():  # the base model's own distribution at t+k
                    log_p = torch.log_softmax(lm_head(target_h[:n_vocab][sub, k]).float(), -1)  # [b', V]
                term = F.kl_div(torch.log_softmax(logit_k, -1), log_p, log_target=True, reduction="batchmean")
            top1.append((logit_k.argmax(-1) == labels[:n_vocab][sub, k]).float().mean().detach())
        else:
            top1.append(torch.tensor(float("nan")))
        if cfg.feature_weight > 0 and valid.any():
            term = term + cfg.feature_weight * F.smooth_l1_loss(feats[k][valid].float(), target_h[valid, k])
        loss = loss + cfg.decay**k * term
    return loss, torch.stack(top1)


@torch.no_grad()
def evaluate(heads, lm_head, pos: Positions, batch_size: int = 512, topk: int = 5,
             embed: torch.nn.Module | None = None, short: Shortlist | None = None) -> dict:
    """Top-1 and top-5 accuracy of each head on labelled positions. Hydra heads (with `embed`)
    read the true branch tokens and rank only their shortlist `short`, as at inference."""
    k_heads = pos.labels.shape[1]
    hits1, hits5, count = torch.zeros(k_heads), torch.zeros(k_heads), torch.zeros(k_heads)
    for start in range(0, len(pos), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(pos)))
        at = pos.index[idx]  # [B]
        if embed is not None:  # hydra heads read their branch's tokens
            feats = heads(pos.features(at).float(), embed(path_ids(pos, idx, k_heads)).float())  # [K, B, D]
            top = short.vocab[short.log_probs(feats).topk(topk, dim=-1).indices]  # [K, B, topk]
        else:
            top = heads(pos.hidden[at].float(), lm_head).topk(topk, dim=-1).indices  # [K, B, topk]
        labels = pos.labels[idx]  # [B, K]
        for k in range(k_heads):
            valid = labels[:, k] != IGNORE
            hit = top[k][valid] == labels[valid, k, None]  # [b, topk]
            hits1[k] += hit[:, 0].sum()
            hits5[k] += hit.any(-1).sum()
            count[k] += valid.sum()
    count = count.clamp(min=1)
    return {"top1": (hits1 / count).tolist(), "top5": (hits5 / count).tolist(), "positions": count.long().tolist()}


class Trainer:
    """How one drafter kind trains on the frozen base's recorded features and is scored on
    held-out ones. One instance per run, made from the run's TrainConfig; train.py calls, in this
    order: new_weights (or a warm start, checked by check_warm_start), load, prepare, then per
    step order / loss / seen, and evaluate at the end."""

    unit = "training positions"  # what one item of the data is
    reads_embeddings = False  # whether it reads the base's input embedding (a path-aware drafter)

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    @property
    def fused(self) -> bool:
        """Does it read several layers of the base (recorded by distill-data), not the last alone?"""
        return False

    def new_weights(self, base, layers: list[int] | None) -> torch.nn.Module:
        """Fresh weights sized for `base` (layers: the recorded feature layers)."""
        raise NotImplementedError

    def check_warm_start(self, weights, source: str) -> None:
        """Refuse a warm start whose weights this run's settings do not fit (one clear line)."""

    def num_heads(self, weights) -> int:
        """The depths `weights` draft (what the run's num_heads becomes after a warm start)."""
        return self.cfg.num_heads

    def load(self, shards: list[Path], limit: int | None):
        """Feature shards -> the items it trains on (len() of them)."""
        raise NotImplementedError

    def label_tokens(self, data) -> torch.Tensor:
        """The tokens it learns, with repeats (the shortlist is their most frequent)."""
        raise NotImplementedError

    def shortlist_size(self, weights) -> int:
        """V': its vocabulary losses over the V' most frequent label tokens (0: the whole vocabulary)."""
        return 0

    def prepare(self, weights, data, lm_head: torch.nn.Module, embed: torch.nn.Module | None, warm: bool) -> None:
        """Before the first step: the frozen LM head its losses project on (a shortlist where it
        has one; a drafter keeps it as the only tokens it proposes, a warm start keeps its own)."""
        self.lm_head, self.embed = lm_head, embed if self.reads_embeddings else None
        self.train_head, self.label_map = lm_head, None
        size = self.shortlist_size(weights)
        if size:
            vocab = getattr(weights, "vocab", None)
            keep = vocab.clone() if warm and vocab is not None else None
            self.train_head, self.label_map = shortlist_head(lm_head, self.label_tokens(data), size, keep)
            if vocab is not None:  # the drafter proposes only these tokens at inference
                vocab.copy_(torch.nonzero(self.label_map != IGNORE)[:, 0])

    def per_step(self, data) -> int:
        """Items in one step of one process."""
        return self.cfg.batch_size

    def order(self, data, group: int, generator: torch.Generator) -> torch.Tensor:
        """The items of one epoch in order [items] (group: items in one step of every process)."""
        return torch.randperm(len(data), generator=generator)

    def loss(self, weights, data, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Items idx [B] -> (loss [], top-1 per depth [K])."""
        raise NotImplementedError

    def seen(self, data, idx: torch.Tensor) -> int:
        """Positions the items idx [B] hold (the throughput's unit)."""
        return idx.numel()

    def evaluate(self, weights, shards: list[Path], limit: int | None, lm_head, embed) -> dict:
        """Held-out top-1 / top-5 per depth of `weights` on the shards' conversations."""
        raise NotImplementedError

    def metrics(self) -> dict:
        """What metrics.json records of how it was trained."""
        return {"recipe": None}


def fresh_drafter(kind: str, base, cfg: TrainConfig, layers: list[int] | None, fused: bool) -> torch.nn.Module:
    """A fresh path-aware drafter (drafters.py: hydra or eagle) for a run: cfg's heads, inner width
    (default 2 D), shortlist (--train-vocab, default drafters.SHORTLIST_SIZE), the recorded layers
    where it reads fused features."""
    from . import drafters

    return drafters.for_base(kind, base, cfg.model, num_heads=cfg.num_heads,
                             inner_size=cfg.inner_size or 2 * base.config.get_text_config().hidden_size,
                             shortlist_size=cfg.train_vocab or drafters.SHORTLIST_SIZE,
                             feature_layers=list(layers) if fused else None)


class PositionTrainer(Trainer):
    """Heads that learn at positions: head k at position t predicts token t+k+1 (Medusa heads;
    hydra heads, which also read the tokens of their branch)."""

    def load(self, shards, limit):
        return load_positions(shards, self.cfg.num_heads, limit, self.fused)

    def label_tokens(self, pos: Positions) -> torch.Tensor:
        return pos.labels[pos.labels != IGNORE]

    def loss(self, weights, pos, idx):
        return head_losses(weights, self.train_head, pos, idx, self.cfg, self.label_map, self.embed)

    def evaluate(self, weights, shards, limit, lm_head, embed):
        layers = getattr(getattr(weights, "config", None), "feature_layers", None)
        pos = load_positions(shards, self.num_heads(weights), limit, layers is not None)
        short = Shortlist(lm_head, weights.vocab) if getattr(weights, "vocab", None) is not None else None
        return evaluate(weights, lm_head, pos, embed=embed if self.reads_embeddings else None, short=short)
