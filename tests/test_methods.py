"""Every proposer x every verifier backend x one row or three rows (one joining mid-way): greedy
output token-identical to plain decoding, with random drafters (fp32)."""

import pytest
import torch

from medusa_decoding import drafters
from medusa_decoding.config import GenerationConfig, NgramConfig
from medusa_decoding.engine import MedusaModel, Request
from medusa_decoding.verifiers.compiled import CompiledBackend
from medusa_decoding.verifiers.transformers import EagerBackend

from conftest import byte_tokenizer, random_heads, tiny_llama


def random_drafter(kind, base, seed=0):
    d = drafters.for_base(kind, base, shortlist_size=256)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return d


def method(name, base, backend):
    tok, ngram = byte_tokenizer(), NgramConfig(length=4)
    kw = dict(backend=backend)
    if name == "plain":
        return MedusaModel(base, tok, **kw)
    if name == "ngram":
        return MedusaModel(base, tok, ngram=ngram, **kw)
    if name == "medusa":
        return MedusaModel(base, tok, heads=random_heads(base), **kw)
    if name == "dynamic+ngram":
        return MedusaModel(base, tok, heads=random_heads(base), tree="dynamic", tree_budget=8, ngram=ngram, **kw)
    kind, _, plus = name.partition("+")
    return MedusaModel(base, tok, heads=random_drafter(kind, base), tree_budget=6, ngram=ngram if plus else None, **kw)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41] * 9, list(range(60, 90))]
N = 20


@pytest.fixture(scope="module")
def reference():
    base = tiny_llama()
    plain = MedusaModel(base, byte_tokenizer(), backend=EagerBackend(base, slots=False))
    return base, [plain.generate(torch.tensor([p]), max_new_tokens=N, ignore_eos=True).token_ids for p in PROMPTS]


def run_rows(model):
    """Two rows, then a third joins after three steps; every row to the end."""
    decoder = model.decoder(3)
    out = {}
    for i in (0, 1):
        o = decoder.add(Request(torch.tensor(PROMPTS[i]), GenerationConfig(max_new_tokens=N, ignore_eos=True), id=i))
        out[i] = list(o.tokens)
    for step in range(3):
        for o in decoder.step():
            out[o.id] += o.tokens
    o = decoder.add(Request(torch.tensor(PROMPTS[2]), GenerationConfig(max_new_tokens=N, ignore_eos=True), id=2))
    out[2] = list(o.tokens)
    while len(decoder):
        for o in decoder.step():
            out[o.id] += o.tokens
    return [out[i] for i in range(3)]


METHODS = ["plain", "ngram", "medusa", "dynamic+ngram", "hydra", "hydra+ngram", "eagle", "eagle+ngram"]


@pytest.mark.parametrize("name", METHODS)
def test_eager(reference, name):
    base, want = reference
    model = method(name, base, EagerBackend(base))
    assert [model.generate(torch.tensor([p]), max_new_tokens=N, ignore_eos=True).token_ids for p in PROMPTS] == want
    assert run_rows(model) == want


def test_compiled(reference):
    """One compiled backend shared by every method (its graphs too): the same tokens."""
    base, want = reference
    backend = CompiledBackend(base)
    for name in ("plain", "medusa", "hydra+ngram", "eagle+ngram"):
        model = method(name, base, backend)
        assert [model.generate(torch.tensor([p]), max_new_tokens=N, ignore_eos=True).token_ids
                for p in PROMPTS] == want, name
        assert run_rows(model) == want, name
    assert backend.stats()["graphs"] == len(backend.shapes) > 0
