"""Medusa-1 head training on a frozen base model, on HF Accelerate.

Glossary: H cached hidden states (every token of every conversation), P training positions,
K heads, D hidden size, V vocabulary, B positions per step and process.

Stages:
  1. features: one base forward per conversation; its last hidden states (after the final
     norm) are cached on disk in shards, so the base model never runs again (resumable);
  2. train: the heads on shuffled batches of cached positions. Head k at position t learns
     token t+k+1: `tokens` targets are the data's tokens, `kd` targets the base model's own
     distribution at t+k (its LM head on the cached h[t+k]); an optional EAGLE-style term
     regresses head k's feature onto h[t+k];
  3. evaluate: top-1 / top-5 of each head on held-out conversations -> metrics.json.

The same command runs in one CPU process or under `accelerate launch` on N processes/GPUs;
Accelerate owns the process group and the gradient all-reduce.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from .config import EagleRecipe, MedusaError, TrainConfig
from .data import FEATURES_DIR, StopSignal, conversations, tokenize_conversation
from .drafters import EagleDrafter, HydraHeads, Shortlist, fused_layers
from .drafters import for_base as drafter_for_base
from .heads import MedusaHeads

log = logging.getLogger(__name__)

SHARD_CONVERSATIONS = 256  # conversations per feature shard: the unit of resumption
IGNORE = -100


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


def end_process_group() -> None:
    """Destroy the process group `accelerate launch` made, if one is alive (an atexit handler)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def feature_shards(model, tokenizer, cfg: TrainConfig, split: str, folder: Path, limit: int | None,
                   is_main: bool, progress: bool = True, layers: list[int] | None = None) -> tuple[list[Path], Counter]:
    """Cache the base model's last hidden states of a split's conversations in shards of
    SHARD_CONVERSATIONS, each a safetensors file with hidden [H_s, D], ids [H_s],
    mask [H_s] and offsets [S+1]; with `layers` (fused features, the last one the base's last),
    also lower [H_s, (k-1) D], the other layers' states. Existing shards are kept (resumption);
    a distill-data folder holds the same shards, written while it decoded."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    max_length = min(cfg.max_length, model.config.get_text_config().max_position_embeddings)
    fingerprint = {"model": cfg.model, "data": cfg.data, "max_length": max_length, "dtype": str(model.dtype),
                   "shard_conversations": SHARD_CONVERSATIONS}
    if layers:
        fingerprint["layers"] = list(layers)
    stamp = folder / "fingerprint.json"
    if is_main:
        if stamp.is_file() and json.loads(stamp.read_text()) != fingerprint:
            raise MedusaError(f"{folder} caches features of other data or settings ({stamp}); use another --out")
        stamp.write_text(json.dumps(fingerprint) + "\n")
    counts: Counter = Counter()
    shards: list[Path] = []
    pending: list = []
    bar = tqdm(total=limit, desc=f"features ({split})", unit="conv", disable=not (progress and is_main))

    def write(shard: Path) -> None:
        if is_main and not shard.is_file():
            hidden, lower, ids, masks, offsets = [], [], [], [], [0]
            with torch.inference_mode():
                for ex in pending:
                    out = model.get_decoder()(input_ids=ex.input_ids[None].to(model.device),
                                              output_hidden_states=bool(layers))
                    hidden.append(out.last_hidden_state[0].to("cpu", model.dtype))
                    if layers:
                        lower.append(torch.cat([out.hidden_states[i][0] for i in layers[:-1]], -1).to("cpu", model.dtype))
                    ids.append(ex.input_ids)
                    masks.append(ex.loss_mask)
                    offsets.append(offsets[-1] + ex.input_ids.numel())
                    bar.update(1)
            tmp = shard.with_suffix(".tmp")
            tensors = {"hidden": torch.cat(hidden).contiguous(), "ids": torch.cat(ids),
                       "mask": torch.cat(masks).to(torch.uint8), "offsets": torch.tensor(offsets)}
            if layers:
                tensors["lower"] = torch.cat(lower).contiguous()
            save_file(tensors, tmp)
            tmp.rename(shard)
        else:
            bar.update(len(pending))
        shards.append(shard)

    n = 0
    for _, messages in conversations(cfg.data, counts, split=split):
        if limit is not None and n >= limit:
            break
        ex = tokenize_conversation(tokenizer, messages, max_length)
        if ex is None:
            counts["no assistant token within max_length"] += 1
            continue
        if ex.input_ids.numel() == max_length:
            counts[f"truncated to {max_length} tokens"] += 1
        pending.append(ex)
        n += 1
        if len(pending) == SHARD_CONVERSATIONS:
            write(folder / f"{split}-{len(shards):05d}.safetensors")
            pending = []
    if pending:
        write(folder / f"{split}-{len(shards):05d}.safetensors")
    bar.close()
    counts[f"{split} conversations"] = n
    return shards, counts


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
        if isinstance(heads, HydraHeads):
            feats = heads(pos.features(at).float(), embed(path_ids(pos, idx, heads.config.num_heads)).float())  # [K, B, D]
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


def eagle_batch(seq: Sequences, idx: torch.Tensor):
    """Conversations idx [B] -> inputs and targets, padded to T = longest - 1:
    features [B, T, D] f_t (fused: [B, T, k D], the lower layers first), tokens [B, T] x_{t+1},
    target [B, T, D] f_{t+1} (the last layer's), labels [B, T] x_{t+2} (IGNORE where x_{t+2} is not
    an assistant token, or past the end)."""
    spans = seq.spans[idx]  # [B, 2]
    lengths = spans[:, 1] - spans[:, 0]  # [B]
    t_max = int(lengths.max()) - 1
    t = torch.arange(t_max)  # [T]
    at = (spans[:, :1] + t).clamp(max=seq.ids.numel() - 3)  # [B, T] index of f_t
    inside = t < (lengths[:, None] - 1)  # [B, T] x_{t+1} exists
    labelled = (t < (lengths[:, None] - 2)) & seq.mask[(at + 2).clamp(max=seq.ids.numel() - 1)]
    features = seq.hidden[at] if seq.lower is None else torch.cat([seq.lower[at], seq.hidden[at]], dim=-1)
    features = features * inside[..., None]
    tokens = torch.where(inside, seq.ids[at + 1], 0)
    target = seq.hidden[at + 1]
    labels = torch.where(labelled, seq.ids[at + 2], IGNORE)
    return features, tokens, target, labels


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


def ttt_mask(t: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of unrolled pass `step` (0: the true features) -> [1, 1, T, (step+1) T].

    Pass a at position t reads the feature that pass a-1 predicted at t-1, exactly as a depth-a
    tree node does at inference: it sees the true prefix up to t - a (pass 0's keys), its
    ancestors (pass b's key at t - (a - b)) and itself."""
    blocks = [torch.ones(t, t, dtype=torch.bool).tril(-step)]
    for b in range(1, step + 1):
        off = -(step - b)
        blocks.append(torch.ones(t, t, dtype=torch.bool).tril(off).triu(off))
    see = torch.cat(blocks, dim=1)
    return torch.zeros(see.shape, dtype=dtype).masked_fill_(~see, torch.finfo(dtype).min)[None, None]


