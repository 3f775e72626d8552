"""The decode loop over several rows: every sequence of a batch gets exactly what it gets decoded
alone (fp32), whatever joins or leaves between steps."""

import pytest
import torch
from torch import nn

from medusa_decoding import proposers
from medusa_decoding.engine import Decoder, Method, Request
from medusa_decoding.verifiers.transformers import EagerBackend, TransformersVerifier
from medusa_decoding.config import DEFAULT_TREE, GenerationConfig, MedusaError, SamplingConfig
from medusa_decoding.engine import GenerationStats
from medusa_decoding.tree import build_tree

from conftest import EOS, decode, random_heads, tiny_llama

TREE = build_tree(DEFAULT_TREE)


def prompts(n, seed=0, lo=1, hi=30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def alone(model, prompt, max_new_tokens, heads=None, eos=(EOS,), sampling=None, ignore_eos=False):
    """Reference: decode.decode on one prompt."""
    out = []
    for chunk in decode(model, torch.tensor([prompt]), heads, TREE,
                        GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos),
                        sampling or SamplingConfig(), set(eos), GenerationStats()):
        out += chunk
    return out


def BatchDecoder(model, heads, tree, eos, max_batch_size=8, policy=None, ngram=None):
    """A decoder of the engine for up to max_batch_size rows (heads None: plain decoding)."""
    drafter = proposers.wrap(heads, model, tree) if heads is not None else None
    return Decoder(TransformersVerifier(EagerBackend(model), max_batch_size), Method(drafter, ngram), eos,
                   max_batch_size, policy)


def request(prompt, max_new_tokens, eos=None, ignore_eos=False, **sampling):
    return Request(torch.tensor(prompt), GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos,
                                                               ignore_eos=ignore_eos), SamplingConfig(**sampling))


class OracleHeads(nn.Module):
    """Heads that are often right, for many sequences at once: each hidden state is matched to
    the nearest position of known plain-greedy runs, and the true future token is put first
    with probability `hit`. hidden [D] or [B, D] -> logits [K, V] or [K, B, V]."""

    def __init__(self, model, runs, num_heads=4, hit=0.7, seed=0):
        super().__init__()
        hidden, future = [], []
        for prompt, continuation in runs:
            seq = torch.tensor(prompt + continuation)
            with torch.no_grad():
                hidden.append(model.get_decoder()(input_ids=seq[None]).last_hidden_state[0])  # [T, D]
            # future[t, k]: the token k + 2 steps after position t (-1 past the end)
            fut = torch.full((len(seq), num_heads), -1, dtype=torch.long)
            for t in range(len(seq)):
                for k in range(num_heads):
                    if t + k + 2 < len(seq):
                        fut[t, k] = seq[t + k + 2]
            future.append(fut)
        self.hidden, self.future = torch.cat(hidden), torch.cat(future)
        self.num_heads, self.hit, self.vocab = num_heads, hit, model.config.vocab_size
        self.g = torch.Generator().manual_seed(seed)

    kind = "medusa"

    def check_fits(self, base_model):
        pass

    def forward(self, hidden, lm_head=None, num_heads=None):
        rows = hidden.reshape(-1, hidden.shape[-1])  # [B, D]
        logits = torch.randn(self.num_heads, len(rows), self.vocab, generator=self.g)  # [K, B, V]
        for b, h in enumerate(rows):
            t = int((self.hidden - h).norm(dim=-1).argmin())
            for k in range(self.num_heads):
                if self.future[t, k] >= 0 and torch.rand(1, generator=self.g) < self.hit:
                    logits[k, b, self.future[t, k]] = 100.0
        return logits if hidden.dim() > 1 else logits[:, 0]


def make_heads(kind, model, runs):
    if kind == "none":
        return None
    return random_heads(model) if kind == "random" else OracleHeads(model, runs)


@pytest.mark.parametrize("kind", ["none", "random", "oracle"])
def test_batch_equals_alone_mixed_lengths_and_ends(model, kind):
    ps = prompts(6, seed=1)
    lengths = [40, 7, 25, 1, 33, 12]  # sequences finish at different steps
    want = [alone(model, p, n) for p, n in zip(ps, lengths)]
    heads = make_heads(kind, model, [(p, alone(model, p, 40, ignore_eos=True)) for p in ps])
    dec = BatchDecoder(model, heads, TREE, {EOS}, max_batch_size=8)
    got = dec.run([request(p, n) for p, n in zip(ps, lengths)])
    assert [got[i] for i in range(len(ps))] == want
    assert len(dec) == 0 and dec.verifier.cache is None
    if kind == "oracle":  # the oracle's paths were accepted: fewer steps than tokens
        dec = BatchDecoder(model, heads, TREE, {EOS})
        outs = [dec.add(request(p, 40, ignore_eos=True)) for p in ps]
        steps = 0
        while len(dec):
            dec.step()
            steps += 1
        assert steps < 30
        assert sum(o.stats.mean_accepted_length for o in outs) / len(outs) > 1.5


