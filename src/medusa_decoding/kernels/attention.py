"""An attention kernel for short query blocks (decode steps, tree verification), registered with
transformers' AttentionInterface under the name "medusa": the model's forward stays its own.

Glossary: B batch, H query heads, G key/value heads (H = G * R), n queries, S keys, d head size.

A decode step asks few queries of many keys. torch's SDPA kernel for CPU grows fast with the keys
there, where two matmuls with the R query heads of each key head stacked as rows (no copy of keys
or values) stay cheap (docs/ENGINE.md). Below ~80 keys SDPA is cheaper, and blocks longer than
SHORT_QUERY (prefill) are SDPA's strength: both go to transformers' own SDPA path unchanged.
"""

from __future__ import annotations

import torch

ATTENTION_NAME = "medusa"
EXACT_ATTENTION_NAME = "medusa_exact"
ROWWISE_ATTENTION_NAME = "medusa_rowwise"  # the int8 numerics' (blocks.py)
SHORT_QUERY = 64  # longer query blocks use transformers' sdpa_attention_forward
MIN_KEYS = 80  # and so do fewer keys
EXACT_CHUNK = 64  # exact mode: keys are reduced in chunks of this many attended keys, from the first
MIN_GEMM_ROWS = 4  # fp32 matmuls with fewer rows take another kernel (other rounding) on CPU


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


