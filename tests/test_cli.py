"""`medusa generate`: streamed output, one stats line, and exit status 2 with one line per bad input."""

from pathlib import Path

import pytest

from medusa_decoding.config import NgramConfig
from medusa_decoding.heads import MedusaHeads

from conftest import run_cli as medusa, save_tiny, tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder, heads = save_tiny(tmp_path_factory, max_positions=64)
    bad_heads = tmp_path_factory.mktemp("bad_heads")
    MedusaHeads.for_base(tiny_llama(vocab=320)).save_pretrained(bad_heads)
    return folder, heads, bad_heads


def test_generate_streams_text_and_stats(capsys, monkeypatch, model_dir):
    folder, heads, _ = model_dir
    code, out, err = medusa(capsys, monkeypatch, "generate", "-p", "hello", "--model", folder, "--heads", heads,
                            "--no-chat", "-n", "12", "--dtype", "float32", "--device", "cpu")
    assert code == 0 and out.strip()
    assert err.splitlines()[-1].startswith(f"[medusa (16-node tree) + {NgramConfig.length}-token n-gram branch] 12 tokens")
    code, out2, err = medusa(capsys, monkeypatch, "generate", "-p", "hello", "--model", folder, "--no-medusa",
                             "--no-chat", "-n", "12", "--dtype", "float32", "--device", "cpu")
    assert code == 0 and out2 == out and err.splitlines()[-1].startswith("[plain]")
    code, out3, err = medusa(capsys, monkeypatch, "generate", "-p", "hello", "--model", folder, "--no-medusa",
                             "--no-chat", "-n", "12", "--dtype", "float32", "--device", "cpu", "--compile")
    last = err.splitlines()[-1]
    assert code == 0 and out3 == out and "s of it compiling" in last and "(decoding alone: " in last
    from medusa_decoding.datastore import Datastore

    store = Path(folder) / "ds.safetensors"
    Datastore.from_answers([list(b"hello world"), list(b"lo and behold")]).save(store)
    code, out4, err = medusa(capsys, monkeypatch, "generate", "-p", "hello", "--model", folder, "--heads", heads,
                             "--no-chat", "-n", "12", "--dtype", "float32", "--device", "cpu", "--datastore", store)
    assert code == 0 and out4 == out and "n-gram branch (context, then datastore)]" in err.splitlines()[-1]
    store.write_bytes(b"junk")
    code, _, err = medusa(capsys, monkeypatch, "generate", "-p", "hello", "--model", folder, "--datastore", store,
                          "--no-chat", "-n", "12", "--dtype", "float32", "--device", "cpu")
    assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: {store} is not a datastore")


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--model", "/no/such/folder"], "unknown model"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "x" * 80], "context is 64"),
    (["-n", "0"], "max_new_tokens must be >= 1"),
    (["--dtype", "float8"], "unknown dtype 'float8'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-k", "-1"], "top_k must be >= 0"),
    (["--acceptance", "sometimes"], "acceptance"),
    (["--heads", "BAD"], "heads do not fit the base model: heads have hidden_size=64, vocab_size=320"),
    (["--heads", "/no/such/heads"], "no Medusa heads at"),
    (["--tree", "/no/such/tree.json"], "tree file"),
    (["--bogus"], "No such option: --bogus"),
    (["--regex", "(unclosed"], "invalid regex grammar"),
    (["--json-schema", "/no/such/schema.json"], "--json-schema: cannot read"),
    (["--json-schema", "NOTJSON"], "is not JSON"),
    (["--json-schema", "SCHEMA", "--regex", "a"], "give --json-schema or --regex, not both"),
    (["--numerics", "int4"], "unknown numerics 'int4'"),
    (["--numerics", "int8"], "numerics int8 is built for linears on a GGUF's blocks"),  # random weights: no blocks
])
def test_bad_input_exits_2_with_one_line(capsys, monkeypatch, model_dir, args, message):
    folder, heads, bad_heads = model_dir
    base = {"--prompt": "hello", "--model": str(folder), "--heads": str(heads)}
    (Path(folder) / "notjson.txt").write_text("{nope")
    (Path(folder) / "schema.json").write_text('{"type": "object"}')
    named = {"BAD": str(bad_heads), "NOTJSON": str(Path(folder) / "notjson.txt"), "SCHEMA": str(Path(folder) / "schema.json")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = named.get(value, value)
    argv = ["generate", "--no-chat", "--device", "cpu"] + [x for kv in base.items() for x in kv]
    if len(args) % 2:
        argv += args[-1:]
    code, out, err = medusa(capsys, monkeypatch, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_generate_with_a_json_schema_or_a_regex(capsys, monkeypatch, model_dir, tmp_path):
    """--json-schema / --regex: the answer matches, and speculation gives plain decoding's answer."""
    import json
    import re

    folder, heads, _ = model_dir
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    common = ["generate", "-p", "hi", "--model", folder, "--no-chat", "-n", "30", "--dtype", "float32", "--device", "cpu"]
    for constraint, check in ((["--json-schema", tmp_path / "s.json"], lambda t: set(json.loads(t)) == {"ok"}),
                              (["--regex", "[ab]{4}!"], lambda t: re.fullmatch("[ab]{4}!", t))):
        code, out, _ = medusa(capsys, monkeypatch, *common, "--heads", heads, *constraint)
        code2, plain, _ = medusa(capsys, monkeypatch, *common, "--no-medusa", *constraint)
        assert code == code2 == 0 and out == plain and check(out.strip()), out