@pytest.mark.parametrize("kind", ["none", "oracle"])
def test_eos_ends_one_sequence_early(model, kind):
    ps = prompts(3, seed=2, lo=5)
    plain = [alone(model, p, 30, ignore_eos=True) for p in ps]
    heads = make_heads(kind, model, list(zip(ps, plain)))
    eos = plain[1][6]  # a token from the middle of sequence 1 ends it there
    reqs = [request(ps[0], 30, ignore_eos=True), request(ps[1], 30, eos=[eos]), request(ps[2], 30, ignore_eos=True)]
    dec = BatchDecoder(model, heads, TREE, {EOS})
    firsts = [dec.add(r) for r in reqs]
    out = {o.id: list(o.tokens) for o in firsts}
    reasons = {}
    while len(dec):
        for o in dec.step():
            out[o.id] += o.tokens
            if o.finished:
                reasons[o.id] = o.finish_reason
                assert o.id not in dec.ids
    assert out[1] == plain[1][: plain[1].index(eos) + 1] == alone(model, ps[1], 30, eos=(eos,))
    assert out[0] == plain[0] and out[2] == plain[2]
    assert reasons == {0: "length", 1: "stop", 2: "length"}


@pytest.mark.parametrize("kind", ["none", "random", "oracle"])
def test_requests_added_mid_way_still_match(model, kind):
    ps = prompts(7, seed=3)
    want = [alone(model, p, 20 + 3 * i) for i, p in enumerate(ps)]
    heads = make_heads(kind, model, list(zip(ps, want)))
    # capacity 3: the later requests join as earlier ones finish (continuous batching)
    dec = BatchDecoder(model, heads, TREE, {EOS}, max_batch_size=3)
    got = dec.run([request(p, 20 + 3 * i) for i, p in enumerate(ps)])
    assert [got[i] for i in range(len(ps))] == want
    # and by hand: one joins after three steps of the others
    dec = BatchDecoder(model, heads, TREE, {EOS})
    out = {}
    for i in (0, 1):
        o = dec.add(request(ps[i], 20 + 3 * i))
        out[o.id] = list(o.tokens)
    for step in range(8):
        if step == 3:
            o = dec.add(request(ps[2], 26))
            out[o.id] = list(o.tokens)
        for o in dec.step():
            out[o.id] += o.tokens
    while len(dec):
        for o in dec.step():
            out[o.id] += o.tokens
    assert [out[i] for i in range(3)] == want[:3]


def test_eager_attention_gives_the_same_tokens():
    """The additive mask is also right for the eager kernel (a bool mask would not be)."""
    eager = tiny_llama(attn="eager")
    ps = prompts(4, seed=9)
    want = [alone(eager, p, 20, ignore_eos=True) for p in ps]
    heads = OracleHeads(eager, list(zip(ps, want)))
    got = BatchDecoder(eager, heads, TREE, {EOS}, max_batch_size=2).run([request(p, 20, ignore_eos=True) for p in ps])
    assert [got[i] for i in range(4)] == want


def test_cancel_frees_the_slot_and_the_cache_rows(model):
    ps = prompts(3, seed=4, lo=10)
    want = [alone(model, p, 30, ignore_eos=True) for p in ps]
    dec = BatchDecoder(model, random_heads(model), TREE, {EOS}, max_batch_size=2)
    out = {}
    for p in ps[:2]:
        o = dec.add(request(p, 30, ignore_eos=True))
        out[o.id] = list(o.tokens)
    assert not dec.has_room
    with pytest.raises(MedusaError, match="full"):
        dec.add(request(ps[2], 30))
    for o in dec.step():
        out[o.id] += o.tokens
    assert dec.cancel(0) and not dec.cancel(0)
    assert dec.has_room and dec.ids == [1]
    assert len(dec.verifier.rows) == 1 and dec.verifier.rows[0].index == 0
    o = dec.add(request(ps[2], 30, ignore_eos=True))
    out[o.id] = list(o.tokens)
    while len(dec):
        for o in dec.step():
            out[o.id] += o.tokens
    assert out[1] == want[1] and out[2] == want[2]
    assert out[0] == want[0][: len(out[0])]


