"""Packed linears (kernels/packed.py): the eager bf16 step on prepacked weights gives the stock
step's logits bit for bit, leaves the model stock, and is refused where it would not be exact."""

import pytest
import torch
from torch import nn

from medusa_decoding.config import NgramConfig
from medusa_decoding.engine import MedusaModel
from medusa_decoding.models import use_fast_attention
from medusa_decoding.kernels import packed
from medusa_decoding.verifiers.transformers import EagerBackend

from conftest import byte_tokenizer, random_heads, tiny_llama

_why = (packed.supported(torch.zeros(1, dtype=torch.bfloat16))
        or packed.check_weight(torch.zeros(64, 64, dtype=torch.bfloat16)))  # AVX2 only: oneDNN has no bf16 reorder
needs_onednn = pytest.mark.skipif(_why is not None, reason=f"this machine cannot pack bf16 linears: {_why}")


def bf16_base():
    base = tiny_llama(max_positions=512, seed=1).to(torch.bfloat16)
    use_fast_attention(base)
    return base


@needs_onednn
def test_packed_step_gives_the_stock_logits_and_leaves_the_model_stock():
    base = bf16_base()
    backend = EagerBackend(base)
    assert backend.packed and backend.stats()["backend"] == "eager-packed"
    linears = [m for m in backend.model.modules() if isinstance(m, packed.PackedLinear)]
    assert len(linears) == sum(isinstance(m, nn.Linear) for m in base.modules()) > 0
    assert all(type(m) is not packed.PackedLinear for m in base.modules())  # the base keeps its layers
    assert {id(p) for p in backend.model.parameters()} == {id(p) for p in base.parameters()}  # shared, not copied
    base.set_attn_implementation("sdpa")  # one config: what is set on the base holds for the copy
    assert backend.model.model.layers[0].self_attn.config._attn_implementation == "sdpa"
    ids = torch.randint(3, 200, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(backend.model(ids).logits, base(ids).logits)


@needs_onednn
def test_generation_on_packed_linears_equals_the_stock_one():
    """Plain and speculative bf16 decoding (random Medusa heads, n-gram branch): the same tokens on
    packed and stock linears, and the packed path really ran."""
    base = bf16_base()
    heads = random_heads(base, scale=3.0).to(torch.bfloat16)
    tok = byte_tokenizer()
    runs = {}
    for pack in (True, False):
        backend = EagerBackend(base, packed=pack)
        assert backend.packed is pack
        for spec in (False, True):
            model = MedusaModel(base, tok, heads=heads if spec else None, ngram=NgramConfig(length=4) if spec else None,
                                tree_budget=6, backend=backend)
            runs[pack, spec] = [model.generate(p, chat=False, max_new_tokens=60, ignore_eos=True).token_ids
                                for p in ("Hello there, ", "abcabcabc ")]
    assert runs[True, False] == runs[False, False] and runs[True, True] == runs[False, True]


@needs_onednn
def test_the_check_finds_a_packed_layer_that_differs(monkeypatch):
    base = bf16_base()
    assert packed.check(base) is None
    off = packed.packed_linear
    monkeypatch.setattr(packed, "packed_linear", lambda x, w, b: off(x, w, b) * (1 + 2 ** -6))
    assert "differs at 1 rows" in packed.check(base)
    assert packed.pack_linears(base) is base  # not packed where it would not be exact


@needs_onednn
def test_the_check_asks_for_one_row_products_not_the_stock_kernel_at_n_rows(monkeypatch):
    """The rows of a packed product must be what a one-token step computes: a stock kernel whose
    multi-row rounding differs (oneDNN on AMX, the LM head from 28 rows) does not stop packing; a
    packed kernel whose rows depend on the other rows does."""
    base = bf16_base()
    linear = torch.nn.functional.linear

    def stock_by_rows(x, w, b=None):  # rounds otherwise from 8 rows on, as a row-count-blocked kernel may
        y = linear(x, w, b)
        return y * (1 + 2 ** -6) if x.shape[-2] >= 8 else y
    monkeypatch.setattr(packed.F, "linear", stock_by_rows)
    assert packed.check(base) is None
    monkeypatch.setattr(packed.F, "linear", linear)
    off = packed.packed_linear
    monkeypatch.setattr(packed, "packed_linear", lambda x, w, b: off(x, w, b) * (1 + 2 ** -6 * (x.shape[-2] >= 16)))
    assert "differs at 16 rows" in packed.check(base)


def test_fp32_and_the_reference_path_stay_stock():
    base = tiny_llama()
    assert "float32" in packed.supported(base.lm_head.weight)
    assert not EagerBackend(base).packed
    assert not EagerBackend(base.to(torch.bfloat16), slots=False).packed


@needs_onednn
@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_drafting_on_packed_linears_proposes_what_the_stock_drafter_does(kind):
    """A bf16 drafter drafts on packed layers (its own, its shortlist or the base's LM head):
    the same trees, hence the same tokens and accepted lengths, as on its stock layers."""
    from test_methods import random_drafter

    base = bf16_base()
    weights = (random_heads(base, scale=3.0) if kind == "medusa" else random_drafter(kind, base.float()))
    base.to(torch.bfloat16)
    weights = weights.to(torch.bfloat16)
    backend, tok = EagerBackend(base), byte_tokenizer()
    model = MedusaModel(base, tok, heads=weights, tree_budget=6, backend=backend)
    d = model.drafter
    layers = d.lm_head if kind == "medusa" else d.short.packed
    assert any(isinstance(m, packed.PackedLinear) for m in d.net.modules()) and layers is not None
    assert not any(isinstance(m, packed.PackedLinear) for m in d.weights.modules())
    calls = []  # the packed layers really draft
    for m in d.net.modules():
        if isinstance(m, packed.PackedLinear):
            m.register_forward_hook(lambda *_: calls.append(1))
    runs = []
    for _ in range(2):
        outs = [model.generate(p, chat=False, max_new_tokens=40, ignore_eos=True) for p in ("Hello there, ", "abcabc ")]
        assert calls or runs
        runs.append([(o.token_ids, o.stats.accepted_lengths) for o in outs])
        d.net = d.weights  # the second run on the stock layers
        if kind == "medusa":
            d.lm_head = base.get_output_embeddings()
        else:
            d.short.packed = None
    assert runs[0] == runs[1]
