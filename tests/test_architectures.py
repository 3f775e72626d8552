""""Any Hugging Face causal LM", checked: tiny random models of several architectures, built
from configs (no downloads), decode token-identically to plain decoding with random drafters
(fp32), alone and three rows at once."""

import pytest
import torch

from medusa_decoding.config import NgramConfig
from medusa_decoding.engine import MedusaModel, Request
from medusa_decoding.config import GenerationConfig

from conftest import byte_tokenizer, random_heads

VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, eos_token_id=256, bos_token_id=257,
             pad_token_id=256, tie_word_embeddings=False)


def build(name):
    import transformers as tf

    if name == "qwen2":
        config = tf.Qwen2Config(**SMALL)
    elif name == "mistral":
        config = tf.MistralConfig(**SMALL, sliding_window=None)
    elif name == "phi3":
        config = tf.Phi3Config(**SMALL)
    elif name == "gemma3":  # sliding-window layers: DynamicCache, one row at a time, inside the window
        config = tf.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=64)
    elif name == "gpt_neox":
        config = tf.GPTNeoXConfig(**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"})
    elif name == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                               eos_token_id=256, bos_token_id=257)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float().eval().requires_grad_(False)
    with torch.no_grad():  # sharper logits than the default init
        model.get_output_embeddings().weight.mul_(8)
    return model


ARCHS = ["qwen2", "mistral", "phi3", "gemma3", "gpt_neox", "gpt2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_equals_plain(arch):
    base, tok = build(arch), byte_tokenizer()
    plain = MedusaModel(base, tok)
    fast = MedusaModel(base, tok, heads=random_heads(base), ngram=NgramConfig(length=4))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (9, 30, 17)]
    prompts[1][15:] = prompts[1][:15]  # something to copy
    want = [plain.generate(p[None], max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    for p, w in zip(prompts, want):
        assert fast.generate(p[None], max_new_tokens=24, ignore_eos=True).token_ids == w
    decoder = fast.decoder(3)
    rows = min(3, decoder.max_batch_size)  # sliding-window models decode one row at a time
    got = {}
    for start in range(0, 3, rows):
        got |= decoder.run([Request(p, GenerationConfig(max_new_tokens=24, ignore_eos=True), id=i)
                            for i, p in list(enumerate(prompts))[start : start + rows]])
    assert [got[i] for i in range(3)] == want