class PlainAbove:
    """A load policy: the method's budget up to `rows` rows, the root alone above."""

    def __init__(self, rows):
        self.rows = rows

    def budget(self, rows):
        return None if rows <= self.rows else 1

    def observe(self, rows, budget, tokens, seconds):
        pass


def test_a_policy_turns_the_tree_off_under_load(model):
    ps = prompts(4, seed=5)
    want = [alone(model, p, 15, ignore_eos=True) for p in ps]
    heads = OracleHeads(model, list(zip(ps, want)), hit=1.0)
    dec = BatchDecoder(model, heads, TREE, {EOS}, policy=PlainAbove(2))
    outs = [dec.add(request(p, 15, ignore_eos=True)) for p in ps]
    out = {o.id: list(o.tokens) for o in outs}
    for _ in range(3):  # 4 rows: plain steps
        for o in dec.step():
            out[o.id] += o.tokens
    assert all(set(o.stats.accepted_lengths) == {1} for o in outs)
    dec.cancel(2), dec.cancel(3)
    while len(dec):  # 2 rows: the tree again, and the oracle is always right
        for o in dec.step():
            out[o.id] += o.tokens
    assert out[0] == want[0] and out[1] == want[1]
    assert max(outs[0].stats.accepted_lengths) > 1


def test_adaptive_speculation_picks_the_fastest_measured_budget():
    from medusa_decoding.engine import AdaptiveSpeculation

    policy = AdaptiveSpeculation([1, 8], warm=2, explore=5, probe_share=0.5)
    # the tree emits 2 tokens a row; at 1 row for 1.2x the time, at 16 rows for 3x
    rate = {(1, 1): (1, 1.0), (1, 8): (2, 1.2), (16, 1): (16, 1.0), (16, 8): (32, 3.0)}
    chosen = {1: [], 16: []}
    for _ in range(40):
        for rows in (1, 16):
            budget = policy.budget(rows)
            tokens, seconds = rate[(rows, budget)]
            policy.observe(rows, budget, tokens, seconds)
            chosen[rows].append(budget)
    assert chosen[1][:4] == [1, 1, 8, 8] and chosen[16][:4] == [1, 1, 8, 8]  # each level measured first
    assert chosen[1][10:].count(8) > 20 and chosen[16][10:].count(1) > 20
    assert 1 in chosen[1][10:] and 8 in chosen[16][10:]  # still re-measured now and then
    assert policy.table() == {1: {1: 1.0, 8: pytest.approx(1.67, abs=0.05)}, 16: {1: 16.0, 8: pytest.approx(10.67, abs=0.05)}}


def test_adaptive_speculation_re_measures_ever_less_once_settled_and_follows_a_change():
    from medusa_decoding.engine import AdaptiveSpeculation

    policy = AdaptiveSpeculation([1, 4, 8], warm=2, explore=8, max_explore=64)
    rate = {1: (8, 1.0), 4: (12, 1.0), 8: (11, 1.0)}  # 8 rows: budget 4 is fastest
    chosen = []
    for _ in range(1000):
        budget = policy.budget(8)
        policy.observe(8, budget, *rate[budget])
        chosen.append(budget)
    slower = [i for i, b in enumerate(chosen) if b != 4]
    assert chosen[:6] == [1, 1, 4, 4, 8, 8]
    assert len(slower) <= 6 + 20  # warm-up, then waits of 8, 16, 32, 64, 64 ... steps
    assert {chosen[i] for i in slower[6:]} == {1, 8}  # both others still re-measured, in turn
    assert chosen.count(4) > 970
    # the load changes: plain steps get 4x cheaper and fastest; it is found within one wait and kept
    rate[1] = (8, 0.25)
    after = []
    for _ in range(300):
        budget = policy.budget(8)
        policy.observe(8, budget, *rate[budget])
        after.append(budget)
    assert after.index(1) <= 2 * 64 and after[-100:].count(1) > 90


