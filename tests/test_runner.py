"""The fast paths (slot cache, short-query attention, compiled step) against the reference path
(transformers' DynamicCache and SDPA): same attention, same kept cache, same greedy tokens (fp32)."""

import pytest
import torch

from medusa_decoding.attention import MIN_KEYS, fits_short_query_attention, register_attention, short_query_attention
from medusa_decoding.cache import SlotCache, keep_path, new_cache
from medusa_decoding.config import DEFAULT_TREE, GenerationConfig, MedusaError, NgramConfig, SamplingConfig
from medusa_decoding.decode import GenerationStats, decode, tree_bias
from medusa_decoding.engine import MedusaModel
from medusa_decoding.models import use_fast_attention
from medusa_decoding.runner import Runner, forward, round_width
from medusa_decoding.tree import build_tree

from conftest import EOS, byte_tokenizer, random_heads, tiny_llama


class Groups:  # what transformers passes as `module`: only num_key_value_groups is read
    def __init__(self, groups):
        self.num_key_value_groups = groups
        self.is_causal = True


def reference_attention(q, k, v, mask):
    """Plain SDPA on repeated key/value heads: q [B, H, n, d], k/v [B, G, S, d] -> [B, n, H, d]."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    n, s = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(n, s, dtype=torch.bool).tril(s - n)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("batch,heads,groups", [(1, 9, 3), (2, 4, 4), (1, 4, 1)])
@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_short_query_attention_equals_sdpa(batch, heads, groups, n, mask_kind):
    g = torch.Generator().manual_seed(n)
    s = MIN_KEYS + 21  # the kernel's own path (fewer keys go to SDPA)
    q = torch.randn(batch, heads, n, 16, generator=g)
    k, v = torch.randn(2, batch, groups, s, 16, generator=g)
    allowed = torch.rand(batch, 1, n, s, generator=g) > 0.3
    allowed[..., -n:] |= torch.eye(n, dtype=torch.bool)  # every query sees itself
    mask = {"none": None, "bool": allowed,
            "additive": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)}[mask_kind]
    got, weights = short_query_attention(Groups(heads // groups), q, k, v, mask, scaling=16**-0.5)
    assert weights is None and got.shape == (batch, n, heads, 16)
    want = reference_attention(q, k, v, allowed if mask_kind != "none" else None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fast_attention_only_where_it_fits():
    from transformers import Gemma3TextConfig

    assert fits_short_query_attention(tiny_llama().config)
    assert not fits_short_query_attention(Gemma3TextConfig(num_hidden_layers=2))  # sliding-window layers
    model = tiny_llama()
    assert use_fast_attention(model) == register_attention() == model.config._attn_implementation


def test_slot_cache_keeps_what_plain_decoding_builds():
    """Verify a tree on a SlotCache, keep each path: the first slots equal a plain forward's cache."""
    model = tiny_llama()
    runner = Runner(model)
    tree = build_tree(DEFAULT_TREE)
    prompt = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    p = prompt.shape[1]
    tokens = torch.randint(0, 256, (tree.num_nodes,), generator=torch.Generator().manual_seed(2))
    bias = tree_bias(tree, torch.float32, "cpu")
    for row in tree.retrieve:
        nodes = row[row >= 0]
        cache = runner.new_cache(8)  # too small on purpose: it grows
        assert isinstance(cache, SlotCache)
        with torch.no_grad():
            runner.prefill(prompt, cache)
            runner.step(tokens, p + tree.depth, bias, p, cache)
            keep_path(cache, p, nodes)
            ref = new_cache(model)
            forward(model, torch.cat([prompt[0], tokens[nodes]])[None], torch.arange(p + len(nodes))[None], None, ref)
        assert cache.get_seq_length() == p + len(nodes) <= cache.capacity
        for got, want in zip(cache.layers, ref.layers):
            torch.testing.assert_close(got.keys[:, :, : p + len(nodes)], want.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values[:, :, : p + len(nodes)], want.values, atol=1e-5, rtol=1e-5)


