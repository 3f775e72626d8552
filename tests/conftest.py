"""Tiny models and tokenizers built from configs: no downloads, fp32, seconds."""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest
import torch

from medusa_decoding.heads import MedusaHeads

# Tiny models are overhead-bound: one thread avoids spin-waiting when two test processes share
# this 2-core machine, and does not slow the real model down measurably (see PLATFORM.md).
torch.set_num_threads(1)

VOCAB = 300  # 256 bytes + specials + a few unused ids
EOS, BOS = 256, 257


def tiny_llama(attn: str = "sdpa", max_positions: int = 256, seed: int = 0, vocab: int = VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, eos_token_id=EOS, bos_token_id=BOS,
        pad_token_id=EOS, tie_word_embeddings=False, attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).float().eval().requires_grad_(False)
    with torch.no_grad():  # sharper logits than the default init, so outputs vary with the prompt
        model.lm_head.weight.mul_(8)
    return model


def byte_tokenizer():
    """A byte-level tokenizer: ids 0-255 are bytes, 256 <eos>, 257 <bos>; with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)} | {"<eos>": EOS, "<bos>": BOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
    )
    return fast


def _byte_of(char: str) -> int:
    # GPT-2's byte-to-unicode map: printable bytes map to themselves, the rest to 256+
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def random_heads(model, num_heads: int = 4, seed: int = 0, scale: float = 0.5) -> MedusaHeads:
    """Heads with random (not zero) weights: their guesses are noise, mostly wrong."""
    heads = MedusaHeads.for_base(model, num_heads=num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    return heads.eval()


class Server:
    """uvicorn serving `app` on a free 127.0.0.1 port, in a daemon thread."""

    def __init__(self, app, graceful_timeout_s=1.0):
        from medusa_decoding.server import make_server

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.app = app
        self.server = make_server(app, log_level="warning", graceful_timeout_s=graceful_timeout_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=30, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


def run_cli(capsys, monkeypatch, *args):
    """Run `medusa ARGS` in this process -> (exit code, stdout, stderr)."""
    from medusa_decoding import cli

    monkeypatch.setattr(sys, "argv", ["medusa", *map(str, args)])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def save_tiny(tmp_path_factory, max_positions: int = 256, with_heads: bool = True):
    """A tiny model + byte tokenizer saved as a Hugging Face folder, and random heads for it
    -> (model folder, heads folder or None)."""
    folder = tmp_path_factory.mktemp("tiny")
    model = tiny_llama(max_positions=max_positions)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    if not with_heads:
        return folder, None
    heads = tmp_path_factory.mktemp("heads")
    random_heads(model).save_pretrained(heads)
    return folder, heads


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


def decode(model, input_ids, heads, tree, generation, sampling, eos_token_ids, stats, ngram=None, draft_budget=None,
           backend=None, store=None):
    """One prompt through the engine's decode loop (the one-row case) -> yields each step's new
    tokens. heads: drafter weights or None; tree: Medusa heads' tree (ignored for drafters)."""
    from medusa_decoding import proposers
    from medusa_decoding.engine import Decoder, Method, Request
    from medusa_decoding.verifiers.transformers import EagerBackend, TransformersVerifier

    drafter = None
    if heads is not None:
        drafter = proposers.wrap(heads, model, tree if heads.kind == "medusa" else None, draft_budget)
    method = Method(drafter, ngram, store)
    verifier = TransformersVerifier(backend or EagerBackend(model), feature_layers=method.feature_layers)
    decoder = Decoder(verifier, method, eos_token_ids)
    out = decoder.add(Request(input_ids, generation, sampling, stats=stats))
    yield out.tokens
    while not out.finished:
        (out,) = decoder.step()
        yield out.tokens


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    """Calibrations and compiled graphs of the test session go to a folder of its own, not the user's."""
    import os

    before = os.environ.get("MEDUSA_CACHE")
    os.environ["MEDUSA_CACHE"] = str(tmp_path_factory.mktemp("medusa-cache"))
    yield
    if before is None:
        del os.environ["MEDUSA_CACHE"]
    else:
        os.environ["MEDUSA_CACHE"] = before
