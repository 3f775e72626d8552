"""The decode loop: one `Decoder` for B >= 1 rows, what a row asks (Request) and emits (RowOutput).

Glossary: B active rows (sequences), T prompt length, N tree nodes of a row's step (root first),
A accepted nodes (root included), D hidden size, V vocabulary.

One loop for B >= 1 rows (`Decoder.step`): 1 propose (each row's proposer), 2 verify (one
forward over every row's tree), 3 accept (each row's rule and generator), 4 commit (keep each
row's accepted path). `MedusaModel.generate` and `stream` are its one-row case; continuous
batching (the server) is `add` and `cancel` between steps. Greedy output of every row is
token-identical to plain decoding of that row alone, whatever the drafts.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

from ..acceptance import History, accept, penalize, token_logprobs
from ..config import GenerationConfig, MedusaError, NgramConfig, SamplingConfig
from ..datastore import Datastore
from ..grammar import Grammars, RowGrammar
from ..proposers import Drafter, Proposer, Source
from ..proposers.constrained import GrammarFilter
from ..proposers.forced import ForcedBranch
from ..proposers.ngram import NgramBranch
from ..tree import TreeBuffers, build_tree
from ..verifiers import Verifier
from .policy import AdaptiveSpeculation, FixedSpeculation

ROOT_ONLY = build_tree([])


@dataclass
class GenerationStats:
    """Per-sequence counters; a step is one verification forward."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    # tokens emitted per step, bonus included (the first token, from the prefill, is not a step)
    accepted_lengths: list[int] = field(default_factory=list)
    # accepted_per_depth[d]: steps in which a depth-(d+1) candidate was accepted
    accepted_per_depth: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # this sequence's share of its steps' time
    accepted_by: dict[str, int] = field(default_factory=dict)  # candidates accepted, by Source (draft, ngram, forced)
    counters: dict[str, int] = field(default_factory=dict)  # its proposers' own (Proposer.counters)
    nodes: int = 0  # tree nodes verified, summed over steps
    grammar_s: float = 0.0  # time in the grammar's matcher and masks (structured outputs), within prefill_s and decode_s

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / max(len(self.accepted_lengths), 1)

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [a / max(self.steps, 1) for a in self.accepted_per_depth]

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def record(self, accepted: int) -> None:
        """A step emitted `accepted` tokens (bonus included)."""
        self.steps += 1
        self.accepted_lengths.append(accepted)
        if len(self.accepted_per_depth) < accepted - 1:
            self.accepted_per_depth += [0] * (accepted - 1 - len(self.accepted_per_depth))
        for d in range(accepted - 1):
            self.accepted_per_depth[d] += 1

    def summary(self) -> str:
        depth = " ".join(f"{a:.2f}" for a in self.acceptance_per_depth)
        return (
            f"{self.new_tokens} tokens in {self.wall_s:.2f} s ({self.tokens_per_s:.1f} tok/s), "
            f"{self.steps} steps, mean accepted length {self.mean_accepted_length:.2f}"
            + (f", acceptance per depth [{depth}]" if depth else "")
            + f", prefill {self.prefill_s * 1000:.0f} ms"
            + (f", grammar {self.grammar_s * 1000:.0f} ms" if self.grammar_s else "")
        )

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "steps": self.steps,
            "mean_accepted_length": self.mean_accepted_length, "acceptance_per_depth": self.acceptance_per_depth,
            "accepted_lengths": self.accepted_lengths, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
            "tokens_per_s": self.tokens_per_s, "accepted_by": dict(self.accepted_by),
            "counters": dict(self.counters), "grammar_s": self.grammar_s,
        }


@dataclass
class Request:
    """One sequence to decode."""

    input_ids: torch.Tensor  # [T] long (or [1, T])
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    id: Hashable | None = None  # None: the decoder numbers it
    stats: GenerationStats | None = None  # filled in as it decodes (None: a new one)
    speculative: bool = True  # False: this row decodes plainly (the root alone), whatever the method


