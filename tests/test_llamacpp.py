"""The llama.cpp bench method on a tiny GGUF written here: plain greedy decoding through
llama-cpp-python, token-identical to our plain decoding of the same fp32 weights."""

import json
from pathlib import Path

import numpy as np
import pytest

from medusa_decoding.config import MedusaError

from conftest import run_cli

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (`make test` installs it; "
                                "pip install 'medusa-decoding[llamacpp]')")


def write_tiny_gguf(path: Path, hidden=64, layers=2, heads=4, kv_heads=2, ff=128, ctx=256, seed=0) -> Path:
    """A random Llama with a byte-level SPM vocabulary (259 tokens), fp32, as a GGUF file."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [6] * 256)  # unknown, control x2, bytes
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    head_dim = hidden // heads

    def random(name, *shape, scale=0.5):
        w.add_tensor(name, (rng.standard_normal(shape) * scale / shape[-1] ** 0.5).astype(np.float32))

    random("token_embd.weight", len(tokens), hidden, scale=hidden ** 0.5)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        random(f"blk.{i}.attn_q.weight", hidden, hidden)
        random(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        random(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        random(f"blk.{i}.attn_output.weight", hidden, hidden)
        random(f"blk.{i}.ffn_gate.weight", ff, hidden)
        random(f"blk.{i}.ffn_up.weight", ff, hidden)
        random(f"blk.{i}.ffn_down.weight", hidden, ff)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    random("output.weight", len(tokens), hidden, scale=4.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_llamacpp_method_in_the_bench_equals_plain_decoding(tiny_gguf, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [t]})
                                 for i, t in enumerate(["count from 7", "abc abc abc"])) + "\n")
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, monkeypatch, "bench", "--model", tiny_gguf, "--prompts", prompts, "--methods",
                                "plain,llama.cpp", "-n", "24", "--dtype", "float32", "--out", out)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["identity"]["llama.cpp"] == {"compared": 2, "differ": 0, "first": None, "reference": "plain"}
    records = [r for r in results["records"] if r["method"] == "llama.cpp"]
    assert all(r["new_tokens"] > 0 and r["tokens_per_s"] > 0 for r in records)
    overall = results["summary"]["overall"]
    assert overall["plain"]["speedup_vs_llama.cpp"]["median"] > 0
    assert "vs llama.cpp" in stdout and "Speed-up vs llama.cpp" in (out / "report.md").read_text()


def test_without_the_amx_repack_path_the_tokens_are_the_same(tiny_gguf):
    from medusa_decoding.bench.llamacpp import LlamaCpp

    ids = [1, 100, 101, 102, 103]
    default, plain_bufts = LlamaCpp(tiny_gguf, n_ctx=128), LlamaCpp(tiny_gguf, n_ctx=128, extra_bufts=False)
    assert default.greedy(ids, 20, {2}) == plain_bufts.greedy(ids, 20, {2}) == default.greedy(ids, 20, {2})
    with pytest.raises(MedusaError, match="no room"):
        default.greedy([3] * default.n_ctx, 4, {2})


def test_llamacpp_absent_is_refused_with_how_to_install(tiny_gguf, tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llama(name, *args, **kw):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    code, _, err = run_cli(capsys, monkeypatch, "bench", "--model", tiny_gguf, "--methods", "plain,llama.cpp",
                           "--suite", "humaneval", "--limit", "1", "--out", tmp_path / "o")
    assert code == 2 and 'pip install "medusa-decoding[llamacpp]"' in err and len(err.strip().splitlines()) == 1