def eagle_losses(drafter: EagleDrafter, short_head, label_map: torch.Tensor, embed, seq: Sequences,
                 idx: torch.Tensor, cfg: TrainConfig, short_vocab: torch.Tensor):
    """Loss and per-pass top-1 of `cfg.unroll` passes over conversations idx [B] -> (loss [], top1 [passes]).

    Pass 0 reads the true features; pass a reads pass a-1's predictions (training-time test, as
    EAGLE-3): its accuracy is that of depth-(a+1) nodes. Each pass: KL to the base's own
    distribution at t+1 (or CE to the data's token) over the shortlist, plus feature_weight x
    smooth-L1 onto f_{t+1}; pass a is weighted decay**a."""
    features, tokens, target, labels = eagle_batch(seq, idx)
    b, t = tokens.shape
    embeds = embed(tokens).float()  # [B, T, D]
    position_ids = torch.arange(t)[None].expand(b, t)
    valid_all = labels != IGNORE  # [B, T]
    with torch.no_grad():
        target_log_p = torch.log_softmax(short_head(target[valid_all].float()).float(), -1)  # [n, V']
    cache = drafter.new_cache()
    x = drafter.from_base(features.float())  # [B, T, D]
    d = x.shape[-1]
    loss, top1 = features.new_zeros((), dtype=torch.float32), []
    for a in range(cfg.unroll):
        out = drafter(x, embeds, position_ids, ttt_mask(t, a, torch.float32), cache)  # [B, T, D]
        valid = valid_all.clone()
        valid[:, :a] = False
        rows = valid[valid_all]  # which of target_log_p's rows count in this pass
        logits = short_head(drafter.readout(out[valid])).float()  # [n', V']
        if cfg.targets == "tokens":
            term = F.cross_entropy(logits, label_map[labels[valid]], ignore_index=IGNORE)  # outside V': no term
        else:
            term = F.kl_div(torch.log_softmax(logits, -1), target_log_p[rows], log_target=True, reduction="batchmean")
        if cfg.feature_weight > 0:
            term = term + cfg.feature_weight * F.smooth_l1_loss(out[valid].float(), target[valid].float())
        loss = loss + cfg.decay**a * term
        top1.append((short_vocab[logits.argmax(-1)] == labels[valid]).float().mean().detach())
        x = torch.cat([x.new_zeros(b, 1, d), out[:, :-1]], dim=1)  # pass a+1 at t reads pass a's output at t-1
    return loss, torch.stack(top1)