@dataclass
class RowOutput:
    """What one sequence emitted in one call of `add` or `step`."""

    id: Hashable
    tokens: list[int]  # the new tokens (EOS included when it ended the sequence)
    finished: bool
    finish_reason: str | None  # "stop" (EOS) or "length" (max_new_tokens or context), once finished
    stats: GenerationStats
    step: int = 0  # the step that emitted them (0: the prefill)
    depths: list[int] = field(default_factory=list)  # per token: its depth in the tree (0: prefill or bonus)
    sources: list[Source] = field(default_factory=list)  # per token
    # per token, where the request asked (GenerationConfig.logprobs): its log-probability under the
    # base model and the most likely (id, logprob) alternatives (acceptance.token_logprobs)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    drafted: int = 0  # candidates this step verified for the row (its tree's nodes below the root)
    grammar_s: float = 0.0  # this call's time in the row's grammar (matcher, masks, filtering)


@dataclass
class Method:
    """How rows propose: a drafter (None: plain decoding) and an n-gram branch (None: none)."""

    drafter: Drafter | None = None
    ngram: NgramConfig | None = None
    store: Datastore | None = None  # where the n-gram branch looks when the context has no match

    def proposer(self, grammar: RowGrammar | None = None) -> Proposer:
        """A row's proposer: the drafter's, with the grammar's forced tokens beside it where the row has
        a grammar (and the method speculates), then the n-gram branch, then (with a grammar) the
        filter that drops the candidates the grammar forbids."""
        constrained = grammar is not None and self.speculative
        inner = self.drafter.proposer() if self.drafter is not None else None
        if constrained:
            inner = ForcedBranch(inner or Proposer(), grammar)
        if self.ngram is not None:
            inner = NgramBranch(inner, self.ngram, self.store)
        if constrained:  # outermost: every candidate of the tree filtered
            scored = self.drafter is not None and self.drafter.scored
            return GrammarFilter(inner, grammar, self.drafter.default_budget if scored else None)
        return inner or Proposer()

    @property
    def speculative(self) -> bool:
        return self.drafter is not None or self.ngram is not None

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The base hidden states its proposers read (what its verifier must return)."""
        return self.drafter.feature_layers if self.drafter is not None else None

    def tree_sizes(self) -> list[int]:
        """Node counts of this method's verification steps (the shapes a compiled backend needs)."""
        trees = self.drafter.tree_sizes() if self.drafter is not None else {1}
        sizes = {1} | trees  # 1: steps near the context end
        if self.ngram:  # with the n-gram chain, and the chain alone on copy steps
            sizes |= {n + self.ngram.length for n in trees} | {1 + self.ngram.copy_chain}
        return sorted(sizes)

    @property
    def default_budget(self) -> int:
        """Its own budget (the n-gram branch alone: 2, any budget above 1 turns it on)."""
        if self.drafter is not None:
            return self.drafter.default_budget
        return 2 if self.ngram is not None else 1

    def adaptive(self) -> AdaptiveSpeculation | None:
        """A load policy over its budgets: plain, half its own, its own (None when plain); one
        row keeps its own (fitted to this machine at one row) unless another measures faster."""
        if not self.speculative:
            return None
        budget = self.default_budget
        return AdaptiveSpeculation({1, max(budget // 2, 1), budget}, prefer=budget)

    def describe(self) -> str:
        parts = [self.drafter.describe()] if self.drafter is not None else []
        if self.ngram:
            parts.append(f"{self.ngram.length}-token n-gram branch" + (" (context, then datastore)" if self.store else ""))
        return " + ".join(parts) or "plain"


@dataclass(eq=False)
class _Seq:
    """A sequence in the decoder: everything its next step needs."""

    request: Request
    proposer: Proposer
    row: object  # the verifier's Row
    generator: torch.Generator | None
    stats: GenerationStats
    eos: set[int]
    root: torch.Tensor  # [] long: the last emitted token, not yet in the cache
    history: History | None = None  # what its penalties read (None: the request has none)
    grammar: RowGrammar | None = None  # what its output must keep matching (None: free text)


def scored_logits(logits: torch.Tensor, tokens: torch.Tensor, tree: TreeBuffers, sampling: SamplingConfig,
                  history: History | None, grammar: RowGrammar | None, masks: torch.Tensor | None = None) -> torch.Tensor:
    """A row's logits [N, V] as its acceptance reads them: penalized where it asks (history), and each
    node's masked by the grammar state its own path reaches (a copy: the raw logits stay for logprobs).
    masks [N, W]: those states' masks where the proposal's grammar filter read them already."""
    if history is not None:
        logits = penalize(logits, tokens, tree, history, sampling)  # a float32 copy
    elif grammar is not None:
        logits = logits.to(torch.float32, copy=True)
    if grammar is not None:
        logits = grammar.apply(logits, masks if masks is not None else grammar.masks(tokens, tree))
    return logits


class Decoder:
    """Decode up to `max_batch_size` sequences together, one verification forward per step.
    Not thread-safe: one owner calls add / step / cancel."""

    def __init__(self, verifier: Verifier, method: Method, eos_token_ids: Iterable[int], max_batch_size: int = 1,
                 policy: FixedSpeculation | AdaptiveSpeculation | None = None, grammars: Grammars | None = None):
        """grammars: the compiler of structured outputs' grammars (None: requests with one are refused)."""
        if max_batch_size < 1:
            raise MedusaError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.verifier, self.method = verifier, method
        if getattr(verifier, "feature_layers", None) != method.feature_layers:
            raise MedusaError(f"the verifier returns the hidden states of layers {getattr(verifier, 'feature_layers', None)}, "
                              f"the drafter reads {method.feature_layers}")
        self.eos = {int(e) for e in eos_token_ids}
        self.max_batch_size = min(max_batch_size, verifier.max_rows or max_batch_size)
        self.policy = policy or FixedSpeculation()
        self.grammars = grammars
        self.ctx = verifier.context_length
        # the drafter's drafting compiled where the base's steps are (None: eager)
        backend = getattr(verifier, "backend", None)
        self.drafting = backend.drafting(method.drafter) if backend is not None else None
        self.seqs: list[_Seq] = []
        self._ids = itertools.count()
        self._root_only: TreeBuffers | None = None

    @property
    def has_room(self) -> bool:
        return len(self.seqs) < self.max_batch_size

    @property
    def ids(self) -> list[Hashable]:
        return [s.request.id for s in self.seqs]

    def __len__(self) -> int:
        return len(self.seqs)

    @torch.inference_mode()
    def add(self, request: Request) -> RowOutput:
        """Prefill a new sequence and join it to the batch -> its first token. A sequence that ends
        on that token (EOS, max_new_tokens 1, context) takes no place."""
        if not self.has_room:
            raise MedusaError(f"the batch is full ({self.max_batch_size} sequences)")
        if request.id is None:
            request.id = next(self._ids)
        if request.id in self.ids:
            raise MedusaError(f"a sequence with id {request.id!r} is already in the batch")
        ids = request.input_ids.reshape(-1)
        gen = request.generation
        grammar = None
        if gen.grammar is not None:
            if self.grammars is None:
                raise MedusaError("this decoder has no grammar compiler: structured outputs are not served here")
            grammar = self.grammars.row(gen.grammar)  # an invalid grammar is refused before the prefill
        t0 = time.perf_counter()
        proposer = self.method.proposer(grammar)
        if self.drafting is not None:
            proposer.use_graphs(self.drafting)
        room = gen.max_new_tokens + 2 * max(proposer.depth_limit, 1) + 2
        row, logits, hidden = self.verifier.add(ids, room)  # [V], [T, D]
        ids = ids.to(logits.device)
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator(device=logits.device).manual_seed(request.sampling.seed)
        history = History.start(ids, logits.shape[-1]) if request.sampling.penalized else None
        scored = scored_logits(logits[None], ids[-1:], self._root(logits.device), request.sampling, history,
                               grammar)  # [1, V]
        root = accept(ids[-1:], scored, self._root(logits.device), request.sampling, generator).bonus
        if history is not None:
            history.emit(root.reshape(1))
        if grammar is not None:
            grammar.consume([int(root)])
        logprobs = None
        if gen.logprobs is not None:
            logprobs = token_logprobs(logits[None], root.reshape(1), gen.logprobs)
        proposer.start(ids)
        proposer.observe(hidden, torch.cat([ids[1:], root.reshape(1)]), None)
        stats = request.stats if request.stats is not None else GenerationStats()
        stats.prompt_tokens, stats.new_tokens = ids.numel(), 1
        stats.prefill_s = time.perf_counter() - t0
        grammar_s = grammar.take_time() if grammar is not None else 0.0
        stats.grammar_s = grammar_s
        eos = self.eos if gen.eos_token_ids is None else {int(e) for e in gen.eos_token_ids}
        seq = _Seq(request, proposer, row, generator, stats, eos, root, history, grammar)
        token = int(root)
        reason = self._finish_reason(seq, [token])
        if reason is None:
            self.seqs.append(seq)
        else:
            self.verifier.release(row)
        return RowOutput(request.id, [token], reason is not None, reason, stats, 0, [0], [Source.PREFILL], logprobs,
                         grammar_s=grammar_s)

    @torch.inference_mode()
    def step(self) -> list[RowOutput]:
        """One verification forward over every active sequence; finished ones leave the batch."""
        if not self.seqs:
            return []
        t0 = time.perf_counter()
        seqs, rows = self.seqs, [s.row for s in self.seqs]
        budget = self.policy.budget(len(seqs)) if self.method.speculative else 1
        # 1. propose: each row's proposer drafts its tree (the root alone near the context end)
        proposals = [s.proposer.propose(s.root, budget)
                     if s.request.speculative and s.row.length + s.proposer.depth_limit + 2 <= self.ctx
                     else None for s in seqs]
        root_only = self._root(seqs[0].root.device)
        tokens = [p.tokens if p is not None else s.root.reshape(1) for s, p in zip(seqs, proposals)]  # [N_b] each
        trees = [p.tree if p is not None else root_only for p in proposals]
        # 2. verify: one forward over every node of every row, each at position length + depth
        logits, hidden = self.verifier.verify(rows, tokens, trees)  # [B, N, V], [B, N, D]
        # 3. accept: the longest path each row's base model agrees with (each node's logits
        # penalized with its own history where the row asks), plus the bonus token
        results = [accept(t, scored_logits(logits[b, : t.numel()], t, tree, s.request.sampling, s.history, s.grammar,
                                           p.masks if p is not None else None),
                          tree, s.request.sampling, s.generator)
                   for b, (s, p, t, tree) in enumerate(zip(seqs, proposals, tokens, trees))]
        # 4. commit: keep each row's accepted path in the cache; the bonus is its next root
        self.verifier.commit(rows, [r.nodes for r in results])
        emitted = [torch.cat([t[r.nodes[1:]], r.bonus.reshape(1)]) for t, r in zip(tokens, results)]  # [A_b] each
        for b, (s, r) in enumerate(zip(seqs, results)):
            s.proposer.observe(hidden[b, r.nodes], emitted[b], r.nodes)
            if s.history is not None:
                s.history.emit(emitted[b])
        # each emitted token's log-probability, from the row its node's logits gave (raw: unpenalized)
        logprobs = [token_logprobs(logits[b, r.nodes], emitted[b], s.request.generation.logprobs)
                    if s.request.generation.logprobs is not None else None
                    for b, (s, r) in enumerate(zip(seqs, results))]
        flat = torch.cat(emitted).tolist()  # one host read: every row's accepted candidates and bonus
        step_s = time.perf_counter() - t0
        if all(s.request.speculative for s in seqs):  # a plain row would skew what the policy measures
            self.policy.observe(len(seqs), budget, len(flat), step_s)

        outputs, keep = [], []
        for s, p, r, e, lp in zip(seqs, proposals, results, emitted, logprobs):
            new, flat = flat[: e.numel()], flat[e.numel():]
            grammar_s = 0.0
            if s.grammar is not None:
                s.grammar.consume(new)
                grammar_s = s.grammar.take_time()
            s.root = r.bonus
            st = s.stats
            st.record(len(new))
            st.nodes += p.tokens.numel() if p is not None else 1
            draft = Source.DRAFT
            if len(new) > 1:  # the accepted path's branch (one host read, only on steps that carried one)
                if p.branches:
                    draft = p.source_of(int(r.nodes[1]))
                st.accepted_by[draft.value] = st.accepted_by.get(draft.value, 0) + len(new) - 1
            if p is not None:  # a proposer's own counts change only on the steps it proposes
                st.counters = s.proposer.counters()
            depths = list(range(1, len(new))) + [0]
            sources = [draft] * (len(new) - 1) + [Source.BONUS]
            new = self._cut(s, new)
            st.new_tokens += len(new)
            st.decode_s += step_s / len(seqs)  # a step's time, shared by its rows
            st.grammar_s += grammar_s
            reason = self._finish_reason(s, new)
            outputs.append(RowOutput(s.request.id, new, reason is not None, reason, st, st.steps,
                                     depths[: len(new)], sources[: len(new)], lp[: len(new)] if lp is not None else None,
                                     p.tokens.numel() - 1 if p is not None else 0, grammar_s))
            if reason is None:
                keep.append(s)
            else:
                self.verifier.release(s.row)
        self.seqs = keep
        return outputs

    @torch.inference_mode()
    def cancel(self, request_id: Hashable) -> bool:
        """Drop a sequence at once (its place is free for the next add); False if it is unknown."""
        for s in self.seqs:
            if s.request.id == request_id:
                self.seqs.remove(s)
                self.verifier.release(s.row)
                return True
        return False

    def close(self) -> None:
        """Drop every sequence."""
        for request_id in self.ids:
            self.cancel(request_id)

    def run(self, requests: Iterable[Request]) -> dict[Hashable, list[int]]:
        """Decode all `requests` to the end (joining as places free up): id -> new tokens."""
        pending, tokens = list(requests), {}
        while pending or self.seqs:
            while pending and self.has_room:
                out = self.add(pending.pop(0))
                tokens[out.id] = list(out.tokens)
            for out in self.step():
                tokens[out.id] += out.tokens
        return tokens

    def _root(self, device) -> TreeBuffers:
        if self._root_only is None:
            self._root_only = ROOT_ONLY.to(device)
        return self._root_only

    def _cut(self, seq: _Seq, new: list[int]) -> list[int]:
        """Cut a step's tokens at max_new_tokens and after the first EOS."""
        gen = seq.request.generation
        new = new[: gen.max_new_tokens - seq.stats.new_tokens]
        if not gen.ignore_eos:
            for i, t in enumerate(new):
                if t in seq.eos:
                    return new[: i + 1]
        return new

    def _finish_reason(self, seq: _Seq, new: list[int]) -> str | None:
        """After `new` was emitted (and counted): "stop" on EOS, "length" at max_new_tokens or the
        context end, None while the sequence goes on."""
        gen = seq.request.generation
        if not gen.ignore_eos and new and new[-1] in seq.eos:
            return "stop"
        if seq.stats.new_tokens >= gen.max_new_tokens or seq.row.length + 1 >= self.ctx:
            return "length"
        return None
