"""An attention kernel for short query blocks (decode steps, tree verification), registered with
transformers' AttentionInterface under the name "medusa": the model's forward stays its own.

Glossary: B batch, H query heads, G key/value heads (H = G * R), n queries, S keys, d head size.

A decode step asks few queries of many keys. torch's SDPA kernel for CPU grows fast with the keys
there: per layer of SmolLM2 (bf16, 2 threads), 1 query over 200 / 1,000 keys took 90 / 437 us,
where two matmuls with the R query heads of each key head stacked as rows (no copy of keys or
values) take 43 / 58 us; 16 queries over 1,000 keys 359 vs 164 us. Below ~80 keys SDPA is cheaper
(21 vs 39 us at 20 keys), and blocks longer than SHORT_QUERY (prefill) are SDPA's strength: both go
to transformers' own SDPA path unchanged.
"""

from __future__ import annotations

import torch

ATTENTION_NAME = "medusa"
SHORT_QUERY = 64  # longer query blocks use transformers' sdpa_attention_forward
MIN_KEYS = 80  # and so do fewer keys


def short_query_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """query [B, H, n, d], key/value [B, G, S, d], attention_mask [B|1, 1, n, S] (additive float,
    or bool True = attend) or None (causal: query i sees keys up to S - n + i)
    -> (output [B, n, H, d], None), as every transformers attention function returns."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, n, d = query.shape
    g, s = key.shape[1], key.shape[2]
    special = kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
    if n > SHORT_QUERY or s < MIN_KEYS or dropout > 0 or special:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scaling = d**-0.5 if scaling is None else scaling
    r = h // g
    q = query.reshape(b, g, r * n, d)  # the R query heads of one key head, stacked as rows
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scaling  # [B, G, R * n, S]
    if attention_mask is None and n > 1:
        attention_mask = torch.ones(n, s, dtype=torch.bool, device=query.device).tril(s - n)[None, None]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros(attention_mask.shape, device=query.device).masked_fill_(
                ~attention_mask, torch.finfo(torch.float32).min)
        scores = (scores.view(b, g, r, n, s) + attention_mask[:, :, None]).view(b, g, r * n, s)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, G, R * n, d]
    return out.view(b, h, n, d).transpose(1, 2), None


def register_attention() -> str:
    """Make "medusa" a valid attn_implementation (idempotent); its masks are built as for sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, short_query_attention)
    if ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def full_attention(config) -> bool:
    """Every layer attends to the whole sequence: what the preallocated (slot) cache assumes."""
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    if layer_types:
        return all(t == "full_attention" for t in layer_types)
    return not (getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True))


def fits_short_query_attention(config) -> bool:
    """Full attention in every layer, no logit soft-capping, no attention sinks: what the kernel
    assumes."""
    return full_attention(config) and not getattr(config.get_text_config(), "attn_logit_softcapping", None)