def exact_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs):
    """Short-query attention whose every output row is independent of the other rows, of the
    cache layout and of the width (exact mode); arguments and result as short_query_attention.

    A query's result is a function of the keys it attends to, taken in order (its "virtual
    sequence": the prefix, then its tree ancestors), as plain decoding lays them out in the
    cache. Keys are reduced in chunks of EXACT_CHUNK virtual positions from position 0: chunks
    wholly inside the query's leading run of attended slots are read in place; the rest (the
    partial chunk and the ancestors) are gathered into virtual order. Each chunk is one fp32
    matmul of a fixed shape (rows padded to MIN_GEMM_ROWS), the chunks are summed in order
    (cumsum: sequential), and a masked key or an empty chunk adds an exact zero. So a tree node
    gets bit for bit what plain decoding computes at its position, alone or beside other rows.
    The max is order-free; exp is elementwise. Prefill (longer query blocks) goes to SDPA, the
    same for every method."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, n, d = query.shape
    g, s = key.shape[1], key.shape[2]
    special = kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
    if n > SHORT_QUERY or dropout > 0 or special:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scaling = d**-0.5 if scaling is None else scaling
    r, c, dev = h // g, EXACT_CHUNK, query.device
    slots = torch.arange(s, device=dev)
    dense = attention_mask is None and n == 1  # one query per row seeing every key: plain decoding
    if dense:
        attended = torch.ones(b, n, s, dtype=torch.bool, device=dev)
    elif attention_mask is None:  # causal: query i sees keys up to S - n + i
        attended = (slots[None, :] <= slots[s - n:, None])[None].expand(b, n, s)
    elif attention_mask.dtype == torch.bool:
        attended = attention_mask[:, 0].expand(b, n, s)
    else:
        attended = (attention_mask[:, 0] == 0).expand(b, n, s)  # additive: 0 attends, finfo.min masks
    if dense:  # the same layout as below, without the bookkeeping: whole chunks, then the rest in place
        shared, tails = s // c, -(-(s % c) // c)
        start = torch.full((b, n), shared * c, device=dev)
    else:
        # [B, n]: a query's leading run of attended slots; its whole chunks are read in place
        run = attended.long().cumprod(-1).sum(-1)
        start = torch.div(run, c, rounding_mode="floor") * c
        tail = attended & (slots >= start[..., None])  # [B, n, S]: gathered into virtual order
        count = tail.sum(-1)
        shared, tails = int(start.max()) // c, -(-int(count.max()) // c)
    width = tails * c
    if not dense:
        where = torch.where(tail, tail.long().cumsum(-1) - 1, width)  # each tail key's place (else: a dump column)
        index = torch.zeros(b, n, width + 1, dtype=torch.long, device=dev).scatter_(-1, where, slots.expand(b, n, s))
        index = index[..., :width]  # [B, n, T] slots in virtual order
        valid = torch.arange(width, device=dev) < count[..., None]  # [B, n, T]

    def chunked(p, v):  # p [..., rows, K] @ v [..., K, d] -> [..., rows, d], rows padded for the GEMM
        rows = p.shape[-2]
        if rows < MIN_GEMM_ROWS:
            p = torch.cat([p, p.new_zeros(*p.shape[:-2], MIN_GEMM_ROWS - rows, p.shape[-1])], -2)
        return torch.matmul(p, v)[..., :rows, :]

    q = query.reshape(b, g, r * n, d).float()  # fp32 products: on CPUs without bf16 units, faster too
    scores = (chunked(q, key.float().transpose(-1, -2)) * scaling).view(b, g, r, n, s)
    if not dense:
        scores = scores.masked_fill(~attended[:, None, None], float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))  # [B, G, R, n, S]; masked keys: 0

    sums, parts = [], []  # per chunk, in virtual order: [B, G, R, n, chunks] and [B, G, R, n, chunks, d]
    if shared:
        e_in = e[..., : shared * c]
        if not dense:
            inside = slots[: shared * c] < start[..., None]  # [B, n, S'] whole chunks of the leading run
            e_in = e_in.masked_fill(~inside[:, None, None], 0.0)
        e_in = e_in.reshape(b, g, r, n, shared, c)
        sums.append(e_in.sum(-1))
        rows = e_in.reshape(b, g, r * n, shared, c).transpose(2, 3)  # [B, G, chunks, R*n, C]
        pv = chunked(rows, value[:, :, : shared * c].float().reshape(b, g, shared, c, d))  # [B, G, chunks, R*n, d]
        parts.append(pv.view(b, g, shared, r, n, d).permute(0, 1, 3, 4, 2, 5))
    if tails and dense:  # the last partial chunk, in place, padded with zeros
        pad = width - (s - shared * c)
        e_t = torch.cat([e[..., shared * c:], e.new_zeros(b, g, r, n, pad)], -1).view(b, g, r, n, tails, c)
        v_t = torch.cat([value[:, :, shared * c:].float(), value.new_zeros(b, g, pad, d, dtype=torch.float32)], 2)
        v_t = v_t.view(b, g, n, tails, c, d)
    elif tails:
        e_t = e.gather(-1, index[:, None, None].expand(b, g, r, n, width))
        e_t = e_t.masked_fill(~valid[:, None, None], 0.0).view(b, g, r, n, tails, c)
        v_t = value[torch.arange(b, device=dev)[:, None, None], :, index].float()  # [B, n, T, G, d]
        v_t = v_t.permute(0, 3, 1, 2, 4).reshape(b, g, n, tails, c, d)
    if tails:
        sums.append(e_t.sum(-1))
        pv = chunked(e_t.permute(0, 1, 3, 4, 2, 5), v_t)  # [B, G, n, chunks, R, d]
        parts.append(pv.permute(0, 1, 4, 2, 3, 5))
    total = torch.cat(sums, -1).cumsum(-1)[..., -1]  # [B, G, R, n]
    out = torch.cat(parts, -2).cumsum(-2)[..., -1, :] / total[..., None]  # [B, G, R, n, d]
    return out.to(query.dtype).view(b, h, n, d).transpose(1, 2), None


def rowwise_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs):
    """Short-query attention for the int8 numerics, in blocks.cpp (`rowwise_attention`): each query alone
    over the keys it attends, in slot order (the prefix, then its ancestors: what plain decoding reads at
    its position), every sum in that order, so a node's result is plain decoding's bit for bit, whatever
    the other rows, the width or the tree; arguments and result as short_query_attention. fp32 on CPU;
    prefill (longer query blocks) goes to SDPA, the same for every method."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, n, d = query.shape
    s = key.shape[2]
    special = kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
    if n > SHORT_QUERY or dropout > 0 or special or query.dtype != torch.float32 or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scaling = d**-0.5 if scaling is None else scaling
    if attention_mask is None:  # causal: query i sees keys up to S - n + i
        slots = torch.arange(s, device=query.device)
        attend = (slots[None, :] <= slots[s - n:, None])[None]
    elif attention_mask.dtype == torch.bool:
        attend = attention_mask[:, 0]
    else:
        attend = attention_mask[:, 0] == 0  # additive: 0 attends, finfo.min masks
    out = torch.ops.medusa_blocks.rowwise_attention(query.contiguous(), key.contiguous(), value.contiguous(), attend,
                                                    float(scaling))
    return out, None


def register_rowwise_attention() -> str:
    """Make "medusa_rowwise" a valid attn_implementation (idempotent; its operator is registered with the
    block kernel, blocks.kernel())."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROWWISE_ATTENTION_NAME, rowwise_attention)
    if ROWWISE_ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(ROWWISE_ATTENTION_NAME, sdpa_mask)
    return ROWWISE_ATTENTION_NAME


def register_attention(exact: bool = False) -> str:
    """Make "medusa" (or "medusa_exact", exact mode) a valid attn_implementation (idempotent);
    its masks are built as for sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    name = EXACT_ATTENTION_NAME if exact else ATTENTION_NAME
    AttentionInterface.register(name, exact_attention if exact else short_query_attention)
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, sdpa_mask)
    return name


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
