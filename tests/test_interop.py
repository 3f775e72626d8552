"""Drafters in other engines' formats: FasterDecoding's and vLLM's Medusa heads (round trips on
tiny heads), what vLLM's loader reads of an export, and the kinds no format holds."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from medusa_decoding import proposers
from medusa_decoding.config import MedusaError
from medusa_decoding.drafters import for_base
from medusa_decoding.heads import MedusaHeads
from medusa_decoding.interop import export_vllm

from conftest import random_heads, run_cli as medusa, save_tiny, tiny_llama


def vllm_reads(folder, x):
    """What vLLM's Medusa module (vllm/model_executor/models/medusa.py, 0.32) computes from an
    export, written from its source: it builds a linear's bias only when the config says
    medusa_fc_bias, one LM head for all with original_lm_head, and its loader skips any weight it
    has no parameter for -> logits [K, ..., V]."""
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    out = []
    for i in range(cfg["num_heads"]):
        y = x
        for j in range(cfg["num_hidden_layers"]):
            bias = state[f"blocks.{i}.layers.{j}.bias"] if cfg.get("medusa_fc_bias", False) else None
            y = y + torch.nn.functional.silu(torch.nn.functional.linear(y, state[f"blocks.{i}.layers.{j}.weight"], bias))
        lm = state["lm_heads.0.weight"] if cfg.get("original_lm_head", False) else state[f"lm_heads.{i}.weight"]
        out.append(y @ lm.T)
    return torch.stack(out)


def test_vllm_export_computes_what_our_heads_compute(model, tmp_path):
    heads = random_heads(model, num_heads=3)
    export_vllm(heads, tmp_path / "vllm", model.lm_head.weight, dtype=torch.float32)
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, 1, 64, 300)
    keys = set(load_file(tmp_path / "vllm" / "model.safetensors"))
    # the shared LM head once, read by every head
    assert keys == {f"blocks.{i}.layers.0.{w}" for i in range(3) for w in ("weight", "bias")} | {"lm_heads.0.weight"}
    hidden = torch.randn(5, 64)
    ours = heads(hidden, model.lm_head)
    torch.testing.assert_close(vllm_reads(tmp_path / "vllm", hidden), ours)
    back = MedusaHeads.from_pretrained(tmp_path / "vllm")
    assert not back.config.shared_lm_head
    torch.testing.assert_close(back(hidden), ours)


def test_vllm_export_refuses_what_its_format_cannot_hold(model, tmp_path):
    mlp = MedusaHeads.for_base(model, num_heads=2, inner_size=32)
    with pytest.raises(MedusaError, match=re.escape("--inner-size 0")):
        export_vllm(mlp, tmp_path / "mlp", model.lm_head.weight)
    with pytest.raises(MedusaError, match="needs the base model"):
        export_vllm(random_heads(model, num_heads=2), tmp_path / "no-lm", None)
    assert not (tmp_path / "mlp").exists()


@pytest.mark.parametrize("kind", ["hydra", "eagle"])
def test_drafters_no_format_holds_are_refused_saying_why(model, tmp_path, kind):
    for_base(kind, model).save_pretrained(tmp_path / kind)
    for fmt in proposers.EXPORT_FORMATS:
        with pytest.raises(MedusaError, match=f"a {kind} drafter cannot be written in the {fmt} format"):
            proposers.export(tmp_path / kind, model, fmt, tmp_path / "out")
    with pytest.raises(MedusaError, match="unknown export format"):
        proposers.export(tmp_path / kind, model, "onnx", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_medusa_heads_export_through_the_registry(model, tmp_path):
    heads = random_heads(model, num_heads=2)
    heads.save_pretrained(tmp_path / "heads")
    assert proposers.export(tmp_path / "heads", model, "vllm", tmp_path / "out", torch.float32) == "medusa"
    x = torch.randn(3, 64)
    torch.testing.assert_close(vllm_reads(tmp_path / "out", x), heads(x, model.lm_head))
    with pytest.raises(MedusaError, match="exports to vllm only"):
        proposers.export(tmp_path / "heads", model, "speculators", tmp_path / "eagle3")


def test_faster_decoding_checkpoint_is_read_trusting_the_weights(model, tmp_path):
    torch.manual_seed(0)
    d, v, k, layers = 64, 300, 5, 2
    state = {}
    for h in range(k):
        for j in range(layers):
            state[f"{h}.{j}.linear.weight"] = torch.randn(d, d) * 0.05
            state[f"{h}.{j}.linear.bias"] = torch.randn(d) * 0.05
        state[f"{h}.{layers}.weight"] = torch.randn(v, d)
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    # the config under-states the heads stored, as FasterDecoding configs often do
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": layers,
                                                      "base_model_name_or_path": "vicuna"}))
    heads = MedusaHeads.from_pretrained(tmp_path)
    assert heads.config.medusa_num_heads == 5 and heads.config.medusa_num_layers == 2
    x = torch.randn(4, d)
    for h in range(k):  # their module: Sequential(ResBlock * layers, Linear(d, v, bias=False))
        y = x
        for j in range(layers):
            y = y + torch.nn.functional.silu(y @ state[f"{h}.{j}.linear.weight"].T + state[f"{h}.{j}.linear.bias"])
        torch.testing.assert_close(heads(x)[h], y @ state[f"{h}.{layers}.weight"].T, atol=1e-4, rtol=1e-4)
    # and on to vLLM and back
    export_vllm(heads, tmp_path / "vllm", None, dtype=torch.float32)
    torch.testing.assert_close(MedusaHeads.from_pretrained(tmp_path / "vllm")(x), heads(x))
    torch.testing.assert_close(vllm_reads(tmp_path / "vllm", x), heads(x))


def test_vllm_folder_without_biases_reads_as_vllm_does(model, tmp_path):
    """An export by another tool (medusa_fc_bias false) still holding bias tensors: vLLM skips them."""
    heads = random_heads(model, num_heads=2)
    export_vllm(heads, tmp_path / "vllm", model.lm_head.weight, dtype=torch.float32)
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(cfg | {"medusa_fc_bias": False}))
    x = torch.randn(3, 64)
    torch.testing.assert_close(MedusaHeads.from_pretrained(tmp_path / "vllm")(x), vllm_reads(tmp_path / "vllm", x))


def test_medusa_export_on_the_command_line(capsys, monkeypatch, tmp_path_factory, tmp_path):
    folder, heads = save_tiny(tmp_path_factory)
    code, _, err = medusa(capsys, monkeypatch, "export", heads, tmp_path / "out", "--model", folder, "--dtype", "float32")
    assert code == 0 and "medusa drafter in the vllm format" in err
    x = torch.randn(2, 64)
    torch.testing.assert_close(vllm_reads(tmp_path / "out", x), MedusaHeads.from_pretrained(heads)(x, tiny_llama().lm_head))
    hydra = tmp_path / "hydra"
    for_base("hydra", tiny_llama()).save_pretrained(hydra)
    for args, message in [((hydra, tmp_path / "h"), "a hydra drafter cannot be written in the vllm format"),
                          ((heads, tmp_path / "x", "--format", "onnx"), "unknown format 'onnx'"),
                          ((heads, tmp_path / "x", "--dtype", "int8"), "--dtype int8"),
                          ((tmp_path / "nope", tmp_path / "x"), "no such folder")]:
        code, _, err = medusa(capsys, monkeypatch, "export", *args, "--model", folder)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and message in lines[0], err
        assert "Traceback" not in err
    assert not (tmp_path / "h").exists() and not (tmp_path / "x").exists()
