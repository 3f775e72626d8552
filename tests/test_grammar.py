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

    def root_state_only(self, tokens, tree):
        bits = grammar_module.new_bitmask(tokens.numel(), self.vocab_size)
        for i in range(tokens.numel()):
            grammar_module.fill_mask(self.matcher, bits, i)
        return bits

    monkeypatch.setattr(grammar_module.RowGrammar, "masks", root_state_only)
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


def valid_keys(text: str, keys: list[str]) -> bool:
    value = json.loads(text)
    return list(value) == keys and all(isinstance(v, bool) for v in value.values())
