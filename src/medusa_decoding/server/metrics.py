"""Prometheus metrics of the server (`GET /metrics`, prometheus-client's text format).

Names follow vLLM's (`vllm:spec_decode_*`, `vllm:prompt_tokens_total`, ...) under the prefix
`medusa:` where the meaning is the same; docs/SERVING.md lists them. A *draft* is one row's tree
in one step (vLLM: one request's proposal), its *draft tokens* the tree's candidates (root
excluded), and *accepted tokens* the candidates emitted (the bonus token is not counted), so
mean accepted length = 1 + accepted / drafts, as vLLM computes it from its counters.
Every metric lives in this server's own registry: two apps in one process do not share counts.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import RowOutput

STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
GRAMMAR_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
MAX_POSITION = 16  # accepted tokens are counted per tree depth up to this one (deeper: in the last)


class Metrics:
    """Counters the scheduler feeds (`prefilled`, `stepped`) and the app's middleware (`answered`)."""

    def __init__(self, queued, active):
        """queued, active: callables giving the queue length and the rows decoding now."""
        self._drafts = self._accepted = 0  # the two counters' values, for the mean
        self.registry = r = CollectorRegistry()
        self.requests = Counter("medusa:requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("medusa:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("medusa:generation_tokens", "Tokens generated (sent to clients)", registry=r)
        self.drafts = Counter("medusa:spec_decode_num_drafts", "Row steps that verified at least one candidate",
                              registry=r)
        self.draft_tokens = Counter("medusa:spec_decode_num_draft_tokens", "Candidates verified (tree nodes "
                                    "below the root)", registry=r)
        self.accepted_tokens = Counter("medusa:spec_decode_num_accepted_tokens", "Candidates accepted and emitted",
                                       registry=r)
        self.accepted_per_pos = Counter("medusa:spec_decode_num_accepted_tokens_per_pos", "Candidates accepted at "
                                        "each tree depth (position 0: depth 1)", ["position"], registry=r)
        self.row_steps = Counter("medusa:row_steps", "Verification steps summed over rows (the answers' "
                                 "medusa.steps)", registry=r)
        self.steps = Counter("medusa:steps", "Batched verification forwards", registry=r)
        self.step_seconds = Histogram("medusa:step_seconds", "Time of one batched verification step",
                                      buckets=STEP_BUCKETS, registry=r)
        self.grammar_seconds = Histogram("medusa:grammar_seconds", "Time one row's step spent in its grammar "
                                         "(matcher, masks, filtering its tree): rows with structured outputs",
                                         buckets=GRAMMAR_BUCKETS, registry=r)
        self.rows = Histogram("medusa:step_rows", "Rows in a batched step", buckets=(1, 2, 4, 8, 16, 32, 64),
                              registry=r)
        Gauge("medusa:num_requests_waiting", "Requests queued", registry=r).set_function(queued)
        Gauge("medusa:num_requests_running", "Rows decoding now", registry=r).set_function(active)
        Gauge("medusa:mean_accepted_length", "Tokens per row step, bonus included (1 + accepted / drafts "
              "over the steps that drafted)", registry=r).set_function(self.mean_accepted_length)

    def mean_accepted_length(self) -> float:
        return 1 + self._accepted / self._drafts if self._drafts else 0.0

    def prefilled(self, output: RowOutput) -> None:
        self.prompt_tokens.inc(output.stats.prompt_tokens)
        self.generation_tokens.inc(len(output.tokens))

    def stepped(self, outputs: list[RowOutput], step_s: float) -> None:
        self.steps.inc()
        self.step_seconds.observe(step_s)
        self.rows.observe(len(outputs))
        for out in outputs:
            self.row_steps.inc()
            if out.grammar_s:
                self.grammar_seconds.observe(out.grammar_s)
            self.generation_tokens.inc(len(out.tokens))
            if out.drafted:
                self.drafts.inc()
                self.draft_tokens.inc(out.drafted)
                self._drafts += 1
            for depth in out.depths:
                if depth:
                    self.accepted_tokens.inc()
                    self.accepted_per_pos.labels(str(min(depth, MAX_POSITION) - 1)).inc()
                    self._accepted += 1

    def answered(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
