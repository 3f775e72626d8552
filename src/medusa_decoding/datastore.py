"""A token datastore: the base model's own answers (its self-distilled data), searched for the
longest suffix of the context; what followed there most often is a draft chain (REST's retrieval,
He et al. 2023, over the model's own greedy outputs). The n-gram branch (proposers/ngram.py)
copies from the context first and asks the datastore where the context has no match.

Glossary: C datastore tokens (answers, each followed by a separator), T context length, L chain
length.

The index is a suffix array cut at DEPTH tokens: suffixes ordered by their first DEPTH tokens
(prefix doubling, ~1 s for 2 M tokens, done at load), so the suffixes that start with a query of
n tokens are one contiguous range, and within it those that go on with the same next token are
contiguous too (up to DEPTH tokens in all). A lookup finds the range of the longest suffix of the
context that occurs (n from max_ngram down to min_ngram), then walks the continuations: the most
frequent next token, its range, the most frequent token after it, and so on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .config import MedusaError

DEPTH = 16  # tokens a suffix is ordered by: a query plus its chain, at most
SEPARATOR = -1  # after each answer: no chain runs across it
LEAD = 3  # tokens kept before each answer (the chat template's assistant header): how answers open
_KEY_TOKENS = 3  # tokens packed into one int64 key (21 bits each): the first search is np.searchsorted
_BITS = 21


def suffix_order(tokens: np.ndarray, depth: int = DEPTH) -> np.ndarray:
    """tokens [C] int -> order [C] int64: start positions, sorted by the next `depth` tokens (prefix
    doubling: each pass orders by twice as many tokens; positions past the end rank lowest)."""
    n = len(tokens)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64) + 1  # [C] dense, >= 1
    span = 1
    while span < depth:
        after = np.zeros(n, dtype=np.int64)  # [C] rank of the token `span` later (0 past the end)
        after[:-span] = rank[span:]
        key = rank * (n + 2) + after
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.concatenate([[1], 1 + np.cumsum(sorted_key[1:] != sorted_key[:-1])])
        span *= 2
    return np.argsort(rank, kind="stable")


class Datastore:
    """Answers' token ids and their suffix order; `lookup(context)` -> a draft chain."""

    def __init__(self, tokens: np.ndarray):
        """tokens [C] int: answers, each followed by SEPARATOR."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or not len(tokens):
            raise MedusaError("a datastore needs a non-empty 1-D array of token ids")
        if tokens.min() < SEPARATOR or tokens.max() >= (1 << _BITS) - 1:
            raise MedusaError(f"datastore token ids must lie in [0, {(1 << _BITS) - 1}) (and {SEPARATOR} between answers)")
        self.size = len(tokens)
        self.tokens = np.concatenate([tokens, np.full(DEPTH, SEPARATOR, dtype=np.int64)])  # [C + DEPTH]
        self.order = suffix_order(tokens)  # [C]
        # [C] the first _KEY_TOKENS tokens of each ordered suffix as one int64 (separators 0): non-decreasing
        shifted = self.tokens + 1
        self.keys = np.zeros(self.size, dtype=np.int64)
        for i in range(_KEY_TOKENS):
            self.keys = (self.keys << _BITS) | shifted[self.order + i]

    @classmethod
    def from_answers(cls, answers: Iterable[Sequence[int]]) -> Datastore:
        parts = [np.asarray([*a, SEPARATOR], dtype=np.int64) for a in answers if len(a)]
        if not parts:
            raise MedusaError("no answers to build a datastore from")
        return cls(np.concatenate(parts))

    def _range(self, query: np.ndarray) -> tuple[int, int]:
        """query [n] -> [lo, hi): the ordered suffixes that start with it."""
        head = query[:_KEY_TOKENS] + 1
        low = high = 0
        for i in range(_KEY_TOKENS):  # a shorter query matches every token after it: 0 .. all ones
            low = (low << _BITS) | (int(head[i]) if i < len(head) else 0)
            high = (high << _BITS) | (int(head[i]) if i < len(head) else (1 << _BITS) - 1)
        lo, hi = int(np.searchsorted(self.keys, low, "left")), int(np.searchsorted(self.keys, high, "right"))
        for i in range(_KEY_TOKENS, len(query)):  # the rest one token at a time: each a sorted sub-range
            column = self.tokens[self.order[lo:hi] + i]
            t = int(query[i])
            lo, hi = lo + int(np.searchsorted(column, t, "left")), lo + int(np.searchsorted(column, t, "right"))
            if lo >= hi:
                break
        return lo, hi

    def lookup(self, context: np.ndarray, length: int, max_ngram: int, min_ngram: int) -> np.ndarray | None:
        """context [T] int64 (the root last) -> up to `length` tokens [<= L] that most often followed
        the longest suffix of it (max_ngram down to min_ngram tokens) in the datastore, or None."""
        for n in range(min(max_ngram, len(context), DEPTH - 1), min_ngram - 1, -1):
            lo, hi = self._range(context[-n:])
            if lo >= hi:
                continue
            chain = []
            for j in range(n, min(n + length, DEPTH)):
                following = self.tokens[self.order[lo:hi] + j]  # sorted within the range
                cuts = np.flatnonzero(following[1:] != following[:-1]) + 1
                starts = np.concatenate([[0], cuts])
                ends = np.concatenate([cuts, [len(following)]])
                g = int(np.argmax(ends - starts))  # the most frequent next token (the first, on a tie)
                token = int(following[starts[g]])
                if token == SEPARATOR:
                    break
                chain.append(token)
                lo, hi = lo + int(starts[g]), lo + int(ends[g])
            return np.asarray(chain, dtype=np.int64) if chain else None
        return None

    def save(self, path: str | Path, metadata: dict | None = None) -> None:
        """Answers as uint16 where every id fits (the separator as 65535), else int32."""
        from safetensors.numpy import save_file

        tokens = self.tokens[: self.size]
        if tokens.max() < np.iinfo(np.uint16).max:
            stored = np.where(tokens == SEPARATOR, np.iinfo(np.uint16).max, tokens).astype(np.uint16)
        else:
            stored = tokens.astype(np.int32)
        meta = {k: json.dumps(v) for k, v in (metadata or {}).items()}
        save_file({"tokens": stored}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> Datastore:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        path = Path(path).expanduser()
        if not path.is_file():
            raise MedusaError(f"no datastore at {path}")
        try:
            stored = load_file(str(path))["tokens"]
        except (SafetensorError, KeyError, OSError, ValueError) as e:
            raise MedusaError(f"{path} is not a datastore ({e})") from None
        tokens = stored.astype(np.int64)
        if stored.dtype == np.uint16:
            tokens[stored == np.iinfo(np.uint16).max] = SEPARATOR
        return cls(tokens)
