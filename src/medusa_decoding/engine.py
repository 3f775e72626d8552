"""The decode loop and `MedusaModel`, the Python API in the style of transformers.

    model = MedusaModel.from_pretrained("smollm2-135m-instruct")  # what `medusa generate` runs
    out = model.generate("Write a haiku about the sea.", max_new_tokens=64)
    print(out.text, out.stats.mean_accepted_length)
    for delta in model.stream("Tell me a joke."):
        print(delta, end="", flush=True)

Glossary: B active rows (sequences), T prompt length, N tree nodes of a row's step (root first),
A accepted nodes (root included), D hidden size, V vocabulary.

One loop for B >= 1 rows (`Decoder.step`): 1 propose (each row's proposer), 2 verify (one
forward over every row's tree), 3 accept (each row's rule and generator), 4 commit (keep each
row's accepted path). `generate` and `stream` are its one-row case; continuous batching (the
server) is `add` and `cancel` between steps. Greedy output of every row is token-identical to
plain decoding of that row alone, whatever the drafts.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from . import proposers
from .acceptance import accept
from .config import DEFAULT_MODEL, CalibrationMode, CompileMode, GenerationConfig, MedusaError, NgramConfig, SamplingConfig
from .datastore import Datastore
from .models import load_base
from .proposers import Drafter, Proposer
from .proposers.ngram import NgramBranch
from .spec import DecodeSpec
from .text import TextDecoder
from .tree import TreeBuffers, build_tree
from .verifiers import Verifier
from .verifiers.compiled import CompiledBackend, compiles_by_default
from .verifiers.transformers import EagerBackend, TransformersVerifier

log = logging.getLogger(__name__)

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
    ngram_steps: int = 0  # steps whose tree carried an n-gram branch
    ngram_accepted: int = 0  # candidates accepted on the n-gram branch
    copy_steps: int = 0  # steps that verified the n-gram chain alone (NgramConfig.copy_run)
    nodes: int = 0  # tree nodes verified, summed over steps

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
        )

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "steps": self.steps,
            "mean_accepted_length": self.mean_accepted_length, "acceptance_per_depth": self.acceptance_per_depth,
            "accepted_lengths": self.accepted_lengths, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
            "tokens_per_s": self.tokens_per_s, "ngram_steps": self.ngram_steps,
            "ngram_accepted": self.ngram_accepted, "copy_steps": self.copy_steps,
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


class Source(str, enum.Enum):
    """Where an emitted token came from (its provenance)."""

    PREFILL = "prefill"  # the first token, from the prompt's forward
    BONUS = "bonus"  # the base model's own token that ends a step
    DRAFT = "draft"  # a drafter's candidate that the base model accepted
    NGRAM = "ngram"  # an n-gram candidate (copied from the context) that the base model accepted


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


@dataclass
class Method:
    """How rows propose: a drafter (None: plain decoding) and an n-gram branch (None: none)."""

    drafter: Drafter | None = None
    ngram: NgramConfig | None = None
    store: Datastore | None = None  # where the n-gram branch looks when the context has no match

    def proposer(self) -> Proposer:
        inner = self.drafter.proposer() if self.drafter is not None else None
        if self.ngram is not None:
            return NgramBranch(inner, self.ngram, self.store)
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


class FixedSpeculation:
    """Every step at the method's own budget (one sequence, or a batch sized by hand)."""

    def budget(self, rows: int) -> int | None:
        return None

    def observe(self, rows: int, budget: int | None, tokens: int, seconds: float) -> None:
        pass


