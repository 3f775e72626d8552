"""Speculative greedy decoding == plain greedy decoding, token for token (fp32)."""

import pytest
import torch
from torch import nn

from medusa_decoding.cache import keep_path, new_cache
from medusa_decoding.config import DEFAULT_TREE, GenerationConfig, NgramConfig, SamplingConfig
from medusa_decoding.engine import GenerationStats
from medusa_decoding.tree import tree_bias
from medusa_decoding.verifiers.transformers import forward as batched_forward
from medusa_decoding.tree import build_tree

from conftest import EOS, decode, random_heads, tiny_llama

TREES = {
    "default": DEFAULT_TREE,
    "chain": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "wide": [(0,), (1,), (2,), (3,), (0, 0), (1, 0)],
}


def run(model, prompt, heads, tree=DEFAULT_TREE, max_new_tokens=40, eos=(EOS,), ignore_eos=False):
    stats = GenerationStats()
    out = []
    for chunk in decode(model, torch.tensor([prompt]), heads, build_tree(tree),
                        GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos),
                        SamplingConfig(), set(eos), stats):
        out += chunk
    return out, stats


class OracleHeads(nn.Module):
    """Test heads that often guess right: they find the position of the hidden state in a known
    plain-greedy run and put the true future token first with probability `hit`, so
    verification accepts paths of every length and rejects at every depth."""

    def __init__(self, model, prompt, continuation, num_heads=4, hit=0.7, seed=0):
        super().__init__()
        seq = torch.tensor([prompt + continuation])
        with torch.no_grad():
            self.hidden = model.get_decoder()(input_ids=seq).last_hidden_state[0]  # [T, D]
        self.seq, self.num_heads, self.hit, self.vocab = seq[0], num_heads, hit, model.config.vocab_size
        self.g = torch.Generator().manual_seed(seed)

    kind = "medusa"

    def check_fits(self, base_model):
        pass

    def forward(self, hidden, lm_head=None, num_heads=None):  # hidden [D] -> logits [K, V]
        t = int((self.hidden - hidden).norm(dim=-1).argmin())
        logits = torch.randn(self.num_heads, self.vocab, generator=self.g)
        for k in range(self.num_heads):
            if t + k + 2 < len(self.seq) and torch.rand(1, generator=self.g) < self.hit:
                logits[k, self.seq[t + k + 2]] = 100.0
        return logits


def forward(model, ids, positions, mask, cache):
    """One row: ids [1, n] -> logits [n, V], hidden [n, D]."""
    logits, hidden = batched_forward(model, ids, positions, mask, cache)
    return logits[0], hidden[0]


