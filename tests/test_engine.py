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
