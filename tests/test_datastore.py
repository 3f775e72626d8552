"""The datastore (the model's own answers, searched by the context's longest suffix): its lookup
against a brute-force search, its file, and the n-gram branch that asks it where the context has no
match (plain greedy output kept)."""

import numpy as np
import pytest
import torch

from medusa_decoding.config import DEFAULT_TREE, GenerationConfig, MedusaError, NgramConfig, SamplingConfig
from medusa_decoding.datastore import DEPTH, SEPARATOR, Datastore
from medusa_decoding.engine import GenerationStats
from medusa_decoding.tree import build_tree

from conftest import EOS, decode, random_heads


def brute_lookup(tokens: np.ndarray, context: np.ndarray, length: int, max_ngram: int, min_ngram: int):
    """The longest suffix of `context` found in `tokens`, then the most frequent next token among its
    occurrences (the smallest on a tie), narrowed to those, and so on: position by position."""
    for n in range(min(max_ngram, len(context), DEPTH - 1), min_ngram - 1, -1):
        starts = [p for p in range(len(tokens) - n + 1) if (tokens[p:p + n] == context[-n:]).all()]
        if not starts:
            continue
        chain, offset = [], n
        while len(chain) < length and offset < DEPTH:
            nxt = [int(tokens[p + offset]) if p + offset < len(tokens) else SEPARATOR for p in starts]
            values, counts = np.unique(nxt, return_counts=True)
            token = int(values[np.argmax(counts)])
            if token == SEPARATOR:
                break
            chain.append(token)
            starts = [p for p, t in zip(starts, nxt) if t == token]
            offset += 1
        return chain or None
    return None


@pytest.mark.parametrize("seed", range(4))
def test_lookup_is_the_longest_suffix_then_its_most_frequent_continuation(seed):
    rng = np.random.default_rng(seed)
    vocab = 3 + seed  # few distinct tokens: every n-gram recurs, with ties and separators among them
    answers = [rng.integers(0, vocab, int(rng.integers(1, 40))).tolist() for _ in range(30)]
    store = Datastore.from_answers(answers)
    flat = np.concatenate([np.asarray([*a, SEPARATOR]) for a in answers])
    assert store.size == len(flat)
    for _ in range(60):
        context = rng.integers(0, vocab + 1, int(rng.integers(1, 12)))  # token `vocab` never occurs in the store
        length, max_ngram = int(rng.integers(1, 8)), int(rng.integers(1, 9))
        min_ngram = int(rng.integers(1, max_ngram + 1))
        got = store.lookup(context, length, max_ngram, min_ngram)
        want = brute_lookup(flat, context, length, max_ngram, min_ngram)
        assert (None if got is None else got.tolist()) == want, (context, length, max_ngram, min_ngram)


def test_a_datastore_file_loads_the_same_and_bad_input_is_one_clear_error(tmp_path):
    small = Datastore.from_answers([[1, 2, 3, 4, 5], [2, 3, 4, 5, 6]])
    large = Datastore.from_answers([[70000, 1, 70000, 2], [70000, 1]])  # ids past uint16: stored as int32
    for name, store in (("small", small), ("large", large)):
        path = tmp_path / f"{name}.safetensors"
        store.save(path, {"answers": 2})
        again = Datastore.load(path)
        assert np.array_equal(again.tokens, store.tokens) and np.array_equal(again.order, store.order)
    # [2, 3] occurs twice, followed by 4 5 both times, then by the end of an answer or by 6: a tie, the end first
    assert small.lookup(np.array([9, 2, 3]), 4, 4, 1).tolist() == [4, 5]
    assert large.lookup(np.array([70000]), 4, 4, 1).tolist() == [1]  # then 70000 once, the end once: the end
    assert large.lookup(np.array([1, 70000]), 4, 4, 1).tolist() == [2]
    assert small.lookup(np.array([6]), 4, 4, 1) is None  # 6 ends an answer: nothing follows it
    (tmp_path / "junk.safetensors").write_bytes(b"not a datastore")
    for bad in (tmp_path / "missing.safetensors", tmp_path / "junk.safetensors"):
        with pytest.raises(MedusaError):
            Datastore.load(bad)
    for tokens in ([], [1, -2], [[1, 2]]):
        with pytest.raises(MedusaError):
            Datastore(np.asarray(tokens))
    with pytest.raises(MedusaError):
        Datastore.from_answers([[], []])
    with pytest.raises(MedusaError):
        NgramConfig(store_min_ngram=3, store_max_ngram=2)


def prompts(n, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(model, prompt, heads, ngram, store, max_new_tokens=40):
    """One prompt through the engine (conftest.decode) -> (new tokens, stats)."""
    stats, tokens = GenerationStats(), []
    for chunk in decode(model, torch.tensor([prompt]), heads, build_tree(DEFAULT_TREE),
                        GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True), SamplingConfig(), {EOS},
                        stats, ngram=ngram, store=store):
        tokens += chunk
    return tokens, stats


@pytest.mark.parametrize("with_heads", [False, True])
def test_chains_from_the_datastore_keep_plain_output_and_are_accepted(model, with_heads):
    """A datastore of the model's own answers to other prompts that share their endings: where the
    context has no match, the chain comes from the datastore, is accepted, and the output stays plain
    greedy (with random heads beside it too); the same decoding without the datastore accepts less."""
    ngram = NgramConfig(length=4, min_ngram=3, max_ngram=3, copy_run=0)  # the context rarely matches 3 tokens
    heads = random_heads(model) if with_heads else None
    cases = [p + [65, 66, 67, 68] for p in prompts(6, seed=4)]  # a shared ending: the answers start alike
    answers = [run(model, p, None, None, None)[0] for p in cases]
    store = Datastore.from_answers(answers[:3])  # the answers to the first three
    unseen = [p[:-4] + [7] + p[-4:] for p in cases[3:]] + cases[:3]
    unseen = unseen[2:5] if with_heads else unseen  # random heads make each step slower
    accepted = {True: 0, False: 0}
    for p in unseen:
        plain, _ = run(model, p, None, None, None)
        for with_store in (True, False):
            got, stats = run(model, p, heads, ngram, store if with_store else None)
            assert got == plain
            accepted[with_store] += stats.accepted_by.get("ngram", 0)
    assert accepted[True] > accepted[False] + 10


def test_the_cli_writes_a_datastore_and_generate_and_bench_refuse_what_cannot_run(tmp_path, capsys, monkeypatch):
    from medusa_decoding.bench import BenchConfig

    from conftest import run_cli

    code, _, err = run_cli(capsys, monkeypatch, "datastore", "--data", tmp_path / "nothing", "--out", tmp_path / "d")
    assert code == 2 and "no distillation folder or packed file" in err
    code, _, err = run_cli(capsys, monkeypatch, "generate", "-p", "hi", "--ngram", "0", "--datastore", tmp_path / "d")
    assert code == 2 and "--datastore feeds the n-gram branch" in err
    with pytest.raises(MedusaError, match="no such file"):
        BenchConfig(methods="plain,hydra+ngram", datastore=str(tmp_path / "missing.safetensors"))
