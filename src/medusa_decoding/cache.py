"""KV cache of the base model: after a tree verification, keep only the accepted path.

The cache is transformers' `DynamicCache`; each layer holds keys/values [B, H, S, d].
"""

from __future__ import annotations

import torch

from .config import MedusaError


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def keep_path(cache, prefix_len: int, nodes: torch.Tensor) -> None:
    """Keep the entries of the accepted `nodes` [A] (indices into the verified block that starts
    at `prefix_len`), moved to prefix_len .. prefix_len+A-1 in order; drop the rest.

    The result equals the cache plain decoding builds for the same tokens (tested).
    """
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


def cache_length(cache) -> int:
    return cache.get_seq_length()
