"""Batched Medusa decoding: several sequences verified in ONE forward per step, with
continuous batching (sequences join and leave between steps).

Glossary: B sequences in the batch, S cache slots (shared by all rows), N tree nodes (root
first), T prompt length, K heads, D hidden, V vocabulary.

The batched KV cache (transformers' DynamicCache, keys/values [B, H, S, d]):
  - every row has the same S slots; row b's valid entries are [0, len_b); the slots after
    len_b hold garbage (padding, rejected tree nodes) and are always masked out;
  - a step appends the N tree tokens of every row at [S, S + N); the 4D additive mask
    [B, 1, N, S + N] lets node i of row b see the row's valid prefix [0, len_b) and its own
    tree ancestors (decode.tree_bias); its position is len_b + depth(i);
  - commit copies each row's accepted nodes to [len_b, len_b + a_b) (one indexed copy per
    layer, over all rows at once), then crops S to max_b(len_b + a_b);
  - a new sequence is prefilled alone (batch 1) and its rows are concatenated to the batch
    (the shorter of the two padded along S); a finished one is dropped by index_select on B.
Every row runs the same static tree. Rows too close to the context end accept only the root
(what decode.py's one-node tree does there). When more than `max_tree_batch` sequences are
active, the whole step uses the one-node tree: with many rows the forward is no longer
overhead-bound, so N extra nodes per row cost more than the accepted tokens bring.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

from .acceptance import accept
from .cache import new_cache
from .config import DEFAULT_TREE, GenerationConfig, MedusaError, SamplingConfig
from .decode import ROOT_ONLY, GenerationStats, context_length, tree_bias
from .runner import forward, lm_logits
from .heads import MedusaHeads
from .tree import TreeBuffers, build_tree, tree_tokens


@dataclass
class BatchRequest:
    """One sequence to decode."""

    input_ids: torch.Tensor  # [T] long (or [1, T])
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    id: Hashable | None = None  # None: the decoder numbers it


@dataclass
class SequenceOutput:
    """What one sequence emitted in one call of `add` or `step`."""

    id: Hashable
    tokens: list[int]  # the new tokens (EOS included when it ended the sequence)
    finished: bool
    finish_reason: str | None  # "stop" (EOS) or "length" (max_new_tokens or context), once finished
    stats: GenerationStats


@dataclass
class _Row:
    """A sequence in the batch: everything its next step needs."""

    request: BatchRequest
    generator: torch.Generator | None
    stats: GenerationStats
    root: torch.Tensor  # [] long: the last emitted token, not yet in the cache
    last_hidden: torch.Tensor  # [D]: hidden state of the last cached token, read by the heads
    length: int  # valid cache entries, [0, length)


class BatchDecoder:
    """Decode up to `max_batch_size` sequences together, one forward per step.

    heads None: plain decoding. tree: a static tree shared by every row (None: the default
    tree, cut to the heads' depth).
    max_tree_batch: above this many active sequences a step uses the one-node tree (None:
    always the tree). Greedy output of every sequence is token-identical to decode.decode.
    Not thread-safe: one owner calls add / step / cancel.
    """

    def __init__(self, model, heads: MedusaHeads | None, tree: TreeBuffers | None, eos_token_ids: Iterable[int],
                 max_batch_size: int = 8, max_tree_batch: int | None = None):
        if max_batch_size < 1:
            raise MedusaError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if heads is not None and tree is None:
            tree = build_tree([p for p in DEFAULT_TREE if len(p) <= heads.num_heads])
        if heads is not None and not isinstance(tree, TreeBuffers):
            raise MedusaError("batched decoding needs a static tree (a list of paths), not a dynamic one")
        if heads is not None and tree.ngram_length:
            raise MedusaError("batched decoding does not support an n-gram branch")
        self.model, self.heads = model, heads
        self.device, self.dtype = next(model.parameters()).device, model.dtype
        self.root_only = ROOT_ONLY.to(self.device)
        self.tree = tree.to(self.device) if heads is not None else self.root_only
        self.bias = tree_bias(self.tree, self.dtype, self.device)  # [N, N]
        self.eos = set(int(e) for e in eos_token_ids)
        self.max_batch_size, self.max_tree_batch = max_batch_size, max_tree_batch
        self.ctx = context_length(model)
        self.rows: list[_Row] = []
        self.cache = None  # DynamicCache, rows in the order of self.rows; None when empty
        self._ids = itertools.count()
        probe = new_cache(model)
        if any(type(layer).__name__ != "DynamicLayer" for layer in getattr(probe, "layers", [])):
            raise MedusaError("batched decoding needs full-attention cache layers (no sliding window)")

    @property
    def has_room(self) -> bool:
        return len(self.rows) < self.max_batch_size

    @property
    def ids(self) -> list[Hashable]:
        return [r.request.id for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def add(self, request: BatchRequest) -> SequenceOutput:
        """Prefill a new sequence alone and join it to the batch; returns its first token.
        A sequence that ends on that token (EOS, max_new_tokens 1, context) takes no slot."""
        if not self.has_room:
            raise MedusaError(f"the batch is full ({self.max_batch_size} sequences)")
        ids = request.input_ids.reshape(1, -1).to(self.device)  # [1, T]
        prompt_len = ids.shape[1]
        if prompt_len == 0:
            raise MedusaError("the prompt is empty")
        if prompt_len >= self.ctx:
            raise MedusaError(f"the prompt has {prompt_len} tokens; the model's context is {self.ctx}, "
                              "leave room to generate")
        if request.id is None:
            request.id = next(self._ids)
        if request.id in self.ids:
            raise MedusaError(f"a sequence with id {request.id!r} is already in the batch")
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(request.sampling.seed)
        stats = GenerationStats(prompt_tokens=prompt_len, accepted_per_depth=[0] * self.tree.depth_limit)
        t0 = time.perf_counter()
        cache = new_cache(self.model)
        logits, hidden = forward(self.model, ids, torch.arange(prompt_len, device=self.device)[None], None,
                                 cache, last_only=True)
        first = accept(ids[0, -1:], logits, self.root_only, request.sampling, generator)
        stats.new_tokens, stats.prefill_s = 1, time.perf_counter() - t0
        token = int(first.bonus)
        row = _Row(request, generator, stats, first.bonus, hidden[-1], prompt_len)
        reason = self._finish_reason(row, [token])
        if reason is None:
            self._join(cache)
            self.rows.append(row)
        return SequenceOutput(request.id, [token], reason is not None, reason, stats)

    @torch.inference_mode()
    def cancel(self, request_id: Hashable) -> bool:
        """Drop a sequence at once (its slot is free for the next add); False if it is unknown."""
        keep = [i for i, r in enumerate(self.rows) if r.request.id != request_id]
        if len(keep) == len(self.rows):
            return False
        self._keep_rows(keep)
        return True

    @torch.inference_mode()
    def step(self) -> list[SequenceOutput]:
        """One verification forward over every active sequence; finished ones leave the batch."""
        if not self.rows:
            return []
        t0 = time.perf_counter()
        rows, batch = self.rows, len(self.rows)
        use_tree = self.heads is not None and (self.max_tree_batch is None or batch <= self.max_tree_batch)
        tree = self.tree if use_tree else self.root_only
        bias = self.bias if use_tree else self.bias[:1, :1]  # [N, N]
        n = tree.num_nodes
        lengths = torch.tensor([r.length for r in rows], device=self.device)  # [B]
        slots = self.cache.get_seq_length()  # S
        # 1. propose: the heads read each row's last accepted position; same tree for all rows
        roots = torch.stack([r.root for r in rows])  # [B]
        if tree.max_depth:
            hidden_last = torch.stack([r.last_hidden for r in rows])  # [B, D]
            head_logits = self.heads(hidden_last, self.model.get_output_embeddings())  # [K, B, V]
            topk = head_logits.topk(tree.topk, dim=-1).indices  # [K, B, topk]
            tokens = torch.stack([tree_tokens(tree, roots[b], topk[:, b]) for b in range(batch)])  # [B, N]
        else:
            tokens = roots[:, None]  # [B, 1]
        # a row sees its own valid prefix and its tree ancestors; garbage slots stay hidden
        valid = torch.arange(slots, device=self.device)[None] < lengths[:, None]  # [B, S]
        prefix_bias = torch.zeros(valid.shape, dtype=self.dtype, device=self.device)
        prefix_bias.masked_fill_(~valid, torch.finfo(self.dtype).min)
        mask = torch.cat([prefix_bias[:, None].expand(batch, n, slots), bias.expand(batch, n, n)], -1)
        # positions past the context only occur in rows that accept the root alone (below)
        positions = (lengths[:, None] + tree.depth[None]).clamp(max=self.ctx - 1)  # [B, N]
        # 2. verify: one forward over every node of every row
        out = self.model.get_decoder()(input_ids=tokens, attention_mask=mask[:, None], position_ids=positions,
                                       cache=self.cache, use_cache=True)
        hidden = out.last_hidden_state  # [B, N, D]
        logits = lm_logits(self.model, hidden)  # [B, N, V]
        # 3. accept, row by row: each with its own sampling rule and generator; a row too
        #    close to the context end for a tree accepts the root alone, as decode.py does
        results = []
        for b, row in enumerate(rows):
            row_tree = tree if row.length + tree.depth_limit + 2 <= self.ctx else self.root_only
            m = row_tree.num_nodes
            results.append(accept(tokens[b, :m], logits[b, :m], row_tree, row.request.sampling, row.generator))
        # 4. commit: copy each row's accepted entries to [len_b, len_b + a_b), then crop
        self._commit(slots, [r.nodes for r in results])
        step_s = (time.perf_counter() - t0) / batch  # a step's time, shared by its rows
        outputs, keep = [], []
        for b, (row, result) in enumerate(zip(rows, results)):
            accepted = len(result.nodes)
            new = tokens[b, result.nodes[1:]].tolist() + [int(result.bonus)]
            row.root, row.last_hidden = result.bonus, hidden[b, result.nodes[-1]]
            row.length += accepted
            stats = row.stats
            stats.steps += 1
            stats.accepted_lengths.append(len(new))
            for d in range(len(new) - 1):
                stats.accepted_per_depth[d] += 1
            new = self._cut(row, new)
            stats.new_tokens += len(new)
            stats.decode_s += step_s
            reason = self._finish_reason(row, new)
            outputs.append(SequenceOutput(row.request.id, new, reason is not None, reason, stats))
            if reason is None:
                keep.append(b)
        if len(keep) < batch:
            self._keep_rows(keep)
        return outputs

    def run(self, requests: Iterable[BatchRequest]) -> dict[Hashable, list[int]]:
        """Decode all `requests` to the end (joining as slots free up): id -> new tokens."""
        pending, tokens = list(requests), {}
        while pending or self.rows:
            while pending and self.has_room:
                out = self.add(pending.pop(0))
                tokens[out.id] = list(out.tokens)
            for out in self.step():
                tokens[out.id] += out.tokens
        return tokens

    # --- helpers -------------------------------------------------------------------------

    def _eos(self, row: _Row) -> set[int]:
        ids = row.request.generation.eos_token_ids
        return self.eos if ids is None else set(ids)

    def _cut(self, row: _Row, new: list[int]) -> list[int]:
        """Cut a step's tokens at max_new_tokens and after the first EOS."""
        gen = row.request.generation
        new = new[: gen.max_new_tokens - row.stats.new_tokens]
        if not gen.ignore_eos:
            eos = self._eos(row)
            for i, t in enumerate(new):
                if t in eos:
                    return new[: i + 1]
        return new

    def _finish_reason(self, row: _Row, new: list[int]) -> str | None:
        """After `new` was emitted (and counted): "stop" on EOS, "length" at max_new_tokens or
        the context end, None while the sequence goes on."""
        gen = row.request.generation
        if not gen.ignore_eos and new and new[-1] in self._eos(row):
            return "stop"
        if row.stats.new_tokens >= gen.max_new_tokens or row.length + 1 >= self.ctx:
            return "length"
        return None

    def _join(self, cache) -> None:
        """Append a prefilled batch-1 cache as the last row, padding the shorter side along S."""
        if self.cache is None:
            self.cache = cache
            return
        for mine, theirs in zip(self.cache.layers, cache.layers):
            for name in ("keys", "values"):
                a, b = getattr(mine, name), getattr(theirs, name)  # [B, H, S, d], [1, H, T, d]
                slots = max(a.shape[-2], b.shape[-2])
                a = torch.nn.functional.pad(a, (0, 0, 0, slots - a.shape[-2]))
                b = torch.nn.functional.pad(b, (0, 0, 0, slots - b.shape[-2]))
                setattr(mine, name, torch.cat([a, b]))

    def _commit(self, slots: int, accepted: list[torch.Tensor]) -> None:
        """accepted[b] [A_b]: row b's accepted node indices in the block verified at `slots`."""
        rows = torch.cat([torch.full_like(nodes, b) for b, nodes in enumerate(accepted)])  # [M]
        src = torch.cat([slots + nodes for nodes in accepted])  # [M]
        dst = torch.cat([r.length + torch.arange(len(nodes), device=self.device)
                         for r, nodes in zip(self.rows, accepted)])  # [M]
        end = max(r.length + len(nodes) for r, nodes in zip(self.rows, accepted))
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                buf = getattr(layer, name)  # [B, H, S + N, d]
                buf[rows, :, dst] = buf[rows, :, src]  # the right side is gathered first
                setattr(layer, name, buf[..., :end, :])

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (in order) and crop S to the longest of them."""
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
            return
        index = torch.tensor(keep, device=self.device)
        end = max(r.length for r in self.rows)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                setattr(layer, name, getattr(layer, name).index_select(0, index)[..., :end, :])
