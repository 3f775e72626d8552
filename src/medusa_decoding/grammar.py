"""Structured outputs: a grammar (JSON schema, any JSON object, a regex, a Lark grammar) that every
emitted token must keep valid, checked by llguidance (a Rust matcher whose masks cost a fraction of
a step and whose schemas compile in milliseconds; it rolls back, which a tree needs; the choice
against xgrammar is measured in docs/SERVING.md).

Glossary: N tree nodes (root first), V vocabulary, W = ceil(V / 32) words of a bitmask.

Lossless under the constraint: each tree node's logits are masked by the grammar state reached
along that node's own path (the matcher consumes the path's candidates, the mask is read, the
matcher rolls back: `RowGrammar.masks`), so a node's masked logits are those plain constrained
decoding would have at that point, and acceptance (greedy or speculative sampling) follows the
masked distribution exactly. A candidate the grammar forbids has no probability at its parent
and is never accepted.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import torch

from .config import Grammar, GrammarKind, MedusaError
from .tree import TreeBuffers


# JSON as json.dumps writes it: one space after ":" and ",", none elsewhere (flexible whitespace let
# a model pad with newlines for ever), so the text is the one most models already prefer
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    # not llguidance.torch: importing it runs torch.compile on its masking kernel (~1.5 s of
    # inductor, then gcc on first use); the bitmask is filled and applied here instead
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise MedusaError("structured outputs need llguidance: pip install llguidance") from None
    return llguidance


class Grammars:
    """One tokenizer's grammar compiler (wrapping the tokenizer takes ~0.4 s: once per model)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        self._wrapped = None

    def row(self, grammar: Grammar) -> RowGrammar:
        """A fresh matcher of `grammar` for one row; an invalid grammar -> MedusaError naming why."""
        llg = _llguidance()
        if self._wrapped is None:
            self._wrapped = llg.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos or None)
        matcher = llg.LLMatcher
        try:
            if grammar.kind is GrammarKind.REGEX:
                text = matcher.grammar_from_regex(grammar.source)
            elif grammar.kind is GrammarKind.LARK:
                text = matcher.grammar_from_lark(grammar.source)
            else:
                schema = grammar.source if grammar.kind is GrammarKind.JSON_SCHEMA else '{"type": "object"}'
                json.loads(schema)
                text = matcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except (ValueError, TypeError) as e:
            raise MedusaError(f"invalid {grammar.kind.value} grammar: {e}") from None
        m = matcher(self._wrapped, text, log_level=0)
        if m.is_error():
            raise MedusaError(f"invalid {grammar.kind.value} grammar: {m.get_error()}")
        return RowGrammar(m, self.vocab_size)


class RowGrammar:
    """One row's matcher: what its output so far allows next. `spent_s` sums the time spent in the
    matcher and on masks, which the decoder takes each step (`take_time`)."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self._bits: torch.Tensor | None = None  # [N, W] int32, reused across steps
        self.spent_s = 0.0

    def take_time(self) -> float:
        """Seconds spent since the last call."""
        spent, self.spent_s = self.spent_s, 0.0
        return spent

    @contextmanager
    def _clock(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spent_s += time.perf_counter() - t0

    def masks(self, tokens: torch.Tensor, tree: TreeBuffers) -> torch.Tensor:
        """tokens [N] long (the root emitted and consumed already) -> bitmask [N, W] int32: at each
        node, the tokens the grammar allows after the node's path. A node whose own token the grammar
        forbids (never accepted: its parent's mask excludes it) keeps its parent's mask."""
        return self.walk(tokens, tree)[0]

    def walk(self, tokens: torch.Tensor, tree: TreeBuffers) -> tuple[torch.Tensor, list[bool]]:
        """tokens [N] long -> (masks [N, W] as `masks` gives them, valid [N]: the node's token and every
        ancestor's are allowed, so the node can be accepted; the root is valid)."""
        with self._clock():
            return self._walk(tokens, tree)

    def _walk(self, tokens: torch.Tensor, tree: TreeBuffers) -> tuple[torch.Tensor, list[bool]]:
        n = tokens.numel()
        if self._bits is None or self._bits.shape[0] < n:
            self._bits = new_bitmask(max(n, 8), self.vocab_size)
        bits = self._bits[:n]
        host = tokens.tolist()
        valid = [True] + [False] * (n - 1)
        children = tree.children if n > 1 else ((),)
        fill_mask(self.matcher, bits, 0)
        stack = [(c, 0) for c in reversed(children[0])]  # (node, its parent), depth first
        depth_of = {0: 0}
        consumed = 0  # path tokens the matcher holds beyond the root
        while stack:
            node, parent = stack.pop()
            if not valid[parent]:  # below a forbidden node: never accepted either
                bits[node] = bits[parent]
                stack.extend((c, node) for c in reversed(children[node]))
                continue
            # roll back to the parent's state: its path is what the matcher holds
            back = consumed - depth_of[parent]
            if back:
                self.matcher.rollback(back)
                consumed -= back
            token = host[node]
            word = int(bits[parent, token >> 5]) if token < self.vocab_size else 0
            if self.matcher.is_stopped() or not (word >> (token & 31)) & 1:
                bits[node] = bits[parent]  # forbidden here (or the end): never accepted, its subtree neither
                stack.extend((c, node) for c in reversed(children[node]))
                continue
            if not self.matcher.consume_token(token):
                raise MedusaError(f"the grammar's mask allowed token {token} and its matcher refused it")
            consumed += 1
            depth_of[node] = consumed
            valid[node] = True
            fill_mask(self.matcher, bits, node)
            stack.extend((c, node) for c in reversed(children[node]))
        if consumed:
            self.matcher.rollback(consumed)
        return bits, valid

    def apply(self, logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """apply_masks, its time counted."""
        with self._clock():
            return apply_masks(logits, bits)

    def consume(self, tokens: list[int]) -> None:
        """Tokens emitted (each one its mask allowed)."""
        with self._clock():
            for t in tokens:
                if self.matcher.is_stopped():
                    return
                if not self.matcher.consume_token(t):
                    raise MedusaError(f"token {t} breaks the grammar ({self.matcher.get_error()})")

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here (none where it leaves a choice)."""
        with self._clock():
            return list(self.matcher.compute_ff_tokens())


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, W] int32, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_mask(matcher, bits: torch.Tensor, row: int) -> None:
    """Row `row` of bits [N, W] int32 (CPU, contiguous) <- the tokens `matcher` allows next."""
    v = bits[row]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


def apply_masks(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32 (a copy: changed in place), bits [N, W] -> logits with every token the
    grammar forbids at -inf (vocabulary entries past the bitmask's are forbidden)."""
    n, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.to(logits.device)[:, :, None] >> shifts) & 1).bool().reshape(n, -1)  # [N, 32 W]
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(n, vocab - allowed.shape[1])], 1)
    return logits.masked_fill_(~allowed[:, :vocab], float("-inf"))
