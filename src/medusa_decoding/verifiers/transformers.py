"""Any Hugging Face causal LM as a verifier, driven through its public forward: a 4D additive
mask, position_ids and a cache object (no patched or copied modeling code).

Glossary: R cache rows, B rows of a step, T prompt length, N nodes of a step, W the step's block
start (the longest row's length), S slots read, D hidden, V vocabulary.

- Models with full attention in every layer run on a `SlotCache`: every row's keys/values are
  preallocated; a step writes every row's N nodes at slots [W, W + N) (rows shorter than W leave
  a masked gap), and commit moves each row's accepted nodes to [length, length + A). A released
  row's place is taken by the last row, so the active rows are always rows [0, B).
- Other models (sliding-window layers) run on transformers' DynamicCache, one row at a time,
  while the sequence fits the window.
"""

from __future__ import annotations

import torch

from ..kernels.attention import full_attention
from ..cache import SlotCache, keep_path, new_cache
from ..config import MedusaError, Numerics
from ..tree import TreeBuffers
from . import Row, Verifier
from ..kernels import lean_linears


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., D] -> logits [..., V] through the base LM head (and its soft-capping, if any)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def forward(model, input_ids, position_ids, mask, cache, last_only: bool = False,
            layers: tuple[int, ...] | None = None):
    """One base forward: input_ids [B, n], position_ids [B, n], mask [B, 1, n, S] additive or None
    (causal) -> logits [B, n, V] (or [B, 1, V]), hidden [B, n, D] (after the final norm).

    layers: the hidden states a drafter reads instead (indices into the decoder's hidden states:
    0 the embeddings, L the last layer's after the final norm) -> hidden [B, n, len(layers) D],
    concatenated in that order."""
    out = model.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                              use_cache=True, output_hidden_states=layers is not None)
    logits = lm_logits(model, out.last_hidden_state[:, -1:] if last_only else out.last_hidden_state)
    if layers is None:
        return logits, out.last_hidden_state
    return logits, torch.cat([out.hidden_states[i] for i in layers], dim=-1)