@torch.no_grad()
def evaluate_eagle(drafter: EagleDrafter, short: Shortlist, embed, seq: Sequences, cfg: TrainConfig,
                   batch_convs: int = 4) -> dict:
    """Top-1 / top-5 of each unrolled pass (depth) on held-out conversations, over the shortlist."""
    passes = cfg.unroll
    hits1, hits5, count = torch.zeros(passes), torch.zeros(passes), torch.zeros(passes)
    for start in range(0, len(seq), batch_convs):
        idx = torch.arange(start, min(start + batch_convs, len(seq)))
        features, tokens, _, labels = eagle_batch(seq, idx)
        b, t = tokens.shape
        embeds, position_ids, cache = embed(tokens).float(), torch.arange(t)[None].expand(b, t), drafter.new_cache()
        x = drafter.from_base(features.float())
        d = x.shape[-1]
        for a in range(passes):
            out = drafter(x, embeds, position_ids, ttt_mask(t, a, torch.float32), cache)
            valid = labels != IGNORE
            valid[:, :a] = False
            top = short.vocab[short.log_probs(drafter.readout(out[valid])).topk(5, dim=-1).indices]  # [n, 5]
            hit = top == labels[valid][:, None]
            hits1[a] += hit[:, 0].sum()
            hits5[a] += hit.any(-1).sum()
            count[a] += valid.sum()
            x = torch.cat([x.new_zeros(b, 1, d), out[:, :-1]], dim=1)
    count = count.clamp(min=1)
    return {"top1": (hits1 / count).tolist(), "top5": (hits5 / count).tolist(), "positions": count.long().tolist()}


