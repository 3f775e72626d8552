"""Structured outputs (grammar.py): every method's greedy output under a grammar equals plain
constrained decoding, is valid, and each tree node is masked by its own path's grammar state."""

import json

import pytest

from medusa_decoding.config import Grammar, MedusaError
from medusa_decoding.engine import MedusaModel

from conftest import byte_tokenizer, random_heads, tiny_llama
from test_engine import _Oracle
from test_methods import random_drafter

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "tags", "age"], "additionalProperties": False}
GRAMMARS = [Grammar("json_schema", json.dumps(SCHEMA)),
            Grammar("json_object"), Grammar("regex", r"(yes|no): [a-e]{2,5}\.")]


def valid(text: str, grammar: Grammar) -> bool:
    if grammar.kind.value == "regex":
        import re

        return re.fullmatch(grammar.source, text) is not None
    value = json.loads(text)
    if grammar.kind.value == "json_object":
        return isinstance(value, dict)
    return (set(value) == {"name", "tags", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 12
            and isinstance(value["age"], int) and all(t in ("red", "green") for t in value["tags"]))


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


@pytest.mark.parametrize("grammar", GRAMMARS, ids=["json_schema", "json_object", "regex"])
def test_every_method_gives_plain_constrained_output_and_it_is_valid(base, grammar):
    tok = byte_tokenizer()
    models = [MedusaModel(base, tok, heads=random_heads(base)), MedusaModel(base, tok, heads=random_drafter("hydra", base)),
              MedusaModel(base, tok, heads=random_drafter("eagle", base))]
    for prompt in ["hello", "Give me JSON:", "x"]:
        plain = models[0].generate(prompt, chat=False, max_new_tokens=120, use_medusa=False, grammar=grammar)
        assert plain.finish_reason == "stop" and valid(plain.text, grammar), plain.text
        for m in models:
            out = m.generate(prompt, chat=False, max_new_tokens=120, grammar=grammar)
            assert out.token_ids == plain.token_ids, m.method().describe()


def test_each_node_is_masked_by_its_own_paths_grammar_state(base, monkeypatch):
    """A drafter proposing plain constrained decoding's answer (deep chains accepted) and a
    forbidden sibling: the output equals plain constrained decoding. Masking every node by the
    root's state instead (no per-branch matcher state) accepts a candidate the grammar forbids."""
    from medusa_decoding import grammar as grammar_module

    tok = byte_tokenizer()
    g = GRAMMARS[0]
    m = MedusaModel(base, tok)
    plain = m.generate("hello", chat=False, max_new_tokens=120, use_medusa=False, grammar=g)
    oracle = MedusaModel(base, tok, heads=_Oracle(plain.token_ids), ngram=None)
    spec = oracle.generate("hello", chat=False, max_new_tokens=120, grammar=g)
    assert spec.token_ids == plain.token_ids and spec.stats.mean_accepted_length > 2.5

    def root_state_only(self, tokens, tree):  # every node valid, masked by the root's state
        bits = grammar_module.new_bitmask(tokens.numel(), self.vocab_size)
        for i in range(tokens.numel()):
            grammar_module.fill_mask(self.matcher, bits, i)
        return bits, [True] * tokens.numel()

    monkeypatch.setattr(grammar_module.RowGrammar, "walk", root_state_only)
    with pytest.raises(MedusaError, match="breaks the grammar"):  # a forbidden candidate got accepted
        oracle.generate("hello", chat=False, max_new_tokens=120, grammar=g)


def test_sampling_under_a_grammar_stays_valid(base):
    m = MedusaModel(base, byte_tokenizer(), heads=random_heads(base))
    for seed in range(4):
        out = m.generate("hi", chat=False, max_new_tokens=150, grammar=GRAMMARS[0], temperature=1.0, seed=seed)
        assert out.finish_reason == "stop" and valid(out.text, GRAMMARS[0]), out.text


@pytest.mark.parametrize("grammar, message", [
    (Grammar("json_schema", "{not json"), "invalid json_schema"), (Grammar("regex", "(unclosed"), "invalid regex"),
    (Grammar("lark", "start: nothing_defined"), "invalid lark"),
])
def test_invalid_grammars_are_refused_before_decoding(base, grammar, message):
    with pytest.raises(MedusaError, match=message):
        MedusaModel(base, byte_tokenizer()).generate("hi", chat=False, max_new_tokens=4, grammar=grammar)


def test_grammar_kinds_are_checked():
    with pytest.raises(MedusaError, match="unknown grammar kind"):
        Grammar("yaml", "x")
    with pytest.raises(MedusaError, match="needs its text"):
        Grammar("regex")


def test_forced_tokens_are_proposed_beside_the_tree_and_accepted(base, monkeypatch):
    """On a schema with long fixed keys the grammar forces most tokens: proposed as a chain beside
    the drafter's tree (no drafter call), they are accepted, and tau is far above the drafter's
    alone (the branch turned off); the output is plain constrained decoding's either way."""
    from medusa_decoding.proposers import forced

    keys = ["a_rather_long_property_name", "another_fixed_key_of_this_schema", "and_one_more_long_key"]
    schema = {"type": "object", "properties": {k: {"type": "boolean"} for k in keys}, "required": keys,
              "additionalProperties": False}
    g = Grammar("json_schema", json.dumps(schema))
    m = MedusaModel(base, byte_tokenizer(), heads=random_heads(base))
    plain = m.generate("go", chat=False, max_new_tokens=200, use_medusa=False, grammar=g)
    with_forced = m.generate("go", chat=False, max_new_tokens=200, grammar=g)
    monkeypatch.setattr(forced.ForcedBranch.__init__, "__defaults__", (0,))  # no forced chain
    without = m.generate("go", chat=False, max_new_tokens=200, grammar=g)
    assert with_forced.token_ids == without.token_ids == plain.token_ids and valid_keys(plain.text, keys)
    assert with_forced.stats.mean_accepted_length > 4 and without.stats.mean_accepted_length < 2
    assert with_forced.stats.steps < plain.stats.steps / 4


def test_forced_tokens_are_labelled_forced(base):
    """The provenance of a token accepted on the forced chain is `forced`, not `draft`: on the
    long fixed keys most tokens are; every other candidate accepted is the random heads' (`draft`)."""
    from medusa_decoding.config import GenerationConfig, NgramConfig
    from medusa_decoding.engine import Decoder, Method, Request, Source
    from medusa_decoding.grammar import Grammars
    from medusa_decoding.proposers import wrap
    from medusa_decoding.verifiers.transformers import EagerBackend, TransformersVerifier

    keys = ["a_rather_long_property_name", "another_fixed_key_of_this_schema"]
    schema = {"type": "object", "properties": {k: {"type": "boolean"} for k in keys}, "required": keys,
              "additionalProperties": False}
    tok = byte_tokenizer()
    method = Method(wrap(random_heads(base), base), NgramConfig(length=4))  # the forced chain under the n-gram one
    decoder = Decoder(TransformersVerifier(EagerBackend(base)), method, [tok.eos_token_id],
                      grammars=Grammars(tok, base.config.vocab_size, [tok.eos_token_id]))
    out = decoder.add(Request(tok("go", return_tensors="pt").input_ids[0],
                              GenerationConfig(max_new_tokens=200, grammar=Grammar("json_schema", json.dumps(schema)))))
    sources = list(out.sources)
    while not out.finished:
        (out,) = decoder.step()
        sources += out.sources
    assert sources.count(Source.FORCED) > sum(map(len, keys)), sources


def valid_keys(text: str, keys: list[str]) -> bool:
    value = json.loads(text)
    return list(value) == keys and all(isinstance(v, bool) for v in value.values())


# the filter of drafts (proposers/constrained.py) on regexes that allow "a" to "h", 3 or 2 times, then the end
THREE_LETTERS, LETTERS = Grammar("regex", "[a-h]{3}"), Grammar("regex", "[a-h]{2}")


def row_grammar(grammar=THREE_LETTERS):
    from medusa_decoding.grammar import Grammars

    tok = byte_tokenizer()
    return Grammars(tok, 258, [tok.eos_token_id]).row(grammar)


class _Fixed:
    """An inner proposer that proposes one fixed tree and records the budget it was asked for."""

    depth_limit = 2

    def __init__(self, proposal):
        self.proposal, self.asked, self.observed = proposal, [], []

    def start(self, prompt):
        pass

    def use_graphs(self, graphs):
        pass

    def propose(self, root, budget=None):
        self.asked.append(budget)
        return self.proposal

    def observe(self, hidden, next_tokens, nodes):
        self.observed.append(nodes)


def _proposal(tokens, parent, score=None):
    import torch

    from medusa_decoding.proposers import Proposal
    from medusa_decoding.tree import tree_from_parents

    parent = torch.tensor(parent)
    depth = torch.zeros_like(parent)
    for i in range(1, len(parent)):
        depth[i] = depth[parent[i]] + 1
    return Proposal(torch.tensor([ord(t) for t in tokens]), tree_from_parents(parent, depth, int(depth.max())),
                    score=None if score is None else torch.tensor(score))


def test_the_filter_drops_forbidden_candidates_and_their_subtrees():
    """Root "a"; candidates "b" (allowed) with child "c" (allowed), "z" (forbidden) with child "d"
    (allowed after any letter, but under a forbidden node), "x" (forbidden). Kept: root, b, c; their
    masks are the walk's; observe gets the inner proposal's node numbers back."""
    import torch

    from medusa_decoding.proposers.constrained import GrammarFilter

    g = row_grammar()
    g.consume([ord("a")])  # the root is emitted and consumed before a step proposes
    inner = _Fixed(_proposal("abzcdx", [-1, 0, 0, 1, 2, 0]))
    f = GrammarFilter(inner, g)
    p = f.propose(torch.tensor(ord("a")), budget=None)
    assert [chr(t) for t in p.tokens.tolist()] == ["a", "b", "c"]
    assert p.tree.parent.tolist() == [-1, 0, 1] and p.tree.depth.tolist() == [0, 1, 2]
    bits, valid = g.walk(inner.proposal.tokens, inner.proposal.tree)
    assert valid == [True, True, False, True, False, False]
    assert torch.equal(p.masks, bits[[0, 1, 3]])
    assert inner.asked == [None]  # a static tree is only pruned: no bigger tree asked for
    f.observe(torch.zeros(3, 4), torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    assert inner.observed[-1].tolist() == [0, 1, 3]


def test_a_scored_drafter_fills_the_budget_with_valid_candidates():
    """Asked for twice the budget, the best-scored valid nodes are kept: the forbidden "z" and "y"
    score highest and give their places to "c" and "d"."""
    import torch

    from medusa_decoding.proposers.constrained import OVERDRAFT, GrammarFilter

    g = row_grammar()
    g.consume([ord("a")])
    inner = _Fixed(_proposal("azybcde", [-1, 0, 0, 0, 0, 0, 4], score=[0.0, -0.1, -0.2, -0.5, -0.6, -0.7, -0.8]))
    f = GrammarFilter(inner, g, own_budget=3)
    p = f.propose(torch.tensor(ord("a")), budget=None)
    assert inner.asked == [OVERDRAFT * 3]
    assert [chr(t) for t in p.tokens.tolist()] == ["a", "b", "c"]
    p = f.propose(torch.tensor(ord("a")), budget=4)
    assert inner.asked[-1] == OVERDRAFT * 4 and [chr(t) for t in p.tokens.tolist()] == ["a", "b", "c", "d"]


def test_every_method_proposes_only_valid_candidates(base, monkeypatch):
    """Each verified node of every step is one the grammar allows (the root aside, which is the
    base's own token): the drafts that random drafters make are filtered before verification."""
    from medusa_decoding.engine import decoder as decoder_module

    seen = []
    accept = decoder_module.accept

    def spy(tokens, logits, tree, sampling, generator):  # logits are masked: a forbidden node's token is -inf at its parent
        parent = tree.parent.tolist()
        seen.extend(bool(logits[parent[i], tokens[i]].isfinite()) for i in range(1, tokens.numel()))
        return accept(tokens, logits, tree, sampling, generator)

    monkeypatch.setattr(decoder_module, "accept", spy)
    tok = byte_tokenizer()
    for heads in (random_heads(base), random_drafter("hydra", base), random_drafter("eagle", base)):
        seen.clear()
        m = MedusaModel(base, tok, heads=heads)
        out = m.generate("hi", chat=False, max_new_tokens=40, grammar=GRAMMARS[0])
        assert seen and all(seen), (m.method().describe(), seen.count(False), len(seen))
        assert out.stats.grammar_s > 0


def test_sampling_under_a_grammar_draws_the_masked_distribution():
    """Speculative sampling of two tokens under "[a-h]{2}", with head 1 ranking forbidden tokens
    first (the filter drops them) and allowed ones by their marginal: the draws follow the base's
    distribution masked by the grammar (TV bound as in test_sampling). Masking each node by the
    root's state only would be the same here (the regex's states allow the same letters), so the
    bound is what guards the acceptance under masks."""
    import math

    import torch

    from medusa_decoding.config import GenerationConfig, SamplingConfig
    from medusa_decoding.engine import Decoder, Method, Request
    from medusa_decoding.grammar import Grammars
    from medusa_decoding.proposers import wrap
    from medusa_decoding.tree import build_tree
    from medusa_decoding.verifiers.transformers import EagerBackend, TransformersVerifier

    from test_sampling import WIDE, tv

    model = tiny_llama(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    tok = byte_tokenizer()
    prompt = torch.tensor([[5, 17, 99, 3]])
    letters = torch.tensor([ord(c) for c in "abcdefgh"])
    with torch.no_grad():
        p1 = torch.softmax(model(prompt).logits[0, -1, letters], -1)
        seqs = torch.cat([prompt.repeat(8, 1), letters[:, None]], 1)
        p2 = torch.softmax(model(seqs).logits[:, -1, letters], -1)
    exact = {(int(a), int(b)): float(p1[i] * p2[i, j]) for i, a in enumerate(letters) for j, b in enumerate(letters)}

    class Heads(torch.nn.Module):
        kind, num_heads = "medusa", 4

        def check_fits(self, base_model):
            pass

        def __init__(self):
            super().__init__()
            logits = torch.full((4, 258), -30.0)
            logits[0, letters] = p2.mean(0).log()
            logits[0, [ord(c) for c in "xyz"]] = 5.0  # forbidden, ranked first
            self.logits = logits

        def forward(self, hidden, lm_head=None, num_heads=None):
            return self.logits

    method = Method(wrap(Heads(), model, build_tree(WIDE)))
    decoder = Decoder(TransformersVerifier(EagerBackend(model)), method, [tok.eos_token_id],
                      grammars=Grammars(tok, 258, [tok.eos_token_id]))
    n, counts, accepted = 1500, {}, 0
    for seed in range(n):
        out = decoder.add(Request(prompt, GenerationConfig(max_new_tokens=2, grammar=LETTERS),
                                  SamplingConfig(temperature=1.0, seed=seed)))
        tokens = list(out.tokens)
        while not out.finished:
            (out,) = decoder.step()
            tokens += out.tokens
            accepted += sum(1 for d in out.depths if d)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    k = sum(1 for p in exact.values() if p > 1 / (10 * n))
    bound = 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1e6) / (2 * n))
    assert accepted > n * 0.1
    assert tv(counts, exact, n) < bound, (tv(counts, exact, n), bound)
