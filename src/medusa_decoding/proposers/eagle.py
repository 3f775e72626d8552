"""EAGLE feature drafter: one decoder layer of the base's class reads fc([f_t ; e(x_{t+1})]) and
predicts f_{t+1}; deeper nodes read the drafter's own predicted features. f_t of a verified
position is the base's last hidden state, or fused from several of its layers (EAGLE-3). Each row keeps the
drafter's KV cache of its verified positions (draft nodes are dropped after every step).

Glossary: A positions verified by a step, W frontier width, D hidden size, V' shortlist.
"""

from __future__ import annotations

import torch

from ..config import DrafterKind
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


register(DrafterKind.EAGLE, DrafterSpec(load=load, wrap=EagleDrafter))