class AdaptiveSpeculation:
    """The budget of each step chosen from measured throughput at the current number of rows.

    A level (a budget of `levels`; 1 is plain decoding) is worth its rows' accepted tokens per
    second. The two factors are measured apart, because they vary apart:
    - tokens per row and step belong to the drafter and the prompts, not to the batch: one
      running mean per level, fed by every row of every step at that level, whatever the batch
      size (a speculative step emits 1-10 tokens a row: a few steps of one batch size alone are
      luck, e.g. one copy step);
    - a step's seconds (drafting, verification, acceptance) and rows belong to the batch: running
      means per bucket of row counts (1, 2, 3-4, 5-8, ...) and level. Its tokens/s is then
      tau(level) x rows / seconds (a ratio of means: a mean of per-step ratios would favour the
      lucky steps).
    Each running mean is a plain average over its first 1/alpha samples, then exponential.
    The levels are warmed up at a bucket upwards while each beats those below it, and only
    where the largest smaller bucket that measured the level did not find it slower than plain
    decoding (a bigger batch makes a tree relatively dearer). Then the fastest is used (the
    smallest level within `margin` of the fastest: a tree that wins by less is not worth its
    variance; at one row, `prefer` where it is within `margin`: the budget calibrated for one
    row, so a lone request decodes as `generate` does), and a neighbour of it is measured again now and then: a re-measurement that leaves the fastest in front doubles the
    wait before the next one, and the wait is at least what keeps re-measuring within
    `probe_share` of the time (a 20-node step at 16 rows costs several plain ones); one that
    changes the order starts it again at `explore`. So at every batch size speculation runs only
    where, measured on this machine, it emits more tokens per second than plain batched
    decoding, and a settled choice costs ever fewer steps at slower levels. One policy lives as
    long as its server (or bench): what it measured carries over.
    """

    def __init__(self, levels: Iterable[int], warm: int = 2, explore: int = 16, alpha: float = 0.25,
                 max_explore: int = 256, warm_rows: int = 8, tau_alpha: float = 0.02, probe_share: float = 0.02,
                 margin: float = 0.05, prefer: int | None = None):
        self.levels = sorted(set(levels) | {1})
        self.prefer = prefer  # the level one row keeps while it is within `margin` of the fastest
        self.warm, self.explore, self.alpha, self.max_explore = warm, explore, alpha, max_explore
        self.warm_rows, self.tau_alpha, self.probe_share, self.margin = warm_rows, tau_alpha, probe_share, margin
        self.tau: dict[int, float] = {1: 1.0}  # budget -> running mean of a row's tokens in a step, every batch size
        self.tau_rows: dict[int, float] = {1: math.inf}  # budget -> row-steps measured (plain: 1 token a row, always)
        self.seconds: dict[tuple[int, int], float] = {}  # (bucket, budget) -> running mean of a step's seconds
        self.rows: dict[tuple[int, int], float] = {}  # (bucket, budget) -> running mean of a step's rows
        self.count: dict[tuple[int, int], int] = {}
        self.wait: dict[int, int] = {}  # bucket -> steps from one re-measurement to the next
        self.due: dict[int, int] = {}  # bucket -> steps left before the next re-measurement
        self.probes: dict[int, int] = {}  # bucket -> re-measurements so far (which level is next)
        self.probing: dict[int, tuple[int, int]] = {}  # bucket -> (level re-measured now, the fastest before it)

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << (rows - 1).bit_length()  # 1, 2, 4, 8, ...: the largest row count of the bucket

    def measured(self, bucket: int, level: int) -> bool:
        return (bucket, level) in self.seconds and level in self.tau

    def rate(self, bucket: int, level: int) -> float:
        """Tokens per second at `level` in `bucket` (measured)."""
        return self.tau[level] * self.rows[(bucket, level)] / max(self.seconds[(bucket, level)], 1e-9)

    def best(self, bucket: int, among: Sequence[int] | None = None) -> int:
        """The smallest measured level within `margin` of the fastest: where a bigger tree wins by
        less, the smaller one's steps are cheaper, steadier and need no re-measuring to stay ahead.
        At one row `prefer` comes first: a calibration chose it there from longer measurements."""
        levels = [lv for lv in among or self.levels if self.measured(bucket, lv)]
        fastest = max(self.rate(bucket, lv) for lv in levels)
        if bucket == 1 and self.prefer in levels:
            levels.insert(0, self.prefer)
        return next(lv for lv in levels if self.rate(bucket, lv) * (1 + self.margin) >= fastest)

    def _warmed(self, bucket: int, level: int) -> bool:
        return self.count.get((bucket, level), 0) >= self.warm and self.tau_rows.get(level, 0) >= self.warm_rows

    def _measured_at(self, bucket: int, level: int, other: int) -> int | None:
        """The largest bucket up to `bucket` where `level` and `other` were both measured."""
        return next((1 << b for b in range(bucket.bit_length() - 1, -1, -1)
                     if self.measured(1 << b, level) and self.measured(1 << b, other)), None)

    def _loses_below(self, bucket: int, level: int) -> bool:
        """A smaller bucket (the largest measured) found this level slower than plain decoding."""
        below = self._measured_at(bucket // 2, level, 1) if bucket > 1 else None
        return below is not None and self.rate(below, level) < self.rate(below, 1)

    def _spacing(self, bucket: int, level: int, best: int) -> int:
        """Steps between re-measurements of `level` that keep them within probe_share of the time:
        a probe's time beyond what `best` needs for its tokens, in steps of `best`, over the share.
        Measured at this bucket, else at the largest smaller one (a lower bound: more rows make a
        tree dearer); `explore` when neither measured it."""
        at = self._measured_at(bucket, level, best)
        if at is None:
            return self.explore
        key = (at, level)
        extra = (self.seconds[key] - self.tau[level] * self.rows[key] / self.rate(at, best)) \
            / max(self.seconds[(at, best)], 1e-9)
        return min(max(self.explore, math.ceil(extra / self.probe_share)), self.max_explore)

    def _neighbours(self, best: int) -> list[int]:
        i = self.levels.index(best)
        return [self.levels[j] for j in (i - 1, i + 1) if 0 <= j < len(self.levels)]

    def budget(self, rows: int) -> int:
        bucket = self.bucket(rows)
        # warm up along the levels, upwards, while each beats every one below it: a bigger tree
        # costs more, so above a level that loses the next one is not worth its steps (at 8 rows
        # on the EPYC a 20-node step takes 4x a plain one)
        for i, level in enumerate(self.levels):
            if not self._warmed(bucket, level):
                # (a level in its warm-up may lead already)
                if i == 0 or (self.best(bucket, self.levels[: i + 1]) in (self.levels[i - 1], level)
                              and not self._loses_below(bucket, level)):
                    return level
                break
        if bucket == 1 and self.prefer in self.levels and not self._warmed(1, self.prefer):
            return self.prefer  # one row measures its calibrated level whatever the levels below did
        best = self.best(bucket)
        if len(self.levels) == 1:
            return best
        others = self._neighbours(best)  # re-measured now and then, in turn
        if bucket not in self.wait:  # the first wait: what the warm-up (or fewer rows) measured them at
            self.wait[bucket] = max(self._spacing(bucket, lv, best) for lv in others)
        self.due[bucket] = self.due.get(bucket, self.wait[bucket]) - 1
        if self.due[bucket] > 0:
            return best
        probe = self.probes[bucket] = self.probes.get(bucket, -1) + 1
        self.probing[bucket] = (others[probe % len(others)], best)
        return self.probing[bucket][0]

    def observe(self, rows: int, budget: int | None, tokens: int, seconds: float) -> None:
        bucket = self.bucket(rows)
        key = (bucket, budget)
        n = self.count[key] = self.count.get(key, 0) + 1
        weight = max(self.alpha, 1 / n)
        for mean, value in ((self.seconds, seconds), (self.rows, rows)):
            mean[key] = value if n == 1 else (1 - weight) * mean[key] + weight * value
        if budget != 1:
            seen = self.tau_rows[budget] = self.tau_rows.get(budget, 0) + rows
            weight = min(1.0, rows * max(self.tau_alpha, 1 / seen))
            self.tau[budget] = (1 - weight) * self.tau.get(budget, 0.0) + weight * tokens / rows
        probe = self.probing.get(bucket)
        if probe is not None and probe[0] == budget:
            del self.probing[bucket]
            level, best = probe
            alone = self.tau[level] * rows / max(seconds, 1e-9)  # this probe's own rate (its time; tau pooled)
            if self.best(bucket) == best and alone < self.rate(bucket, best) * (1 + self.margin):
                # settled: wait twice as long, and long enough that probes stay cheap
                self.wait[bucket] = min(max(2 * self.wait[bucket], self._spacing(bucket, level, best)), self.max_explore)
            else:
                self.wait[bucket] = self.explore
            self.due[bucket] = self.wait[bucket]

    def table(self) -> dict:
        """{row bucket: {budget: tokens/s}} measured so far."""
        out: dict[int, dict[int, float]] = {}
        for bucket, level in sorted(self.seconds):
            if self.measured(bucket, level):
                out.setdefault(bucket, {})[level] = round(self.rate(bucket, level), 1)
        return out


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


class Decoder:
    """Decode up to `max_batch_size` sequences together, one verification forward per step.
    Not thread-safe: one owner calls add / step / cancel."""

    def __init__(self, verifier: Verifier, method: Method, eos_token_ids: Iterable[int], max_batch_size: int = 1,
                 policy: FixedSpeculation | AdaptiveSpeculation | None = None):
        if max_batch_size < 1:
            raise MedusaError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.verifier, self.method = verifier, method
        if getattr(verifier, "feature_layers", None) != method.feature_layers:
            raise MedusaError(f"the verifier returns the hidden states of layers {getattr(verifier, 'feature_layers', None)}, "
                              f"the drafter reads {method.feature_layers}")
        self.eos = {int(e) for e in eos_token_ids}
        self.max_batch_size = min(max_batch_size, verifier.max_rows or max_batch_size)
        self.policy = policy or FixedSpeculation()
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
        t0 = time.perf_counter()
        proposer = self.method.proposer()
        if self.drafting is not None:
            proposer.use_graphs(self.drafting)
        room = gen.max_new_tokens + 2 * max(proposer.depth_limit, 1) + 2
        row, logits, hidden = self.verifier.add(ids, room)  # [V], [T, D]
        ids = ids.to(logits.device)
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator(device=logits.device).manual_seed(request.sampling.seed)
        root = accept(ids[-1:], logits[None], self._root(logits.device), request.sampling, generator).bonus
        proposer.start(ids)
        proposer.observe(hidden, torch.cat([ids[1:], root.reshape(1)]), None)
        stats = request.stats if request.stats is not None else GenerationStats()
        stats.prompt_tokens, stats.new_tokens = ids.numel(), 1
        stats.prefill_s = time.perf_counter() - t0
        eos = self.eos if gen.eos_token_ids is None else {int(e) for e in gen.eos_token_ids}
        seq = _Seq(request, proposer, row, generator, stats, eos, root)
        token = int(root)
        reason = self._finish_reason(seq, [token])
        if reason is None:
            self.seqs.append(seq)
        else:
            self.verifier.release(row)
        return RowOutput(request.id, [token], reason is not None, reason, stats, 0, [0], [Source.PREFILL])

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
        # 3. accept: the longest path each row's base model agrees with, plus the bonus token
        results = [accept(t, logits[b, : t.numel()], tree, s.request.sampling, s.generator)
                   for b, (s, t, tree) in enumerate(zip(seqs, tokens, trees))]
        # 4. commit: keep each row's accepted path in the cache; the bonus is its next root
        self.verifier.commit(rows, [r.nodes for r in results])
        emitted = [torch.cat([t[r.nodes[1:]], r.bonus.reshape(1)]) for t, r in zip(tokens, results)]  # [A_b] each
        for b, (s, r) in enumerate(zip(seqs, results)):
            s.proposer.observe(hidden[b, r.nodes], emitted[b], r.nodes)
        flat = torch.cat(emitted).tolist()  # one host read: every row's accepted candidates and bonus
        step_s = time.perf_counter() - t0
        if all(s.request.speculative for s in seqs):  # a plain row would skew what the policy measures
            self.policy.observe(len(seqs), budget, len(flat), step_s)

        outputs, keep = [], []
        for s, p, r, e in zip(seqs, proposals, results, emitted):
            new, flat = flat[: e.numel()], flat[e.numel():]
            s.root = r.bonus
            st = s.stats
            st.record(len(new))
            st.nodes += p.tokens.numel() if p is not None else 1
            # the accepted path is on the n-gram branch (one host read, only on steps that carried one)
            ngram = p is not None and p.chain > 0 and len(new) > 1 and int(r.nodes[1]) >= p.tree.num_nodes - p.chain
            if p is not None and p.chain:
                st.ngram_steps += 1
                st.copy_steps += p.copy_step
                st.ngram_accepted += (len(new) - 1) * ngram
            draft = Source.NGRAM if ngram else Source.DRAFT
            depths = list(range(1, len(new))) + [0]
            sources = [draft] * (len(new) - 1) + [Source.BONUS]
            new = self._cut(s, new)
            st.new_tokens += len(new)
            st.decode_s += step_s / len(seqs)  # a step's time, shared by its rows
            reason = self._finish_reason(s, new)
            outputs.append(RowOutput(s.request.id, new, reason is not None, reason, st, st.steps,
                                     depths[: len(new)], sources[: len(new)]))
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


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]  # the new tokens, EOS included when generation ended on it
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or stop string) or "length" (max_new_tokens or context)