def test_adaptive_speculation_weighs_steps_by_their_time_not_their_luck():
    """At 4 rows a tree that copies 18 tokens in one plain step's time, then emits 4 in four: 22
    tokens in 5 s (4.4/s) against plain's 5.7/s. The mean of its per-step rates (18 and 1: 9.5/s)
    would pick it."""
    from medusa_decoding.engine import AdaptiveSpeculation

    policy = AdaptiveSpeculation([1, 8], warm=4, explore=8)
    lucky = iter([(18, 1.0), (4, 4.0)] * 200)
    chosen = []
    for _ in range(200):
        budget = policy.budget(4)
        policy.observe(4, budget, *((4, 0.7) if budget == 1 else next(lucky)))
        chosen.append(budget)
    assert chosen[8:].count(1) > 160
    assert policy.table()[4][8] == pytest.approx(4.4, rel=0.3) and policy.table()[4][1] == pytest.approx(5.71, abs=0.01)


def test_adaptive_speculation_measures_a_rows_tokens_at_every_batch_size_together():
    """Tokens a row emits belong to the drafter and the prompts: a level's tau is pooled over
    batch sizes, so a few lucky copy steps at one batch size do not decide there."""
    from medusa_decoding.engine import AdaptiveSpeculation

    policy = AdaptiveSpeculation([1, 6], warm=2, explore=8)
    tree_tokens = iter([1, 2] * 60)
    for _ in range(60):  # one row: a tree emits 1.5 tokens a step for 1.2x plain's time
        budget = policy.budget(1)
        policy.observe(1, budget, 1 if budget == 1 else next(tree_tokens), 1.0 if budget == 1 else 1.2)
    assert policy.tau[6] == pytest.approx(1.5, abs=0.2)
    # 2 rows: plain costs 0.9 s, the tree 2.0 s; its first steps there copy 8 tokens a row
    for tokens in (16, 16):
        policy.observe(2, 6, tokens, 2.0)
    policy.observe(2, 1, 2, 0.9), policy.observe(2, 1, 2, 0.9)
    assert policy.tau[6] < 2.5  # those steps alone (8 a row) would make the tree look 3.6x faster
    assert policy.best(2) == 1


def test_adaptive_speculation_never_measures_a_bigger_tree_above_one_that_loses():
    from medusa_decoding.engine import AdaptiveSpeculation

    policy = AdaptiveSpeculation([1, 6, 12], warm=3, explore=8)
    rate = {1: (8, 0.42), 6: (14, 1.2), 12: (16, 1.9)}  # 8 rows: plain 19 tok/s, the trees 12 and 8
    chosen = []
    for _ in range(400):
        budget = policy.budget(8)
        policy.observe(8, budget, *rate[budget])
        chosen.append(budget)
    assert chosen[:6] == [1, 1, 1, 6, 6, 6] and 12 not in chosen  # 12 is above 6, which loses
    assert chosen.count(6) <= 3 + 4  # warm-up, then the neighbour re-measured ever less
    # where the trees win, it climbs: 12 is measured once 6 beats plain (each tree until 8 rows
    # were seen at it: its tokens a row)
    policy = AdaptiveSpeculation([1, 6, 12], warm=2, explore=8)
    rate = {1: (1, 0.1), 6: (2.5, 0.12), 12: (3.2, 0.14)}
    chosen = []
    for _ in range(100):
        budget = policy.budget(1)
        policy.observe(1, budget, *rate[budget])
        chosen.append(budget)
    assert chosen[:18] == [1] * 2 + [6] * 8 + [12] * 8 and chosen[-50:].count(12) > 45


def test_adaptive_speculation_keeps_plain_steps_where_a_tree_wins_by_less_than_the_margin():
    from medusa_decoding.engine import AdaptiveSpeculation

    for tree_s, want in ((0.98, 1), (0.9, 6)):  # plain 1 tok/s; the tree 1.02x, then 1.11x of it
        policy = AdaptiveSpeculation([1, 6], warm=2, explore=8, margin=0.05)
        chosen = []
        for _ in range(100):
            budget = policy.budget(1)
            policy.observe(1, budget, 1, 1.0 if budget == 1 else tree_s)
            chosen.append(budget)
        assert chosen[-50:].count(want) > 45, (tree_s, chosen)


