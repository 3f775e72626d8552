"""The Python API: MedusaModel.generate / .stream on a tiny model with a byte tokenizer."""

import pytest
import torch

from medusa_decoding.config import MedusaError
from medusa_decoding.engine import MedusaModel

from conftest import EOS, random_heads


@pytest.fixture(scope="module")
def medusa(model, tokenizer):
    return MedusaModel(model, tokenizer, heads=random_heads(model))


def test_generate_equals_plain_and_stream_concatenates(medusa):
    for prompt in ["hello", "The quick brown fox", "ünïcödé 日本"]:
        plain = medusa.generate(prompt, max_new_tokens=30, chat=False, use_medusa=False)
        spec = medusa.generate(prompt, max_new_tokens=30, chat=False)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        stream = medusa.stream(prompt, max_new_tokens=30, chat=False)
        assert "".join(stream) == spec.text == stream.text
        assert stream.stats.new_tokens == len(spec.token_ids)


def test_stop_strings_cut_text_and_tokens(medusa, tokenizer):
    full = medusa.generate("abc", max_new_tokens=40, chat=False, ignore_eos=True)
    text = full.text
    stop = text[10:13]
    assert stop and text.find(stop) >= 0
    out = medusa.generate("abc", max_new_tokens=40, chat=False, ignore_eos=True, stop=[stop])
    assert out.text == text[: text.find(stop)]
    assert out.finish_reason == "stop"
    # no token past the one that completed the stop string is kept
    assert len(out.token_ids) < len(full.token_ids)
    assert stop in tokenizer.decode(out.token_ids) and stop not in tokenizer.decode(out.token_ids[:-1])
    streamed = "".join(medusa.stream("abc", max_new_tokens=40, chat=False, ignore_eos=True, stop=[stop]))
    assert streamed == out.text


def test_chat_template_is_applied(medusa, tokenizer):
    ids = medusa.encode("hi", chat=True)[0].tolist()
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                tokenize=True)["input_ids"]
    assert medusa.encode("hi", chat=False)[0].tolist() == list(b"hi")


def test_finish_reasons(model, tokenizer):
    m = MedusaModel(model, tokenizer)
    out = m.generate("x", max_new_tokens=3, chat=False, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    first = m.generate("x", max_new_tokens=20, chat=False, ignore_eos=True).token_ids
    m.eos_token_ids = {first[4]}
    out = m.generate("x", max_new_tokens=20, chat=False)
    assert out.finish_reason == "stop" and out.token_ids[-1] == first[4]
    m.eos_token_ids = {EOS}


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt="   "), "empty"),
    (dict(prompt="hi", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="x" * 300), "context"),
])
def test_bad_inputs(medusa, kwargs, message):
    with pytest.raises(MedusaError, match=message):
        medusa.generate(chat=False, **kwargs)


def test_tree_deeper_than_heads_is_refused(model, tokenizer):
    with pytest.raises(MedusaError, match="3 levels deep but the heads have only 2"):
        MedusaModel(model, tokenizer, heads=random_heads(model, num_heads=2), tree=[(0,), (0, 0), (0, 0, 0)])
    m = MedusaModel(model, tokenizer, heads=random_heads(model, num_heads=2))
    assert m.tree.max_depth == 2  # the default tree is cut to the heads there are


from medusa_decoding.proposers import Drafter  # noqa: E402


