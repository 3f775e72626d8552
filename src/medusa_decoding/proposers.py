"""Drafts that do not come from the heads: n-grams copied from the context.

Glossary: T context length, L n-gram branch length.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from .config import NgramConfig


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""

    def __init__(self, config: NgramConfig):
        self.config = config

    def propose(self, context: np.ndarray, length: int | None = None) -> np.ndarray | None:
        """context [T] int64 (prompt and emitted tokens, the root last) -> tokens [<= L] or None
        (L: `length`, default the config's)."""
        cfg = self.config
        length = length or cfg.length
        for n in range(min(cfg.max_ngram, len(context) - 1), cfg.min_ngram - 1, -1):
            windows = sliding_window_view(context[:-1], n)  # [T-n, n]: every earlier n-gram
            hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
            if hits.size:
                start = hits[-1] + n
                return context[start : start + length]
        return None

    def padded(self, proposal: np.ndarray, device, length: int | None = None) -> torch.Tensor:
        """tokens [<= L] -> [L] long (L: `length`, default the config's): short proposals repeat
        their last token (a wrong guess is simply rejected; the verification decides)."""
        out = np.full(length or self.config.length, proposal[-1], dtype=np.int64)
        out[: len(proposal)] = proposal
        return torch.from_numpy(out).to(device)
