"""The n-gram branch (prompt lookup): tokens copied from the context after an earlier occurrence
of its last n tokens. It wraps any proposer, or none (prompt lookup alone): its chain hangs under
the root of the other proposer's tree, verified in the same forward.

Glossary: T context length, L chain length, N tree nodes (root first).

Where the context has no match, the chain comes from a datastore of the base model's own answers
(datastore.py) when the model has one: the phrases it answers with, retrieved by the longest
suffix of the context.

Copy steps are its own policy: after a step that accepted `copy_run` or more chain tokens the
answer is copying its context, so the next step verifies a longer chain alone (no drafting).
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from ..config import NgramConfig
from ..datastore import Datastore
from ..tree import TreeBuffers, build_tree, with_chain
from . import Branch, Proposal, Proposer, Source


def lookup(context: np.ndarray, config: NgramConfig, length: int) -> np.ndarray | None:
    """context [T] int64 (the root last) -> the <= `length` tokens that followed the latest earlier
    occurrence of its last n tokens (n from max_ngram down to min_ngram), or None."""
    for n in range(min(config.max_ngram, len(context) - 1), config.min_ngram - 1, -1):
        windows = sliding_window_view(context[:-1], n)  # [T-n, n]: every earlier n-gram
        hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
        if hits.size:
            start = hits[-1] + n
            found = context[start : start + length]
            return found if len(found) else None
    return None


def agreed(chain: np.ndarray, following: np.ndarray) -> int:
    """Leading tokens of `chain` equal to `following` (the tokens that come next): what greedy
    acceptance keeps of it, at most len(following)."""
    n = min(len(chain), len(following))
    same = chain[:n] == following[:n]
    return n if same.all() else int(np.argmin(same))


def padded(tokens: np.ndarray, length: int, device) -> torch.Tensor:
    """tokens [<= L] -> [L] long: a short chain repeats its last token (a wrong guess is simply
    rejected; the verification decides)."""
    out = np.full(length, tokens[-1], dtype=np.int64)
    out[: len(tokens)] = tokens
    return torch.from_numpy(out).to(device)


class NgramBranch(Proposer):
    """`inner`'s proposals (None: the root alone) plus the n-gram chain when the context (else the
    datastore, if any) has one."""

    def __init__(self, inner: Proposer | None, config: NgramConfig, store: Datastore | None = None):
        self.inner, self.config, self.store = inner, config, store
        self.depth_limit = max(inner.depth_limit if inner else 0, config.copy_chain)
        self.context = np.zeros(0, dtype=np.int64)  # [T]: prompt and emitted tokens, the root last
        self.copying = False  # the last step accepted copy_run chain tokens or more
        self.last: Proposal | None = None
        self.steps = 0  # proposals that carried its chain
        self.copy_steps = 0  # of them, the chain alone after a step that copied
        self._chains: dict[int, TreeBuffers] = {}  # L -> the chain alone under the root
        self._joined: dict[tuple[int, int], tuple[TreeBuffers, TreeBuffers]] = {}  # a static tree + chain

    def start(self, prompt: torch.Tensor) -> None:
        self.context = np.asarray(prompt.tolist(), dtype=np.int64)
        if self.inner is not None:
            self.inner.start(prompt)

    def use_graphs(self, graphs) -> None:
        if self.inner is not None:
            self.inner.use_graphs(graphs)

    def propose(self, root: torch.Tensor, budget: int | None = None) -> Proposal | None:
        self.last = None
        if budget == 1:
            return None
        cfg, copying = self.config, self.copying
        length = cfg.copy_chain if copying else cfg.length
        chain = lookup(self.context, cfg, length)
        if chain is None and self.store is not None:
            chain = self.store.lookup(self.context, length, cfg.store_max_ngram, cfg.store_min_ngram)
        base = None
        if not (copying and chain is not None) and self.inner is not None:
            base = self.inner.propose(root, budget)
        if chain is None:
            return base
        tokens = padded(chain, length, root.device)  # [L]
        branch = Branch(Source.NGRAM, length)
        if base is None:  # the chain alone
            if length not in self._chains:
                self._chains[length] = build_tree([], length).to(root.device)
            self.last = Proposal(torch.cat([root.reshape(1), tokens]), self._chains[length], (branch,))
            self.copy_steps += copying
        else:
            self.last = base.with_branch(tokens, self._join(base.tree, length), branch)
        self.steps += 1
        return self.last

    def _join(self, tree: TreeBuffers, length: int) -> TreeBuffers:
        """A static tree comes back every step: its joined tree is built once."""
        key = (id(tree), length)
        hit = self._joined.get(key)
        if hit is not None and hit[0] is tree:
            return hit[1]
        joined = with_chain(tree, length)
        if tree.paths:  # a static tree (per-step trees have no paths)
            self._joined[key] = (tree, joined)
        return joined

    def observe(self, hidden, next_tokens, nodes) -> None:
        cfg, last = self.config, self.last
        fresh = next_tokens[-1:] if nodes is None else next_tokens  # the prefill's are prompt tokens
        self.context = np.concatenate([self.context, np.asarray(fresh.tolist(), dtype=np.int64)])
        self.copying = False
        if last is not None and nodes is not None and len(nodes) > 1:
            on_chain = last.source_of(int(nodes[1])) is Source.NGRAM
            self.copying = on_chain and cfg.copies_after(len(nodes) - 1)
        if self.inner is not None:
            self.inner.observe(hidden, next_tokens, nodes)

    def counters(self) -> dict[str, int]:
        inner = self.inner.counters() if self.inner is not None else {}
        return inner | {"ngram_steps": self.steps, "copy_steps": self.copy_steps}
