"""Heads in FasterDecoding's and vLLM's formats: round trips on tiny heads."""

import json

import torch
from safetensors.torch import load_file

from medusa_decoding.heads import MedusaHeads
from medusa_decoding.interop import export_vllm

from conftest import random_heads


def test_vllm_round_trip_keeps_the_logits(model, tmp_path):
    heads = random_heads(model, num_heads=3)
    export_vllm(heads, tmp_path / "vllm", model.lm_head.weight, dtype=torch.float32)
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, 1, 64, 300)
    keys = set(load_file(tmp_path / "vllm" / "model.safetensors"))
    assert keys == {f"blocks.{i}.layers.0.{w}" for i in range(3) for w in ("weight", "bias")} | {
        f"lm_heads.{i}.weight" for i in range(3)}
    back = MedusaHeads.from_pretrained(tmp_path / "vllm")
    assert not back.config.shared_lm_head
    hidden = torch.randn(5, 64)
    torch.testing.assert_close(back(hidden), heads(hidden, model.lm_head))


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