def check_layers(model, layers: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """Hidden-state indices a drafter asks for, checked against the base's depth."""
    if layers is None:
        return None
    depth = model.config.get_text_config().num_hidden_layers
    if not layers or any(not 0 <= i <= depth for i in layers):
        raise MedusaError(f"feature layers {list(layers)} do not fit a base of {depth} layers (0 .. {depth})")
    return tuple(int(i) for i in layers)


class EagerBackend:
    """The model's own forward, eager; one per base model, shared by its verifiers."""

    compiled = False

    def __init__(self, model, slots: bool | None = None, packed: bool | None = None, like: EagerBackend | None = None,
                 numerics: Numerics = Numerics.FP32):
        """slots: run on the slot cache (default: where every layer is full attention); False:
        transformers' DynamicCache, the reference path. packed: run the linear layers on lean weights
        (lean_linears: prepacked in bf16/fp16, GGUF blocks in fp32; default: on the slot cache, where
        they are supported and each row of a product is checked to be the one-row product); `model`
        itself is left stock. like: a packed backend on the same model whose lean layers this one
        shares (making them takes seconds). numerics: the arithmetic of layers on a GGUF's blocks
        (config.Numerics); anything but fp32 is refused where the layers are not on blocks."""
        self.base = model
        self.device = next(model.parameters()).device
        self.dtype = model.dtype
        self.slots = full_attention(model.config) if slots is None else slots
        lean = self.slots if packed is None else packed
        self.numerics = Numerics.parse(numerics)
        shared = like is not None and like.base is model and like.packed and lean and like.numerics is self.numerics
        self.model = like.model if shared else lean_linears(model, self.numerics) if lean else model
        self.packed = self.model is not model
        self.linears = "stock" if not self.packed else "packed" if self.dtype != torch.float32 else "blocks"
        if self.numerics is not Numerics.FP32:
            self.linears += f"-{self.numerics.value}"
            if not self.packed or self.dtype != torch.float32:
                raise MedusaError(f"numerics {self.numerics.value} is built for linears on a GGUF's blocks "
                                  "(fp32 on a CPU with AVX2, a model loaded from a Q4_1/Q8_0 GGUF); use --numerics fp32")
        text = model.config.get_text_config()
        self.context_length = text.max_position_embeddings
        window = getattr(text, "sliding_window", None)
        if not self.slots and window:  # a 4D mask stands for the sliding one only inside the window
            self.context_length = min(self.context_length, window)
        self.compile_s = 0.0

    def new_cache(self, capacity: int, rows: int) -> SlotCache:
        return SlotCache(self.model, capacity, rows)

    def width(self, slots: int) -> int:
        """Slots a step over `slots` reads (compiled steps round it up)."""
        return slots

    def step(self, tokens, positions, mask, cache, layers: tuple[int, ...] | None = None):
        """tokens [B, n], positions [B, n], mask [B, 1, n, S] or None -> logits [B, n, V], hidden
        [B, n, D] (or the hidden states of `layers`, see forward)."""
        return forward(self.model, tokens, positions, mask, cache, layers=layers)

    def release(self, cache) -> None:
        """A verifier is done with `cache`."""

    def drafting(self, drafter):
        """Compiled drafting for `drafter` (compiled.DraftGraphs); eager: none."""
        return None

    def warmup(self, sizes: list[int], max_slots: int) -> float:
        """Compile ahead of time (compiled.py); nothing to do when eager."""
        return 0.0

    def stats(self) -> dict:
        return {"backend": "eager" if not self.packed else f"eager-{self.linears}",
                "cache": "slots" if self.slots else "dynamic"}


class TransformersVerifier(Verifier):
    """One decoder's rows on a backend (eager or compiled)."""

    def __init__(self, backend: EagerBackend, rows_hint: int = 1, feature_layers: tuple[int, ...] | None = None):
        """feature_layers: the base hidden states its drafter reads (None: the last, after the final
        norm); every hidden it returns is those layers' states, concatenated."""
        self.backend = backend
        self.feature_layers = check_layers(backend.model, feature_layers)
        self.model = backend.model
        self.context_length = backend.context_length
        self.max_rows = None if backend.slots else 1
        self.rows_hint = rows_hint
        self.rows: list[Row] = []  # rows[i].index == i
        self.cache = None
        self._block = 0  # the last step's block start W

    def add(self, input_ids: torch.Tensor, room: int):
        """input_ids [T] -> (row, logits [V], hidden [T, D] or [T, len(feature_layers) D]); room: tokens
        it may still generate."""
        t = input_ids.shape[-1]
        if t == 0:
            raise MedusaError("the prompt is empty")
        if t >= self.context_length:
            raise MedusaError(f"the prompt has {t} tokens; the model's context is {self.context_length}, "
                              "leave room to generate")
        if self.max_rows is not None and len(self.rows) >= self.max_rows:
            raise MedusaError("this model (sliding-window layers) is decoded one sequence at a time")
        ids = input_ids.reshape(1, t).to(self.backend.device)
        positions = torch.arange(t, device=ids.device)[None]
        row = Row(index=len(self.rows), length=t)
        if not self.backend.slots:
            self.cache = new_cache(self.model)
            logits, hidden = forward(self.model, ids, positions, None, self.cache, last_only=True,
                                     layers=self.feature_layers)
        else:
            capacity = min(t + room + 64, self.context_length + 64)  # + room for the widest tree
            if self.cache is None:
                self.cache = self.backend.new_cache(capacity, max(self.rows_hint, 1))
            self.cache.grow(self.backend.width(capacity), row.index + 1, keep=max((r.length for r in self.rows), default=0))
            self.cache.reserve(slice(row.index, row.index + 1), 0, t)
            logits, hidden = forward(self.model, ids, positions, None, self.cache, last_only=True,
                                     layers=self.feature_layers)
        self.rows.append(row)
        return row, logits[0, -1], hidden[0]

    def verify(self, rows: list[Row], tokens: list[torch.Tensor], trees: list[TreeBuffers]):
        """tokens [n_b] long and trees (n_b nodes) of every active row -> logits [B, N, V], hidden [B, N, D],
        in the order of `rows`."""
        if len(rows) != len(self.rows):
            raise ValueError(f"a step verifies every active row: got {len(rows)} of {len(self.rows)}")
        b, device, dtype = len(rows), self.backend.device, self.backend.dtype
        n = max(t.numel() for t in tokens)
        block = max(r.length for r in rows)
        order = [r.index for r in rows]  # cache row of each input
        width = self.backend.width(block + n)
        ids = torch.zeros(b, n, dtype=torch.long, device=device)
        positions = torch.empty(b, n, dtype=torch.long, device=device)
        mask = None
        if b > 1 or n > 1 or self.backend.compiled or block + n != width:
            mask = torch.full((b, n, width), torch.finfo(dtype).min, dtype=dtype, device=device)
        for row, toks, tree in zip(rows, tokens, trees):
            i, m = row.index, toks.numel()
            ids[i, :m] = toks
            positions[i, :m] = row.length + tree.depth
            positions[i, m:] = row.length
            if mask is not None:
                mask[i, :, : row.length] = 0
                mask[i, :m, block : block + m].masked_fill_(tree.mask, 0)
                if m < n:  # padding nodes see themselves (their results are never read)
                    pad = torch.arange(m, n, device=device)
                    mask[i, pad, block + pad] = 0
        if self.backend.slots:
            self.cache.grow(width, b, keep=block)
            self.cache.reserve(slice(0, b), block, n, width)
        elif self.cache.get_seq_length() != block:
            raise MedusaError("the dynamic cache holds one row")
        logits, hidden = self.backend.step(ids, positions, None if mask is None else mask[:, None], self.cache,
                                           self.feature_layers)
        self._block = block
        if order != list(range(b)):
            logits, hidden = logits[order], hidden[order]
        return logits, hidden

    def commit(self, rows: list[Row], nodes: list[torch.Tensor]) -> None:
        """nodes [A_b] of each row (indices into its tree, root first): keep those entries."""
        if self.backend.slots:
            self.cache.keep(self._block, [(r.index, r.length, a) for r, a in zip(rows, nodes)])
        else:
            keep_path(self.cache, self._block, nodes[0])
        for row, a in zip(rows, nodes):
            row.length += a.numel()

    def release(self, row: Row) -> None:
        """The row's sequence ended (or was cancelled): its place goes to the last row."""
        if row not in self.rows:
            return
        last = self.rows.pop()
        if last is not row:
            if self.backend.slots:
                self.cache.move_row(last.index, row.index, last.length)
            last.index = row.index
            self.rows[row.index] = last
        if not self.rows:
            self.backend.release(self.cache)
            self.cache = None

    def stats(self) -> dict:
        return self.backend.stats()