class TextStream:
    """An iterator of text deltas; once exhausted, `.text`, `.token_ids`, `.stats` and
    `.finish_reason` describe the whole generation (text.TextDecoder's rules)."""

    def __init__(self, tokenizer, tokens: Iterator[RowOutput], stats: GenerationStats, stop: Sequence[str]):
        self._tokens = tokens
        self._text = TextDecoder(tokenizer, stop)
        self.stats = stats
        self.finish_reason = "length"  # "stop" when an EOS token or a stop string ended it

    @property
    def text(self) -> str:
        return self._text.text

    @property
    def token_ids(self) -> list[int]:
        return self._text.token_ids

    def __iter__(self) -> Iterator[str]:
        text = self._text
        for out in self._tokens:
            delta = text.push(out.tokens)
            if text.stopped or out.finish_reason == "stop":
                self.finish_reason = "stop"
            if out.finished or text.stopped:
                delta += text.flush()
            if delta:
                yield delta
            if text.stopped:
                self._tokens.close()
                break


def make_backend(base, compile: bool | CompileMode | str = False) -> EagerBackend:
    """How the base runs: eager, or compiled (mode on; mode auto where compiles_by_default)."""
    mode = CompileMode.parse(compile)
    if mode is CompileMode.AUTO and not compiles_by_default(base):
        mode = CompileMode.OFF
    return EagerBackend(base) if mode is CompileMode.OFF else CompiledBackend(base, mode=mode)