def train(cfg: TrainConfig, resume: bool = False, progress: bool = True, stop_after: int | None = None) -> dict:
    """Run the three stages; return the final metrics. `resume` continues from the checkpoint
    in cfg.out (optimizer, scheduler, data position). `stop_after` (tests) simulates a kill
    after that many optimizer steps, leaving a checkpoint."""
    from accelerate import Accelerator
    from accelerate.utils import gather_object, set_seed
    from tqdm import tqdm
    from transformers import get_cosine_schedule_with_warmup

    from .models import load_base, resolve_device
    from .platform import native_bf16

    out = Path(cfg.out)
    checkpoint = out / "checkpoint"
    if (checkpoint / "trainer_state.json").is_file() and not resume:
        raise MedusaError(f"{out} already holds a training checkpoint: pass --resume, or choose another --out")
    if resume and not (checkpoint / "trainer_state.json").is_file():
        raise MedusaError(f"--resume: no checkpoint in {out}")
    device = resolve_device(cfg.device)
    mp = cfg.mixed_precision
    if mp == "auto":  # bf16 autocast on a CPU without bf16 hardware is emulated: many times slower
        if device.type == "cpu":
            mp = "bf16" if native_bf16() else "no"
        else:
            mp = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    accelerator = Accelerator(mixed_precision=mp, cpu=device.type == "cpu", gradient_accumulation_steps=cfg.grad_accum)
    # a gloo process group left to the interpreter's finalization aborts the process now and then
    # ("terminate called without an active exception"): destroy it at exit, while Python is alive
    atexit.unregister(end_process_group)
    atexit.register(end_process_group)
    set_seed(cfg.seed)
    is_main = accelerator.is_main_process
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")

    # 1. features: the frozen base runs once per conversation; the main process writes shards
    base, tokenizer, _ = load_base(cfg.model, dtype=cfg.dtype, device=str(accelerator.device))
    if tokenizer.chat_template is None:
        raise MedusaError(f"{cfg.model} has no chat template: head training renders chat conversations")
    depth = base.config.get_text_config().num_hidden_layers
    fused = cfg.fused or cfg.recipe == EagleRecipe.EAGLE3.value
    distilled = distilled_folder(cfg.data)
    if distilled is not None:  # features recorded while the data was decoded: the base does not run
        recorded = json.loads((distilled / "fingerprint.json").read_text())
        if recorded["model"] != cfg.model:
            raise MedusaError(f"{distilled} holds features of {recorded['model']}, not {cfg.model}")
        layers = recorded["layers"]
        train_shards = sorted((distilled / FEATURES_DIR).glob("train-*.safetensors"))
        eval_shards = sorted((distilled / FEATURES_DIR).glob("eval-*.safetensors"))
        counts = Counter({"data": str(distilled), "train shards": len(train_shards), "eval shards": len(eval_shards)})
    else:
        layers = fused_layers(depth) if fused else None
        feature_dir = out / "features"
        train_shards, counts = feature_shards(base, tokenizer, cfg, "train", feature_dir, cfg.max_conversations,
                                              is_main, progress, layers)
        eval_shards, eval_counts = feature_shards(base, tokenizer, cfg, "eval", feature_dir, cfg.eval_conversations,
                                                  is_main, progress, layers)
        counts.update({k if k.startswith("eval") else f"eval: {k}": v for k, v in eval_counts.items()})
    if fused and (not layers or len(layers) < 2):
        raise MedusaError(f"fused features need several layers; {cfg.data} recorded only {layers}")
    accelerator.wait_for_everyone()
    if is_main:
        log.info("data: %s", "; ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    lm_head = base.get_output_embeddings()
    embed = None  # drafters read the base's input embedding; Medusa heads do not
    if cfg.drafter != "medusa":
        embed = base.get_input_embeddings().float().requires_grad_(False)
    if cfg.init is not None:  # a warm start: the checkpoint's weights, shape and shortlist
        heads = initial_weights(cfg, base)
        cfg = replace(cfg, num_heads=heads.config.num_heads if cfg.drafter != "medusa" else heads.num_heads)
        if is_main:
            (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
            log.info("warm start from %s (%d heads)", cfg.init, cfg.num_heads)
    elif cfg.drafter == "medusa":
        heads = MedusaHeads.for_base(base, cfg.num_heads, cfg.num_layers, not cfg.own_lm_head, cfg.model, cfg.inner_size)
    else:
        heads = drafter_for_base(cfg.drafter, base, cfg.model, num_heads=cfg.num_heads,
                                 inner_size=cfg.inner_size or 2 * base.config.get_text_config().hidden_size,
                                 shortlist_size=cfg.train_vocab or 8192,
                                 feature_layers=list(layers) if fused else None)
    heads = heads.float().train().requires_grad_(True)
    lm_head.float().requires_grad_(False)
    del base
    pos = load_positions(train_shards, cfg.num_heads, cfg.max_conversations, fused and cfg.drafter == "hydra")
    train_head, label_map = lm_head, None
    if cfg.drafter != "medusa" or (cfg.train_vocab and not cfg.own_lm_head):
        size = heads.config.shortlist_size if cfg.drafter != "medusa" else cfg.train_vocab
        keep = heads.vocab.clone() if cfg.init is not None and cfg.drafter != "medusa" else None
        train_head, label_map = shortlist_head(lm_head, pos.labels, size, keep)
        if cfg.drafter != "medusa":  # the drafter proposes only these tokens at inference
            heads.vocab.copy_(torch.nonzero(label_map != IGNORE)[:, 0])
        if is_main:
            log.info("vocabulary losses on the %d most frequent label tokens", size)
    if cfg.drafter == "eagle":
        seq = load_sequences(train_shards, cfg.max_conversations, fused)
        del pos
        items, short_vocab = len(seq), heads.vocab.clone()
        per_step = max(1, round(cfg.batch_size / float((seq.spans[:, 1] - seq.spans[:, 0]).float().mean())))

        def batch_loss(idx):
            return eagle_losses(heads, train_head, label_map, embed, seq, idx, cfg, short_vocab)
    else:
        items, per_step = len(pos), cfg.batch_size

        def batch_loss(idx):
            return head_losses(heads, train_head, pos, idx, cfg, label_map, embed)

    # 2. train
    world, rank = accelerator.num_processes, accelerator.process_index
    steps_per_epoch = items // (per_step * world)
    if steps_per_epoch < 1:
        unit = "conversations" if cfg.drafter == "eagle" else "training positions"
        raise MedusaError(f"{items} {unit} are fewer than one batch of {per_step * world}")
    total_steps = max(1, math.floor(steps_per_epoch * cfg.epochs))
    optimizer = torch.optim.AdamW(
        (p for p in heads.parameters() if p.requires_grad), lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, min(cfg.warmup_steps, total_steps // 10 + 1),
                                                math.ceil(total_steps / cfg.grad_accum))
    heads, optimizer = accelerator.prepare(heads, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    step = 0
    if resume:
        accelerator.load_state(str(checkpoint))
        step = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
        if is_main:
            log.info("resumed from %s at step %d", checkpoint, step)

    def save_checkpoint() -> None:
        accelerator.wait_for_everyone()
        accelerator.save_state(str(checkpoint))
        if is_main:
            (checkpoint / "trainer_state.json").write_text(json.dumps({"step": step}) + "\n")
        accelerator.wait_for_everyone()

    stopper = StopSignal()
    log_file = (out / "log.jsonl").open("a") if is_main else None
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=not (progress and is_main))
    order, order_epoch = None, -1
    t0, seen = time.perf_counter(), 0
    try:
        while step < total_steps:
            epoch, offset = divmod(step, steps_per_epoch)
            if epoch != order_epoch:  # the same order on every process and after a resume
                generator = torch.Generator().manual_seed(cfg.seed + epoch)
                if cfg.drafter == "eagle":  # whole conversations padded to the longest: batch similar lengths
                    order = bucketed_order(seq.spans[:, 1] - seq.spans[:, 0], per_step * world, generator)
                else:
                    order = torch.randperm(items, generator=generator)
                order_epoch = epoch
            start = (offset * world + rank) * per_step
            idx = order[start : start + per_step]
            with accelerator.accumulate(heads), accelerator.autocast():
                loss, top1 = batch_loss(idx)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(heads.parameters(), cfg.max_grad_norm)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            step += 1
            seen += (idx.numel() if cfg.drafter != "eagle" else int((seq.spans[idx, 1] - seq.spans[idx, 0]).sum())) * world
            bar.update(1)
            if step % cfg.log_every == 0 or step == total_steps:
                record = {"step": step, "epoch": step / steps_per_epoch, "loss": loss.item(),
                          "lr": scheduler.get_last_lr()[0], "top1": [round(x, 4) for x in top1.tolist()],
                          "positions_per_s": seen / (time.perf_counter() - t0)}
                bar.set_postfix(loss=f"{record['loss']:.3f}", top1="/".join(f"{x:.2f}" for x in top1.tolist()))
                if log_file:
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
            stop_now = stopper.requested or (stop_after is not None and step >= stop_after)
            if step % cfg.save_every == 0 or stop_now:
                save_checkpoint()
            if stop_now:
                if is_main:
                    log.info("stopped at step %d; checkpoint saved: rerun the same command with --resume", step)
                return {"interrupted_at": step}
    finally:
        stopper.restore()
        bar.close()
        if log_file:
            log_file.close()

    # 3. evaluate on held-out conversations, save the heads
    save_checkpoint()
    unwrapped = accelerator.unwrap_model(heads).eval()
    metrics = {"drafter": cfg.drafter, "recipe": cfg.recipe if cfg.drafter == "eagle" else None,
               "feature_layers": list(layers) if fused else None, "train_items": items, "steps": step, "data": dict(counts),
               "weights_sha256_per_process": gather_object([weights_digest(unwrapped)])}
    if eval_shards and cfg.drafter == "eagle":
        metrics["eval"] = evaluate_eagle(unwrapped, Shortlist(lm_head, unwrapped.vocab), embed,
                                         load_sequences(eval_shards, cfg.eval_conversations, fused), cfg)
    elif eval_shards:
        short = Shortlist(lm_head, unwrapped.vocab) if cfg.drafter == "hydra" else None
        metrics["eval"] = evaluate(unwrapped, lm_head, load_positions(eval_shards, cfg.num_heads, cfg.eval_conversations,
                                                                      fused and cfg.drafter == "hydra"),
                                   embed=embed, short=short)
    if is_main:
        unwrapped.save_pretrained(out)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def evaluate_checkpoint(heads: str | Path, data: str | Path, limit: int | None = None, unroll: int = 5) -> dict:
    """Held-out top-1 / top-5 per depth of a saved drafter (Medusa heads, hydra, eagle; "shipped":
    the default drafter shipped for the folder's model) on the held-out split of a distill-data folder, from its recorded features: only the base's
    embeddings and LM head are used. limit: the first `limit` held-out conversations; unroll:
    the depths an EAGLE drafter is scored at. Returns what metrics.json's "eval" holds."""
    from . import proposers
    from .models import load_base

    folder = distilled_folder(str(data))
    if folder is None:
        raise MedusaError(f"{data} is not a distill-data folder (it has no fingerprint.json)")
    recorded = json.loads((folder / "fingerprint.json").read_text())
    shards = sorted((folder / FEATURES_DIR).glob("eval-*.safetensors"))
    if not shards:
        raise MedusaError(f"{folder} holds no held-out conversations yet")
    if heads == "shipped":
        heads = shipped_checkpoint(recorded["model"], what=f"{recorded['model']}, the model of {folder}")
    base, _, _ = load_base(recorded["model"], dtype="float32", device="cpu")
    weights = proposers.load(heads, base).float().eval()
    lm_head, embed = base.get_output_embeddings().float(), base.get_input_embeddings().float()
    with torch.no_grad():
        if isinstance(weights, EagleDrafter):
            layers = weights.config.feature_layers
            fused = layers is not None
            if fused and list(layers) != list(recorded["layers"]):
                raise MedusaError(f"{heads} reads layers {list(layers)}; {folder} recorded {recorded['layers']}")
            return evaluate_eagle(weights, Shortlist(lm_head, weights.vocab), embed,
                                  load_sequences(shards, limit, fused), TrainConfig(unroll=unroll))
        hydra = isinstance(weights, HydraHeads)
        num_heads = weights.config.num_heads if hydra else weights.num_heads
        fused = hydra and weights.config.feature_layers is not None
        if fused and list(weights.config.feature_layers) != list(recorded["layers"]):
            raise MedusaError(f"{heads} reads layers {weights.config.feature_layers}; {folder} recorded {recorded['layers']}")
        return evaluate(weights, lm_head, load_positions(shards, num_heads, limit, fused), embed=embed if hydra else None,
                        short=Shortlist(lm_head, weights.vocab) if hydra else None)


def shipped_checkpoint(model: str, kind: str | None = None, what: str = "") -> Path:
    """The folder of the drafter shipped for a built-in `model` (kind None: its default one)."""
    from .models import shipped_drafter

    path = shipped_drafter(model, kind)
    if path is None:
        raise MedusaError(f"no {kind + ' ' if kind else ''}drafter is shipped for {what or model}")
    return path


def initial_weights(cfg: TrainConfig, base):
    """The checkpoint `cfg.init` names ("shipped": the cfg.drafter kind shipped for cfg.model),
    loaded for `base` to be trained further: its kind must be cfg.drafter; its shape (heads,
    blocks, widths, eagle's fused layers) and a drafter's shortlist come with it."""
    from . import proposers

    path = shipped_checkpoint(cfg.model, cfg.drafter, cfg.model) if cfg.init == "shipped" else cfg.init
    if not Path(path).expanduser().is_dir():
        raise MedusaError(f"--init {cfg.init}: no such checkpoint folder")
    weights = proposers.load(path, base)
    if weights.kind != cfg.drafter:
        raise MedusaError(f"--init {cfg.init} holds a {weights.kind} drafter; pass --drafter {weights.kind}")
    if cfg.drafter == "eagle" and (weights.config.feature_layers is not None) != (cfg.recipe == EagleRecipe.EAGLE3.value):
        recipe = "eagle3" if weights.config.feature_layers is not None else "eagle1"
        raise MedusaError(f"--init {cfg.init} was trained with the {recipe} recipe; pass --recipe {recipe}")
    if cfg.drafter == "hydra" and (weights.config.feature_layers is not None) != cfg.fused:
        flag = "--fused" if weights.config.feature_layers is not None else "no --fused"
        raise MedusaError(f"--init {cfg.init} {'does not read' if cfg.fused else 'reads'} fused features; pass {flag}")
    return weights


def distilled_folder(data: str) -> Path | None:
    """`data` as a distill-data folder (features recorded as it decoded), or None."""
    path = Path(data)
    return path if path.is_dir() and (path / "fingerprint.json").is_file() else None


def weights_digest(module: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal across processes when the all-reduce worked."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def metrics_table(metrics: dict) -> str:
    ev = metrics.get("eval")
    if not ev:
        return "no held-out conversations: no evaluation"
    rows = ["head  top-1  top-5  positions"]
    for k, (a, b, n) in enumerate(zip(ev["top1"], ev["top5"], ev["positions"]), start=1):
        rows.append(f"{k:>4}  {a:5.3f}  {b:5.3f}  {n:>9}")
    return "\n".join(rows)