def prompts(n, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("tree", TREES)
def test_random_heads_give_plain_output(model, tree):
    heads = random_heads(model)
    for prompt in prompts(8):
        plain, _ = run(model, prompt, None)
        spec, stats = run(model, prompt, heads, TREES[tree])
        assert spec == plain
        assert stats.steps <= len(plain)


@pytest.mark.parametrize("tree", TREES)
def test_good_heads_give_plain_output_and_accept_more(model, tree):
    accepted = []
    for i, prompt in enumerate(prompts(6, seed=1)):
        plain, _ = run(model, prompt, None, max_new_tokens=60, ignore_eos=True)
        oracle = OracleHeads(model, prompt, plain, seed=i)
        spec, stats = run(model, prompt, oracle, TREES[tree], max_new_tokens=60, ignore_eos=True)
        assert spec == plain
        assert sum(stats.accepted_lengths) + 1 >= len(spec)  # the last step may be cut by max_new_tokens
        accepted.append(stats.mean_accepted_length)
    assert sum(accepted) / len(accepted) > 1.5  # the oracle is right often: paths are accepted


def test_eos_and_max_new_tokens_edges(model):
    prompt = prompts(1, seed=3)[0]
    plain, _ = run(model, prompt, None, max_new_tokens=30, ignore_eos=True)
    oracle = OracleHeads(model, prompt, plain, hit=0.9)
    # pick a token from the middle of the plain output as EOS: both stop right after it
    eos = plain[7]
    cut = plain[: plain.index(eos) + 1]
    spec, _ = run(model, prompt, oracle, eos=(eos,))
    assert spec == cut == run(model, prompt, None, eos=(eos,))[0]
    for n in (1, 2, 3, 5, 17):
        want = run(model, prompt, None, max_new_tokens=n, ignore_eos=True)[0]
        got = run(model, prompt, OracleHeads(model, prompt, plain, hit=0.9), max_new_tokens=n, ignore_eos=True)[0]
        assert got == want and len(got) == n


def test_context_limit_is_respected():
    small = tiny_llama(max_positions=40)
    heads = random_heads(small)
    prompt = prompts(1, seed=4)[0][:20]
    plain, _ = run(small, prompt, None, max_new_tokens=100, ignore_eos=True)
    assert len(prompt) + len(plain) == 40
    oracle = OracleHeads(small, prompt, plain, hit=1.0)
    spec, _ = run(small, prompt, oracle, max_new_tokens=100, ignore_eos=True)
    assert spec == plain
    assert run(small, prompt, heads, max_new_tokens=100, ignore_eos=True)[0] == plain


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_mask_works_with_both_attention_kernels(attn):
    """A tree verify forward gives, at each node, the logits of a plain forward of its path."""
    model = tiny_llama(attn=attn)
    tree = build_tree(DEFAULT_TREE)
    prompt = torch.tensor([prompts(1, seed=5)[0]])
    tokens = torch.randint(0, 256, (tree.num_nodes,), generator=torch.Generator().manual_seed(0))
    cache = new_cache(model)
    p = prompt.shape[1]
    with torch.no_grad():
        forward(model, prompt, torch.arange(p)[None], None, cache)
        mask = torch.cat([torch.zeros(tree.num_nodes, p), tree_bias(tree, torch.float32, "cpu")], 1)[None, None]
        logits, _ = forward(model, tokens[None], (p + tree.depth)[None], mask, cache)
        for row in tree.retrieve:
            path = row[row >= 0]
            ref = model(torch.cat([prompt[0], tokens[path]])[None]).logits[0, p:]
            torch.testing.assert_close(logits[path], ref, atol=1e-4, rtol=1e-4)


def test_kept_cache_equals_plain_cache(model):
    """After keep_path, every layer's keys and values equal those of a plain forward over the
    prompt and the kept path's tokens."""
    tree = build_tree(DEFAULT_TREE)
    prompt = torch.tensor([prompts(1, seed=6)[0]])
    p = prompt.shape[1]
    tokens = torch.randint(0, 256, (tree.num_nodes,), generator=torch.Generator().manual_seed(1))
    for row in tree.retrieve:
        for end in range(1, int((row >= 0).sum()) + 1):
            nodes = row[:end]
            cache = new_cache(model)
            with torch.no_grad():
                forward(model, prompt, torch.arange(p)[None], None, cache)
                mask = torch.cat([torch.zeros(tree.num_nodes, p), tree_bias(tree, torch.float32, "cpu")], 1)
                forward(model, tokens[None], (p + tree.depth)[None], mask[None, None], cache)
                keep_path(cache, p, nodes)
                ref = new_cache(model)
                forward(model, torch.cat([prompt[0], tokens[nodes]])[None], torch.arange(p + end)[None], None, ref)
            for got, want in zip(cache.layers, ref.layers):
                torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


def test_stats_count_steps_and_depths(model):
    prompt = prompts(1, seed=7)[0]
    plain, pstats = run(model, prompt, None, max_new_tokens=25, ignore_eos=True)
    assert pstats.steps == 24 and pstats.mean_accepted_length == 1.0
    _, stats = run(model, prompt, OracleHeads(model, prompt, plain, hit=1.0), TREES["chain"],
                   max_new_tokens=25, ignore_eos=True)
    assert stats.mean_accepted_length == pytest.approx(5.0, abs=0.6)  # 4 candidates + bonus
    assert stats.acceptance_per_depth[0] == 1.0
    assert stats.new_tokens == 25


@pytest.mark.parametrize("with_heads", [False, True])
def test_ngram_branch_keeps_plain_output_and_copies(model, with_heads):
    """With an n-gram branch (alone = prompt lookup, or beside the heads) the output is still
    plain greedy; on a prompt that the model goes on to repeat, the branch is accepted."""
    from medusa_decoding.config import NgramConfig

    heads = random_heads(model) if with_heads else None
    copied = 0
    for prompt in prompts(6, seed=8):
        plain, _ = run(model, prompt, None, max_new_tokens=50, ignore_eos=True)
        # a prompt that holds the answer: the model's own continuation, then a recap cue
        for p in (prompt, prompt + plain[:30] + prompt):
            want, _ = run(model, p, None, max_new_tokens=50, ignore_eos=True)
            stats = GenerationStats()
            got = []
            for chunk in decode(model, torch.tensor([p]), heads, build_tree(DEFAULT_TREE),
                                GenerationConfig(max_new_tokens=50, ignore_eos=True), SamplingConfig(), {EOS},
                                stats, ngram=NgramConfig(length=6)):
                got += chunk
            assert got == want
            copied += stats.accepted_by.get("ngram", 0)
    assert copied > 20


@pytest.mark.parametrize("with_heads", [False, True])
def test_the_default_chain_accepted_whole_starts_copy_steps(model, with_heads):
    """The default chain is short (it rides on every step) and accepted whole it starts copy steps
    (a long chain alone): on prompts the model goes on to repeat, copy steps come, the output stays
    plain greedy. A copy_run above the chain's length would never start one."""
    cfg = NgramConfig()
    assert 0 < cfg.copy_run <= cfg.length < cfg.copy_chain
    heads = random_heads(model) if with_heads else None
    copy_steps = 0
    for prompt in prompts(4, seed=8):
        plain, _ = run(model, prompt, None, max_new_tokens=50, ignore_eos=True)
        p = prompt + plain[:30] + prompt
        want, _ = run(model, p, None, max_new_tokens=50, ignore_eos=True)
        stats, got = GenerationStats(), []
        for chunk in decode(model, torch.tensor([p]), heads, build_tree(DEFAULT_TREE),
                            GenerationConfig(max_new_tokens=50, ignore_eos=True), SamplingConfig(), {EOS}, stats,
                            ngram=cfg):
            got += chunk
        assert got == want
        copy_steps += stats.counters.get("copy_steps", 0)
    assert copy_steps > 0


def test_ngram_lookup_finds_the_latest_match():
    import numpy as np

    from medusa_decoding.proposers.ngram import agreed, lookup, padded

    cfg = NgramConfig(length=3, max_ngram=2)
    ctx = np.array([1, 2, 3, 9, 1, 2, 4, 5, 6, 1, 2])
    assert lookup(ctx, cfg, 3).tolist() == [4, 5, 6]  # the latest "1 2" is followed by 4 5 6
    assert lookup(np.array([7, 8, 9]), cfg, 3) is None
    assert lookup(np.array([5, 6, 7, 5]), cfg, 3).tolist() == [6, 7, 5]  # falls back to 1-grams
    assert padded(np.array([4]), 3, "cpu").tolist() == [4, 4, 4]
    # what greedy acceptance keeps of a chain: its leading tokens the context goes on with
    assert agreed(np.array([4, 5, 7]), np.array([4, 5, 6, 1])) == 2
    assert agreed(np.array([4, 5]), np.array([4, 5, 6])) == 2 and agreed(np.array([4, 5, 6]), np.array([4])) == 1
    assert agreed(np.array([3, 5]), np.array([4, 5])) == 0


@pytest.mark.parametrize("ngram_length", [0, 5])
def test_dynamic_tree_gives_plain_output(model, ngram_length):
    from medusa_decoding.config import NgramConfig
    from medusa_decoding.tree import dynamic_tree

    dyn = dynamic_tree(width=4, depth=3, budget=12)
    accepted = []
    for i, prompt in enumerate(prompts(5, seed=9)):
        plain, _ = run(model, prompt, None, max_new_tokens=40, ignore_eos=True)
        for heads in (random_heads(model, seed=i), OracleHeads(model, prompt, plain, seed=i)):
            stats = GenerationStats()
            got = []
            for chunk in decode(model, torch.tensor([prompt]), heads, dyn,
                                GenerationConfig(max_new_tokens=40, ignore_eos=True), SamplingConfig(), {EOS}, stats,
                                ngram=NgramConfig(length=ngram_length) if ngram_length else None):
                got += chunk
            assert got == plain
        accepted.append(stats.mean_accepted_length)
    assert sum(accepted) / len(accepted) > 1.5  # the oracle's paths are found and accepted
