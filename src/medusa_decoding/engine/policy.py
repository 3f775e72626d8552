"""How much to speculate: every step at the method's own budget, or a budget chosen from the
throughput measured at the current number of rows (the server's default)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


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
        # costs more, so above a level that loses the next one is not worth its steps (at 8 rows a
        # 20-node step can cost several plain ones)
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
