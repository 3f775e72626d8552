"""EAGLE feature drafter: one decoder layer of the base's class reads fc([f_t ; e(x_{t+1})]) and
predicts f_{t+1}; deeper nodes read the drafter's own predicted features. f_t of a verified
position is the base's last hidden state, or fused from several of its layers (EAGLE-3). Each row keeps the
drafter's KV cache of its verified positions (draft nodes are dropped after every step).

Training (EagleTrainer): whole conversations, `unroll` passes, pass a reading the features pass
a-1 predicted, as a depth-(a+1) node does at inference (EAGLE-3's training-time test).

Glossary: A positions verified by a step, W frontier width, B conversations, T time, D hidden
size, V' shortlist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import DrafterKind, EagleRecipe, MedusaError, TrainConfig
from ..drafters import EagleLayer, Shortlist
from ..training import IGNORE, Sequences, Trainer, bucketed_order, fresh_drafter, load_sequences
from . import DrafterSpec, register
from .paths import PathDrafter, PathProposer, load


class EagleDrafter(PathDrafter):
    def proposer(self) -> EagleProposer:
        return EagleProposer(self)


class EagleProposer(PathProposer):
    """A row's state: the drafter's cache, and the verified positions it has not read yet."""

    def __init__(self, drafter: EagleDrafter):
        super().__init__(drafter)
        self.cache = drafter.weights.new_cache()
        self.committed = 0  # drafter positions in its cache
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # features [A, D], next tokens [A]

    def observe(self, hidden, next_tokens, nodes) -> None:
        if self.pending is not None:  # not yet read (a step without drafting)
            hidden = torch.cat([self.pending[0], hidden])
            next_tokens = torch.cat([self.pending[1], next_tokens])
        self.pending = (hidden, next_tokens)

    def _read(self) -> torch.Tensor:
        """Feed the pending verified positions -> the predicted feature after the last one [D]."""
        d = self.drafter
        hidden, next_tokens = self.pending
        n, start = hidden.shape[0], self.committed
        drafted = self.cache.get_seq_length() - start
        if drafted > 0:
            self.cache.crop(-drafted)  # drop the last step's draft nodes
        dtype = d.short.weight.dtype
        mask = torch.zeros(n, start + n, dtype=dtype, device=hidden.device)
        mask[:, start:] = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=hidden.device).triu_(1)
        pos = torch.arange(start, start + n, device=hidden.device)[None]
        feats = d.net.from_base(hidden[None].to(dtype))  # [1, n, D]
        out = d.net(feats, d.embed(next_tokens)[None], pos, mask[None, None], self.cache)
        self.committed, self.pending = start + n, None
        return out[0, -1]

    def _expander(self, root: torch.Tensor):
        d = self.drafter
        g0 = self._read()  # [D]: the predicted feature at the root's position
        root_pos, dtype, device = self.committed, d.short.weight.dtype, g0.device
        width, depth = d.width, d.depth
        most = width * max(depth - 1, 1)  # drafted nodes the drafter reads, at most
        slot_of = torch.full((1 + width + width**2 * depth,), -1, dtype=torch.long, device=device)
        see = torch.zeros(most, most, dtype=torch.bool, device=device)  # [slot, slot]: ancestors, itself
        feats = torch.empty(1 + most, g0.shape[-1], dtype=g0.dtype, device=device)  # [0]: g0, [1 + slot]
        feats[0] = g0
        calls, used = [0], [0]  # expand calls so far, slots they filled (grow_tree expands <= width a call)

        def expand(frontier, tokens, parents):
            j, n, w = calls[0], used[0], len(frontier)  # depth - 2, slots used before, slots now
            calls[0], used[0] = j + 1, n + w
            parent_slot = slot_of[parents[frontier]]  # [W], -1 under the root
            slots = torch.arange(n, n + w, device=device)
            slot_of[frontier] = slots
            rows = see[parent_slot.clamp(min=0)] & (parent_slot >= 0)[:, None]  # [W, most]
            rows[torch.arange(w, device=device), slots] = True
            see[slots] = rows
            bias = torch.zeros(w, self.committed + n + w, dtype=dtype, device=device)
            bias[:, self.committed:].masked_fill_(~rows[:, : n + w], torch.finfo(dtype).min)
            pos = torch.full((1, w), root_pos + j, dtype=torch.long, device=device)
            x_tok = d.short.vocab[tokens[frontier]]  # [W]
            out = d.net(feats[parent_slot + 1][None], d.embed(x_tok)[None], pos, bias[None, None], self.cache)[0]
            feats[slots + 1] = out  # [W, D]
            return d.short.log_probs(d.net.readout(out))

        return d.short.log_probs(d.net.readout(g0)), expand


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


def eagle_losses(drafter: EagleLayer, short_head, label_map: torch.Tensor, embed, seq: Sequences,
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
def evaluate_eagle(drafter: EagleLayer, short: Shortlist, embed, seq: Sequences, cfg: TrainConfig,
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


class EagleTrainer(Trainer):
    """The eagle drafter over whole conversations: `cfg.unroll` passes, pass a reading pass a-1's
    predicted features (training-time test); losses and proposals over the shortlist."""

    unit = "conversations"
    reads_embeddings = True

    @property
    def fused(self) -> bool:
        return self.cfg.recipe == EagleRecipe.EAGLE3.value

    def new_weights(self, base, layers):
        return fresh_drafter(DrafterKind.EAGLE.value, base, self.cfg, layers, self.fused)

    def check_warm_start(self, weights, source: str) -> None:
        if (weights.config.feature_layers is not None) != self.fused:
            recipe = "eagle3" if weights.config.feature_layers is not None else "eagle1"
            raise MedusaError(f"--init {source} was trained with the {recipe} recipe; pass --recipe {recipe}")

    def num_heads(self, weights) -> int:
        return weights.config.num_heads

    def load(self, shards, limit):
        return load_sequences(shards, limit, self.fused)

    def label_tokens(self, seq: Sequences) -> torch.Tensor:
        return seq.ids[seq.mask]

    def shortlist_size(self, weights) -> int:
        return weights.config.shortlist_size

    def prepare(self, weights, data, lm_head, embed, warm) -> None:
        super().prepare(weights, data, lm_head, embed, warm)
        self.short_vocab = weights.vocab.clone()

    def per_step(self, seq: Sequences) -> int:
        return max(1, round(self.cfg.batch_size / float((seq.spans[:, 1] - seq.spans[:, 0]).float().mean())))

    def order(self, seq: Sequences, group: int, generator: torch.Generator) -> torch.Tensor:
        # whole conversations padded to the longest: batch similar lengths
        return bucketed_order(seq.spans[:, 1] - seq.spans[:, 0], group, generator)

    def loss(self, weights, seq, idx):
        return eagle_losses(weights, self.train_head, self.label_map, self.embed, seq, idx, self.cfg, self.short_vocab)

    def seen(self, seq: Sequences, idx: torch.Tensor) -> int:
        return int((seq.spans[idx, 1] - seq.spans[idx, 0]).sum())

    def evaluate(self, weights, shards, limit, lm_head, embed):
        seq = load_sequences(shards, limit, weights.config.feature_layers is not None)
        return evaluate_eagle(weights, Shortlist(lm_head, weights.vocab), embed, seq, self.cfg)

    def metrics(self) -> dict:
        return {"recipe": self.cfg.recipe}


NO_EXPORT = ("this drafter's layer is not the layout vLLM and SGLang run: it mixes [feature ; embedding] by a "
             "linear with a bias and feeds a stock decoder layer (its input norm included); vLLM's EAGLE-1 layer has "
             "no bias and no input norm, and EAGLE-3's normalises the embedding and the feature apart and "
             "concatenates them into attention, so no exact conversion exists (docs/VLLM.md)")


register(DrafterKind.EAGLE, DrafterSpec(load=load, wrap=EagleDrafter, trainer=EagleTrainer, no_export=NO_EXPORT))
