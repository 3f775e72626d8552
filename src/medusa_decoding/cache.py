"""KV cache of the base model: written at explicit slots, and after a tree verification only the
accepted path is kept.

Glossary: L layers, R rows allocated, B rows of one forward, G key/value heads, S slots, n tokens
of one forward, A accepted, M moved slots, d head size.

Two caches behind transformers' Cache interface:
- `SlotCache` (the fast path): keys/values of every layer preallocated, [R, G, S, d] each. A
  forward writes its n tokens at the slots `reserve` named (index_copy_, no concatenation), and
  attention reads the first `width` slots. A rejected draft needs no rollback: the next forward
  overwrites its slots. Each layer owns its buffers: in a compiled step, writes into views of one
  shared tensor become whole-buffer copies (functionalised writes into an aliased input).
- transformers' `DynamicCache` (the reference path, and models with sliding-window layers).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import MedusaError

GROW_SLOTS = 128  # a SlotCache's slots grow in steps of this many


class SlotLayer(CacheLayerMixin):
    """One layer's buffers; the rows, write slots and read width are set by the owning SlotCache."""

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(self, owner: SlotCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.keys, self.values = keys, values  # [R, G, S, d] each
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # preallocated by the owner
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states/value_states [B, G, n, d] -> keys/values [B, G, width, d] (views of the buffers)."""
        owner = self.owner
        keys, values = self.keys[owner.rows], self.values[owner.rows]  # views: writes go to the buffers
        keys.index_copy_(2, owner.write_slots, key_states)
        values.index_copy_(2, owner.write_slots, value_states)
        return keys[:, :, : owner.width], values[:, :, : owner.width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity

    def crop(self, max_length: int) -> None:
        self.owner.length = self.owner.length + max_length if max_length < 0 else min(max_length, self.owner.length)


class SlotCache(Cache):
    """Preallocated keys/values of every layer for R rows (sequences), zeros until written (the
    slots past a row's length that a wide read covers are masked, and must hold finite numbers).
    A forward covers the rows `rows` (a slice: rows [0, B) of a batched step, one row for a
    prefill); which row holds which sequence and how long each is, the verifier keeps."""

    def __init__(self, model, capacity: int, rows: int = 1):
        text = model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        param = next(model.parameters())
        groups = getattr(text, "num_key_value_heads", None) or text.num_attention_heads  # GPT-2, GPT-NeoX: no GQA
        shape = (rows, groups, capacity, head_dim)  # [R, G, S, d]
        self.length = 0  # slots before the next forward's block (what transformers reads as the past)
        self.rows = slice(0, 1)  # rows the next forward covers
        self.write_slots = torch.arange(0, device=param.device)  # [n]: where the next forward writes
        self.width = 0  # slots the next forward's attention reads
        super().__init__(layers=[
            SlotLayer(self, param.new_zeros(shape), param.new_zeros(shape)) for _ in range(text.num_hidden_layers)
        ])

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[2]

    @property
    def num_rows(self) -> int:
        return self.layers[0].keys.shape[0]

    def reserve(self, rows: slice, start: int, n: int, width: int | None = None) -> None:
        """The next forward covers `rows`, writes its n tokens at slots start .. start+n-1 and
        attends to the first `width` slots (default start + n; a compiled step reads a fixed,
        rounded-up width)."""
        width = start + n if width is None else width
        if width > self.capacity or start + n > width or rows.stop > self.num_rows:
            raise MedusaError(f"a forward over slots [{start}, {start + n}) reading {width} of rows {rows.start}.."
                              f"{rows.stop - 1} does not fit the cache's {self.num_rows} x {self.capacity} slots")
        self.rows = rows
        self.write_slots = torch.arange(start, start + n, device=self.write_slots.device)
        self.width, self.length = width, start

    def keep(self, block: int, rows: list[tuple[int, int, torch.Tensor]]) -> None:
        """Commit a verified block written at slots block ..: for each (row, length, nodes [A]),
        move the slots of the accepted nodes (indices into the block, root first) to length ..
        length+A-1. Nodes already in place (a row at the block, accepted nodes 0, 1, .. of its tree,
        as a chain-shaped tree's often are) are skipped: each move is 2 L copies."""
        moves = []
        for r, length, nodes in rows:
            skip = 0
            if length == block:  # one host read, where nodes may be in place
                ids = nodes.tolist()
                while skip < len(ids) and ids[skip] == skip:
                    skip += 1
            if skip < nodes.numel():
                moves.append((r, length + skip, nodes[skip:]))
        if not moves:
            return
        device = moves[0][2].device
        row = torch.cat([torch.full_like(nodes, r) for r, _, nodes in moves])  # [M]
        src = torch.cat([block + nodes for _, _, nodes in moves])  # [M]
        dst = torch.cat([length + torch.arange(nodes.numel(), device=device) for _, length, nodes in moves])  # [M]
        for layer in self.layers:
            for buf in (layer.keys, layer.values):
                buf[row, :, dst] = buf[row, :, src]  # the right side is gathered first

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row src's first `length` slots to row dst (a released row's place)."""
        for layer in self.layers:
            for buf in (layer.keys, layer.values):
                buf[dst, :, :length] = buf[src, :, :length]

    def grow(self, capacity: int, rows: int | None = None, keep: int | None = None) -> None:
        """Room for `capacity` slots and `rows` rows, keeping the first `keep` slots (default all).
        Slots grow in steps of GROW_SLOTS: each growth copies every row (3-4 s for 128 rows of
        SmolLM2 here), so prompts one token longer than the last must not each pay for one."""
        rows = self.num_rows if rows is None else max(rows, self.num_rows)
        if capacity <= self.capacity and rows <= self.num_rows:
            return
        capacity = max(-(-capacity // GROW_SLOTS) * GROW_SLOTS if capacity > self.capacity else 0, self.capacity)
        keep = self.capacity if keep is None else min(keep, self.capacity)
        for layer in self.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros(rows, old.shape[1], capacity, old.shape[-1])
                new[: old.shape[0], :, :keep] = old[:, :, :keep]
                setattr(layer, name, new)


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def keep_path(cache, prefix_len: int, nodes: torch.Tensor) -> None:
    """Keep the entries of the accepted `nodes` [A] (indices into the verified block that starts
    at `prefix_len`), moved to prefix_len .. prefix_len+A-1 in order; drop the rest.

    The result equals the cache plain decoding builds for the same tokens (tested).
    """
    if isinstance(cache, SlotCache):
        cache.keep(prefix_len, [(0, prefix_len, nodes)])
        return
    index = nodes + prefix_len  # [A]
    keep = nodes.numel()
    for layer in cache.layers:
        total = layer.keys.shape[-2]
        if total < prefix_len + keep:
            raise MedusaError(
                f"cache layer holds {total} positions, fewer than {prefix_len + keep}: "
                "sequences past a sliding attention window are not supported"
            )
        for name in ("keys", "values"):
            buf = getattr(layer, name)  # [B, H, S, d]
            buf[..., prefix_len : prefix_len + keep, :] = buf.index_select(-2, index)
        layer.crop(-(total - prefix_len - keep))