class MedusaModel:
    """A base causal LM, a method (a drafter and an n-gram branch), and a backend (eager or
    compiled) shared by every generation."""

    def __init__(self, base, tokenizer, heads=None, tree=None, name: str = "", ngram: NgramConfig | bool | None = None,
                 tree_budget: int | None = None, backend: EagerBackend | None = None,
                 compile: bool | CompileMode | str = False, datastore: Datastore | None = None):
        """heads: drafter weights (MedusaHeads, HydraHeads, EagleDrafter, any registered kind), a
        Drafter, or None (plain decoding). tree: for Medusa heads (file, paths, "dynamic").
        compile: a CompileMode (True: on, False: off). datastore: where the n-gram branch looks when
        the context has no match (None: the context only)."""
        self.base, self.tokenizer = base, tokenizer
        self.name = name or base.config.name_or_path
        # how the base runs; share one backend between models on the same base
        self.backend = backend or make_backend(base, compile)
        if heads is None or isinstance(heads, Drafter):
            self.drafter = heads
        else:
            self.drafter = proposers.wrap(heads, base, tree, tree_budget)
        self.ngram = NgramConfig() if ngram is True else (ngram or None)
        self.ngram_asked = self.ngram  # the chain asked for; a fit to the machine may run without it (costs.py)
        self.datastore = datastore
        self.spec: DecodeSpec | None = None  # the spec from_spec assembled it from (None: built by hand)
        gen = getattr(base, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = eos if eos is not None else base.config.get_text_config().eos_token_id
        eos = eos if isinstance(eos, (list, tuple)) else [eos]
        self.eos_token_ids = {int(e) for e in eos if e is not None}
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))

    @property
    def heads(self):
        """The drafter's weights (None for plain decoding)."""
        return None if self.drafter is None else self.drafter.weights

    @property
    def tree(self):
        """Medusa heads' tree (static TreeBuffers or DynamicTree); the one-node tree otherwise."""
        return getattr(self.drafter, "tree", ROOT_ONLY)

    def method(self, use_medusa: bool = True) -> Method:
        if not use_medusa:
            return Method()
        resting = self.drafter is not None and self.drafter.default_budget < 2  # a fit found no tree worth it
        return Method(None if resting else self.drafter, self.ngram, self.datastore)

    def verifier(self, rows: int = 1, use_medusa: bool = True) -> TransformersVerifier:
        """A verifier of its own for one decoder (the backend's compiled graphs are shared)."""
        return TransformersVerifier(self.backend, rows_hint=rows, feature_layers=self.method(use_medusa).feature_layers)

    def decoder(self, max_batch_size: int = 1, use_medusa: bool = True, policy=None) -> Decoder:
        """A decoder for up to max_batch_size sequences at once (the server's and the batch bench's)."""
        return Decoder(self.verifier(max_batch_size, use_medusa), self.method(use_medusa), self.eos_token_ids, max_batch_size,
                       policy)

    def tree_sizes(self, use_medusa: bool = True) -> list[int]:
        """Node counts of the verification steps this model takes: the shapes a compiled backend needs."""
        return self.method(use_medusa).tree_sizes()

    def fit_to_machine(self, refresh: bool = False, progress: bool = True, compiled=None):
        """Choose the drafter's budget (and whether the n-gram chain runs) for this machine from its
        shipped acceptance statistics and this machine's verify and drafting costs (measured once,
        ~10-30 s, then cached under $MEDUSA_CACHE/calibration) -> a costs.Fit whose `line` says which
        calibration is in use. compiled: the compiled backend that will run it (compile mode auto)."""
        from .costs import fit_to_machine

        return fit_to_machine(self, refresh=refresh, progress=progress, compiled=compiled)

    def fit_exactness(self, fit_budget: bool = True, refresh: bool = False, progress: bool = True,
                      use_medusa: bool = True, compiled=None):
        """Turn exact mode on where this machine's calibration measures it costs at most
        costs.EXACT_MAX_COST of the expected tokens/s (bf16, fp16; float32 is left as it is), fitting
        the drafter's budget in each mode when fit_budget -> a costs.ExactFit whose `lines` say what
        was chosen. compiled: as fit_to_machine's."""
        from .costs import fit_exactness

        return fit_exactness(self, fit_budget, refresh=refresh, progress=progress, use_medusa=use_medusa,
                             compiled=compiled)

    def warmup(self, max_slots: int, use_medusa: bool = True) -> float:
        """Compile every verification shape for sequences up to max_slots tokens (prompt and answer)
        -> seconds; nothing to do for an eager backend."""
        return self.backend.warmup(self.tree_sizes(use_medusa), max_slots)

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    @classmethod
    def from_pretrained(cls, model: str = DEFAULT_MODEL, spec: DecodeSpec | None = None, *, dtype: str = "auto",
                        device: str = "auto", attn_implementation: str = "auto", progress: bool = True,
                        report: Callable[[str], None] | None = None, **options) -> MedusaModel:
        """Load a base model (built-in alias, HF folder or .gguf) and decode as `spec` says.

        With no spec and no options this is what `medusa generate` runs: the drafter shipped for a
        built-in model with the n-gram branch, its budget fitted to this machine, compile mode auto.
        options: DecodeSpec fields that change the spec (drafter, tree, tree_budget, ngram,
        datastore, compile, exact, calibration); `heads` is another name for `drafter` (None: no
        drafter). attn_implementation: a transformers name, "auto" (the short-query kernel where the
        model fits it) or "exact" (exact mode). progress: bars on stderr while this machine is measured;
        report: where the lines saying what the fits chose go (default: this module's logger)."""
        if "heads" in options:
            options["drafter"] = options.pop("heads")
        spec = (spec or DecodeSpec()).with_options(**options)
        if attn_implementation == "exact":
            spec = spec.with_options(exact=True)
        if spec.exact and spec.compile is CompileMode.AUTO:
            spec = spec.with_options(compile=CompileMode.OFF)  # exact mode's kernels are eager ones
        base, tokenizer, _ = load_base(model, dtype=dtype, device=device,
                                       attn_implementation="exact" if spec.exact else attn_implementation)
        return cls.from_spec(base, tokenizer, spec, name=model, progress=progress, report=report)

    @classmethod
    def from_spec(cls, base, tokenizer, spec: DecodeSpec, name: str = "", backend: EagerBackend | None = None,
                  compiled: EagerBackend | None = None, progress: bool = True,
                  report: Callable[[str], None] | None = None) -> MedusaModel:
        """Assemble `spec` on a loaded base: the one place a method is put together. Its drafter, tree,
        n-gram branch and datastore; its budget fitted to this machine where the spec asks (and exact
        mode chosen where `spec.exact` is None; the lines saying what was chosen are logged); then the
        backend it runs on. backend: share one (a bench's methods share the base's); compiled: the
        compiled backend whose costs a shared eager backend's budget is fitted to (a bench's @compiled)."""
        report = report or (lambda line: log.info("%s", line))
        folder = spec.drafter_folder(name)
        if spec.drafter is not None and folder is None and name == DEFAULT_MODEL:
            report(f"note: no drafter is shipped for {name}: " + ("the n-gram branch alone" if spec.ngram else "plain decoding"))
        heads = proposers.load(folder, base) if folder is not None else None
        store = Datastore.load(spec.datastore) if spec.datastore is not None else None
        auto = None  # compile mode auto: its saved graphs are loaded once the fits have chosen exact mode
        if backend is None:
            backend = make_backend(base, CompileMode.OFF if spec.compile is CompileMode.AUTO else spec.compile)
            if spec.compile is CompileMode.AUTO and not spec.exact and compiles_by_default(base):
                compiled = auto = make_backend(base, CompileMode.AUTO)
        model = cls(base, tokenizer, heads=heads, tree=spec.tree, name=name, ngram=spec.ngram,
                    tree_budget=spec.tree_budget, backend=backend, datastore=store)
        model.spec = spec
        fit = model.drafter is not None and spec.fits_budget
        refresh = spec.calibration is CalibrationMode.REFRESH
        lines: list[str] = []
        if spec.exact is None and spec.calibration is not CalibrationMode.SHIPPED:  # exact where (nearly) free here
            lines = model.fit_exactness(fit, refresh=refresh, progress=progress, use_medusa=spec.speculative,
                                        compiled=compiled).lines
        elif fit:
            lines = [model.fit_to_machine(refresh=refresh, progress=progress, compiled=compiled).line]
        for line in lines:
            report(line)
        if auto is not None and compiles_by_default(base):
            model.backend = auto  # exact mode, once chosen, stays eager
        return model

    def encode(self, prompt: str | list[dict], chat: bool | None = None) -> torch.Tensor:
        """A prompt (text, or chat messages) -> input_ids [1, T] on the model's device."""
        if isinstance(prompt, str) and not prompt.strip():
            raise MedusaError("the prompt is empty")
        if chat is None:
            chat = self.tokenizer.chat_template is not None
        if chat or isinstance(prompt, list):
            if self.tokenizer.chat_template is None:
                raise MedusaError(f"{self.name} has no chat template; use a plain prompt (--no-chat)")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    def stream(
        self,
        prompt: str | list[dict] | torch.Tensor,
        max_new_tokens: int = GenerationConfig.max_new_tokens,
        chat: bool | None = None,
        stop: Sequence[str] = (),
        use_medusa: bool = True,
        ignore_eos: bool = False,
        **sampling,
    ) -> TextStream:
        """Generate and stream text deltas. `sampling`: SamplingConfig fields (temperature, top_p,
        top_k, seed, acceptance, ...). A tensor prompt is taken as input_ids [1, T].
        use_medusa=False: plain decoding (no drafter, no n-gram branch), the baseline."""
        generation = GenerationConfig(max_new_tokens=max_new_tokens, stop=list(stop), ignore_eos=ignore_eos)
        request = Request(prompt if isinstance(prompt, torch.Tensor) else self.encode(prompt, chat), generation,
                          SamplingConfig(**sampling), stats=GenerationStats())
        return TextStream(self.tokenizer, self._outputs(request, use_medusa), request.stats, generation.stop)

    def _outputs(self, request: Request, use_medusa: bool) -> Iterator[RowOutput]:
        """The one-row case of the decode loop."""
        decoder = self.decoder(1, use_medusa)
        try:
            out = decoder.add(request)
            yield out
            while not out.finished:
                (out,) = decoder.step()
                yield out
        finally:  # also when the consumer stops early (a stop string): the row is released
            decoder.close()

    def generate(self, prompt, max_new_tokens: int = GenerationConfig.max_new_tokens, **kwargs) -> GenerationOutput:
        """Generate to the end and return the text, the new token ids and the stats."""
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, **kwargs)
        for _ in stream:
            pass
        return GenerationOutput(stream.text, stream.token_ids, stream.stats, stream.finish_reason)