class _Oracle(Drafter):
    """A drafter that proposes a known continuation (plain decoding's) as a 4-deep chain, with a
    wrong sibling at depth 1: most steps accept deep paths, so every node's history matters."""

    kind = "oracle"
    PATHS = [(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]

    def __init__(self, target: list[int]):
        from medusa_decoding.tree import build_tree

        self.target, self.tree = target, build_tree(self.PATHS)

    def proposer(self):
        from medusa_decoding.proposers import Proposal, Proposer

        drafter = self

        class OracleProposer(Proposer):
            depth_limit = 4

            def __init__(self):
                self.pos = 0  # index of the root in the target

            def propose(self, root, budget=None):
                target, vocab = drafter.target, 256
                at = lambda k: target[self.pos + k] if self.pos + k < len(target) else 0  # noqa: E731
                tokens = [int(root)] + [at(len(p)) if p[-1] == 0 else (at(1) + 1) % vocab for p in drafter.tree.paths]
                return Proposal(torch.tensor(tokens, device=root.device), drafter.tree.to(root.device))

            def observe(self, hidden, next_tokens, nodes):
                if nodes is not None:
                    self.pos += next_tokens.numel()

        return OracleProposer()

    def tree_sizes(self):
        return {len(self.PATHS) + 1}

    def describe(self):
        return "oracle"


PENALTIES = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(repetition_penalty=1.8),
             dict(logit_bias={ord("e"): 5.0, ord(" "): -100.0}),
             dict(frequency_penalty=-0.5, presence_penalty=0.7, repetition_penalty=1.3, logit_bias={ord("a"): 2.0})]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_penalties_keep_plain_decodings_tokens_on_trees(model, tokenizer, medusa, penalties):
    """Each tree node is penalized with its own history (the output so far and its path): a drafter
    that proposes plain decoding's continuation has deep paths accepted and still gives plain
    decoding's tokens, as random heads do; the penalties do change the output."""
    prompt = "abcabcabc the the the"
    free = medusa.generate(prompt, max_new_tokens=40, chat=False, ignore_eos=True, use_medusa=False).token_ids
    plain = medusa.generate(prompt, max_new_tokens=40, chat=False, ignore_eos=True, use_medusa=False, **penalties)
    assert plain.token_ids != free
    oracle = MedusaModel(model, tokenizer, heads=_Oracle(plain.token_ids), ngram=None)
    spec = oracle.generate(prompt, max_new_tokens=40, chat=False, ignore_eos=True, **penalties)
    assert spec.token_ids == plain.token_ids and spec.stats.mean_accepted_length > 2.5
    heads = medusa.generate(prompt, max_new_tokens=40, chat=False, ignore_eos=True, **penalties)
    assert heads.token_ids == plain.token_ids


def test_penalties_follow_openais_formulas(model, tokenizer):
    """Plain decoding with penalties equals a loop written from the formulas (vLLM's order:
    repetition over prompt and output, then frequency and presence over the output, then bias)."""
    m = MedusaModel(model, tokenizer)
    ids = m.encode("hello hello", chat=False)[0]
    rep, freq, pres, bias = 1.6, 0.8, 0.5, {ord("l"): 3.0}
    got = m.generate(ids[None], max_new_tokens=20, ignore_eos=True, repetition_penalty=rep, frequency_penalty=freq,
                     presence_penalty=pres, logit_bias=bias).token_ids
    seq, out = ids.tolist(), []
    with torch.no_grad():
        for _ in range(20):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
            seen = counts > 0
            in_prompt = torch.zeros_like(seen)
            in_prompt[ids] = True
            logits = torch.where(seen | in_prompt, torch.where(logits > 0, logits / rep, logits * rep), logits)
            logits = logits - freq * counts - pres * seen.float()
            logits[ord("l")] += bias[ord("l")]
            out.append(int(logits.argmax()))
            seq.append(out[-1])
    assert got == out


def test_logprobs_are_the_base_models_and_equal_plain_decodings(model, tokenizer, medusa):
    """Each token's log-probability (and its alternatives) comes from the verification pass: equal
    to plain decoding's and to a teacher-forced forward over the whole answer, to 1e-4."""
    prompt = "The quick brown fox"
    plain = medusa.generate(prompt, max_new_tokens=24, chat=False, ignore_eos=True, use_medusa=False, logprobs=3)
    oracle = MedusaModel(model, tokenizer, heads=_Oracle(plain.token_ids), ngram=None)
    spec = oracle.generate(prompt, max_new_tokens=24, chat=False, ignore_eos=True, logprobs=3)
    assert spec.token_ids == plain.token_ids and spec.stats.mean_accepted_length > 2.5
    assert len(spec.logprobs) == len(plain.logprobs) == 24
    ids = medusa.encode(prompt, chat=False)[0].tolist()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids + plain.token_ids])).logits[0, len(ids) - 1: -1].float(), -1)
    for k, ((lp_s, top_s), (lp_p, top_p), token) in enumerate(zip(spec.logprobs, plain.logprobs, plain.token_ids)):
        assert abs(lp_s - lp_p) < 1e-4 and abs(lp_s - float(ref[k, token])) < 1e-4
        assert [t for t, _ in top_s] == [t for t, _ in top_p] == ref[k].topk(3).indices.tolist()
        assert top_s[0][0] == token  # greedy: the token is the likeliest
    assert medusa.generate(prompt, max_new_tokens=4, chat=False).logprobs is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logprobs=21), "logprobs"),
])
def test_bad_penalties_are_refused(medusa, kwargs, message):
    with pytest.raises(MedusaError, match=message):
        medusa.generate("hi", chat=False, **kwargs)
