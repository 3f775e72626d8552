"""KV cache of the base model: written at explicit slots, and after a tree verification only the
accepted path is kept.

Glossary: L layers, B batch, G key/value heads, S slots, n tokens of one forward, A accepted, d head size.

Two caches behind transformers' Cache interface:
- `SlotCache` (the fast path): keys/values of every layer preallocated, [B, G, S, d] each. A
  forward writes its n tokens at the slots `reserve` named (index_copy_, no concatenation), and
  attention reads the first `width` slots. A rejected draft needs no rollback: the next forward
  overwrites its slots. Each layer owns its buffers: views of one shared tensor cost a compiled
  step ~9 ms of whole-buffer copies here (functionalised writes into an aliased input).
- transformers' `DynamicCache` (the reference path, and models with sliding-window layers).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import MedusaError


class SlotLayer(CacheLayerMixin):
    """One layer's buffers; the write slots and the read width are set by the owning SlotCache."""

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(self, owner: SlotCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.keys, self.values = keys, values  # [B, G, S, d] each
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # preallocated by the owner
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states/value_states [B, G, n, d] -> keys/values [B, G, width, d] (views of the buffers)."""
        self.keys.index_copy_(2, self.owner.write_slots, key_states)
        self.values.index_copy_(2, self.owner.write_slots, value_states)
        width = self.owner.width
        return self.keys[:, :, :width], self.values[:, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity

    def crop(self, max_length: int) -> None:
        self.owner.length = self.owner.length + max_length if max_length < 0 else min(max_length, self.owner.length)


class SlotCache(Cache):
    """Preallocated keys/values of every layer, zeros until written (the slots past `length` that a
    wide read covers are masked, and must hold finite numbers)."""

    def __init__(self, model, capacity: int, batch: int = 1):
        text = model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        param = next(model.parameters())
        shape = (batch, text.num_key_value_heads, capacity, head_dim)  # [B, G, S, d]
        self.length = 0  # slots [0, length) hold the committed sequence
        self.write_slots = torch.arange(0, device=param.device)  # [n]: where the next forward writes
        self.width = 0  # slots the next forward's attention reads
        self.busy = False  # held by a running generation (a compiled runner shares one cache)
        super().__init__(layers=[
            SlotLayer(self, param.new_zeros(shape), param.new_zeros(shape)) for _ in range(text.num_hidden_layers)
        ])

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[2]

    def reserve(self, start: int, n: int, width: int | None = None) -> None:
        """The next forward writes its n tokens at slots start .. start+n-1 and attends to the first
        `width` slots (default start + n; a compiled step reads a fixed, rounded-up width)."""
        width = start + n if width is None else width
        if width > self.capacity or start + n > width:
            raise MedusaError(f"a forward over slots [{start}, {start + n}) reading {width} does not fit "
                              f"the cache's {self.capacity} slots")
        self.write_slots = torch.arange(start, start + n, device=self.write_slots.device)
        self.width = width

    def keep(self, prefix_len: int, nodes: torch.Tensor) -> None:
        """Move the slots of the accepted `nodes` [A] (indices into the block written at prefix_len,
        the root first) to prefix_len .. prefix_len+A-1; the sequence ends there."""
        keep = nodes.numel()
        if keep > 1:  # a lone root is already in place
            index = nodes + prefix_len
            for layer in self.layers:
                for buf in (layer.keys, layer.values):
                    buf[:, :, prefix_len : prefix_len + keep] = buf.index_select(2, index)
        self.length = prefix_len + keep

    def grow(self, capacity: int) -> None:
        """Room for `capacity` slots, keeping what is cached."""
        if capacity <= self.capacity:
            return
        for layer in self.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
                new[:, :, : self.length] = old[:, :, : self.length]
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
        cache.keep(prefix_len, nodes)
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