def test_adaptive_speculation_keeps_the_calibrated_budget_at_one_row_unless_another_is_faster():
    """One row keeps `prefer` (the budget calibrated for one row, what `generate` runs) while it
    is within the margin of the fastest, even above a smaller tree that lost; more rows do not."""
    from medusa_decoding.engine import AdaptiveSpeculation

    # plain 1 tok/s; budget 6 0.9x of it, budget 12 then 0.98x (kept at 1 row), 0.9x (not)
    for tree12_s, want in ((1.02, 12), (1.11, 1)):
        policy = AdaptiveSpeculation([1, 6, 12], warm=2, explore=8, margin=0.05, prefer=12)
        chosen = {1: [], 2: []}
        for _ in range(100):
            for rows in (1, 2):
                budget = policy.budget(rows)
                seconds = {1: 1.0, 6: 1.11, 12: tree12_s}[budget]
                policy.observe(rows, budget, rows, seconds * rows)
                chosen[rows].append(budget)
        assert chosen[1][:18] == [1] * 2 + [6] * 8 + [12] * 8, chosen[1]  # a tree warms up over 8 row-steps
        assert chosen[1][-50:].count(want) > 45, (tree12_s, chosen[1])
        assert 12 not in chosen[2] and chosen[2][-50:].count(1) > 45  # 2 rows: the smallest within the margin


def test_adaptive_speculation_skips_a_tree_that_lost_at_fewer_rows_and_probes_it_rarely():
    """A bigger batch makes a tree dearer: where 4 rows found a tree slower than plain, 8 rows do
    not warm it up; and a probe that costs several plain steps waits long enough to stay within
    `probe_share` of the time."""
    from medusa_decoding.engine import AdaptiveSpeculation

    policy = AdaptiveSpeculation([1, 6], warm=2, explore=16, probe_share=0.02, max_explore=1000)
    rate = {(4, 1): (4, 0.3), (4, 6): (6, 0.6), (8, 1): (8, 0.35), (8, 6): (12, 1.5)}
    chosen = {4: [], 8: []}
    for rows in (4, 8):
        for _ in range(300):
            budget = policy.budget(rows)
            policy.observe(rows, budget, *rate[(rows, budget)])
            chosen[rows].append(budget)
    assert chosen[4][:4] == [1, 1, 6, 6]
    # 8 rows: not warmed up (it lost at 4 rows), and first re-measured when 4 rows' figures say a
    # probe stays within 2%: there it cost 0.6 s for 6 tokens that plain emits in 0.45 s, 0.5 of a
    # plain step too many, so 25 steps after its 2 warm-up steps
    assert chosen[8][:26] == [1] * 26 and chosen[8][26] == 6
    # 8 rows: a probe costs 1.5 s for 12 tokens, which plain emits in 0.525 s: 2.8 steps too many,
    # so after it the wait is >= 2.8 / 0.02 = 140 steps
    assert chosen[8].count(6) == 2 and policy.wait[8] >= 139
    assert (policy.wait[4], chosen[4].count(6)) < (policy.wait[8], 2 + 4)


def test_context_limit_per_row():
    small = tiny_llama(max_positions=40)
    ps = [p[:20] for p in prompts(3, seed=6, lo=20, hi=30)] + [prompts(1, seed=7)[0][:5]]
    want = [alone(small, p, 100, ignore_eos=True) for p in ps]
    assert all(len(p) + len(w) == 40 for p, w in zip(ps, want))
    for heads in (None, OracleHeads(small, list(zip(ps, want)), hit=1.0)):
        dec = BatchDecoder(small, heads, TREE, {EOS})
        reasons = {}
        out = {}
        for p in ps:
            o = dec.add(request(p, 100, ignore_eos=True))
            out[o.id] = list(o.tokens)
        while len(dec):
            for o in dec.step():
                out[o.id] += o.tokens
                if o.finished:
                    reasons[o.id] = o.finish_reason
        assert [out[i] for i in range(len(ps))] == want
        assert set(reasons.values()) == {"length"}


@pytest.mark.parametrize("kind", ["none", "random"])
def test_seeded_sampling_matches_alone(model, kind):
    ps = prompts(3, seed=8)
    heads = make_heads(kind, model, [])
    sampling = [dict(temperature=0.8, seed=10 + i) for i in range(3)]
    want = [alone(model, p, 25, heads=heads, sampling=SamplingConfig(**s), ignore_eos=True)
            for p, s in zip(ps, sampling)]
    dec = BatchDecoder(model, heads, TREE, {EOS})
    got = dec.run([request(p, 25, ignore_eos=True, **s) for p, s in zip(ps, sampling)])
    assert [got[i] for i in range(3)] == want


def test_bad_inputs_are_refused(model):
    dec = BatchDecoder(model, None, TREE, {EOS})
    with pytest.raises(MedusaError, match="empty"):
        dec.add(request([], 5))
    with pytest.raises(MedusaError, match="context"):
        dec.add(request([1] * 256, 5))
    with pytest.raises(MedusaError, match="max_batch_size"):
        BatchDecoder(model, None, TREE, {EOS}, max_batch_size=0)
    assert dec.step() == []