def test_slot_cache_refuses_a_forward_that_does_not_fit():
    cache = SlotCache(tiny_llama(), 16)
    with pytest.raises(MedusaError, match="does not fit"):
        cache.reserve(10, 8)
    with pytest.raises(MedusaError, match="does not fit"):
        cache.reserve(0, 4, width=3)
    assert round_width(1) == round_width(256) == 256 and round_width(257) == 512


def generate(model, prompt, heads=None, tree=DEFAULT_TREE, runner=None, ngram=None, max_new_tokens=40):
    out = []
    for chunk in decode(model, torch.tensor([prompt]), heads, build_tree(tree),
                        GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True), SamplingConfig(), {EOS},
                        GenerationStats(), ngram=ngram, runner=runner):
        out += chunk
    return out


def long_prompts(n, length=100):
    """Long enough for the short-query kernel's own path (>= MIN_KEYS keys), with repeats to copy."""
    g = torch.Generator().manual_seed(length)
    out = []
    for _ in range(n):
        half = torch.randint(0, 256, (length // 2,), generator=g).tolist()
        out.append(half + half)
    return out


@pytest.mark.parametrize("ngram", [None, NgramConfig(length=4)])
def test_fast_path_gives_the_reference_tokens(ngram):
    """SDPA + DynamicCache (reference) == short-query kernel + SlotCache, plain and speculative."""
    reference = tiny_llama()
    fast = tiny_llama()
    use_fast_attention(fast)
    heads = random_heads(reference)
    for prompt in long_prompts(3):
        want = generate(reference, prompt, runner=Runner(reference, slots=False))
        assert generate(fast, prompt) == want
        assert generate(fast, prompt, heads=heads, ngram=ngram) == want
        assert generate(reference, prompt, heads=heads, ngram=ngram, runner=Runner(reference, slots=False)) == want


def test_compiled_runner_gives_the_eager_tokens_and_warmup_covers_every_shape():
    """torch.compile'd steps (static shapes) == eager reference, plain and with a tree + n-gram
    branch; after `warmup` a generation compiles nothing new."""
    reference = tiny_llama(max_positions=512)
    fast = tiny_llama(max_positions=512)
    use_fast_attention(fast)
    heads = random_heads(reference)
    tok = byte_tokenizer()
    model = MedusaModel(fast, tok, heads=heads, ngram=NgramConfig(length=4), compile=True)
    assert model.tree_sizes() == sorted({1, 1 + model.ngram.copy_chain, model.tree.num_nodes, build_tree(DEFAULT_TREE, 4).num_nodes})
    spent = model.warmup(300) + model.warmup(300, use_medusa=False)
    assert spent > 0 and {(n, w) for n, w, _ in model.runner.shapes} == {
        (n, w) for n in model.tree_sizes() for w in (256, 512)}
    before = model.runner.compile_s
    for prompt in long_prompts(2, length=220):  # crosses from width 256 to 512
        want = generate(reference, prompt, runner=Runner(reference, slots=False))
        ids = torch.tensor([prompt])
        assert model.generate(ids, max_new_tokens=40, use_medusa=False, ignore_eos=True).token_ids == want
        assert model.generate(ids, max_new_tokens=40, ignore_eos=True).token_ids == want
    assert model.runner.compile_s == before
    # two generations at once: the second gets its own cache, neither disturbs the other
    first, second = long_prompts(2, length=120)
    want = [generate(reference, p, runner=Runner(reference, slots=False), max_new_tokens=20) for p in (first, second)]
    streams = [model.stream(torch.tensor([p]), max_new_tokens=20, use_medusa=False, ignore_eos=True) for p in (first, second)]
    iterators = [iter(s) for s in streams]
    for _ in range(25):
        for it in iterators:
            next(it, None)
    assert [s.token_ids for s in streams] == want and not model.runner.cache.busy
