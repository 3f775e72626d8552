"""Medusa heads in other projects' formats.

- FasterDecoding/Medusa (read): config.json with medusa_num_heads, medusa_num_layers,
  base_model_name_or_path; weights in medusa_lm_head.pt or .safetensors with keys
  `{head}.{layer}.linear.weight|bias` and `{head}.{num_layers}.weight` (an LM head per head).
  Their configs often under-state the number of heads stored: the weights decide.
- vLLM's Medusa speculator (write and read; vllm/model_executor/models/medusa.py): config.json
  with model_type "medusa", architectures ["MedusaModel"], num_heads, num_hidden_layers,
  hidden_size, vocab_size, truncated_vocab_size, medusa_fc_bias (the blocks' linears have biases;
  vLLM's default is none, and its loader silently drops weights it has no parameter for, so a
  head written without it loses its biases), original_lm_head (every head reads one LM head,
  stored once as `lm_heads.0.weight`); weights `blocks.{i}.layers.{j}.weight|bias` and
  `lm_heads.{i}.weight`. Each block is x + SiLU(W x + b): Medusa's ResBlock, nothing else.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import HeadsConfig, MedusaError

FASTER_DECODING_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def is_faster_decoding(path: Path) -> bool:
    return any((path / name).is_file() for name in FASTER_DECODING_WEIGHTS)


def is_vllm(path: Path) -> bool:
    cfg = path / "config.json"
    return cfg.is_file() and json.loads(cfg.read_text()).get("model_type") == "medusa"


def load_faster_decoding(path: Path) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    """A FasterDecoding Medusa checkpoint -> our heads config and state dict (own LM heads)."""
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    weights = next(path / n for n in FASTER_DECODING_WEIGHTS if (path / n).is_file())
    if weights.suffix == ".safetensors":
        state = load_file(weights)
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    key = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")
    parsed = [(m.group(1), m.group(2), m.group(3), v) for k, v in state.items() if (m := key.match(k))]
    if len(parsed) != len(state):
        raise MedusaError(f"{weights} has keys that are not FasterDecoding Medusa heads")
    num_heads = 1 + max(int(h) for h, *_ in parsed)  # trust the weights, not the config
    num_layers = max(int(layer) for h, layer, kind, _ in parsed if kind == "weight")
    lm = state["0.%d.weight" % num_layers]
    config = HeadsConfig(medusa_num_heads=num_heads, medusa_num_layers=num_layers, hidden_size=lm.shape[1],
                         vocab_size=lm.shape[0], shared_lm_head=False,
                         base_model_name_or_path=raw.get("base_model_name_or_path", ""))
    ours = {}
    for h, layer, kind, value in parsed:
        if kind == "weight":
            ours[f"lm_heads.{h}.weight"] = value
        else:
            ours[f"blocks.{h}.{layer}.{kind}"] = value
    return config, {k: v.float() for k, v in ours.items()}


def load_vllm(path: Path) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    """vLLM's Medusa speculator format -> our heads config and state dict (own LM heads)."""
    raw = json.loads((path / "config.json").read_text())
    state = load_file(path / "model.safetensors")
    heads, layers, d = raw["num_heads"], raw["num_hidden_layers"], raw["hidden_size"]
    config = HeadsConfig(medusa_num_heads=heads, medusa_num_layers=layers, hidden_size=d, vocab_size=raw["vocab_size"],
                         shared_lm_head=False, base_model_name_or_path=raw.get("base_model_name_or_path", ""))
    if raw.get("truncated_vocab_size", raw["vocab_size"]) != raw["vocab_size"]:
        raise MedusaError("vLLM heads with a truncated vocabulary are not supported")
    ours = {}
    for k, v in state.items():
        if m := re.match(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$", k):
            if m.group(3) == "bias" and not raw.get("medusa_fc_bias", False):
                continue  # vLLM would not read it either
            ours[f"blocks.{m.group(1)}.{m.group(2)}.linear.{m.group(3)}"] = v
        elif m := re.match(r"^lm_heads\.(\d+)\.weight$", k):
            ours[f"lm_heads.{m.group(1)}.weight"] = v
        else:
            raise MedusaError(f"unexpected key {k} in {path / 'model.safetensors'}")
    for i in range(heads):
        if raw.get("original_lm_head", False):  # one LM head for every head
            ours[f"lm_heads.{i}.weight"] = ours["lm_heads.0.weight"]
        for j in range(layers):
            ours.setdefault(f"blocks.{i}.{j}.linear.bias", torch.zeros(d))
    return config, {k: v.float() for k, v in ours.items()}


def export_vllm(heads, out: Path, lm_head_weight: torch.Tensor | None, dtype: torch.dtype | None = None) -> None:
    """Write heads in vLLM's Medusa format (dtype: the heads' own when None). Heads that share the
    base's LM head need its weight [V, D]: it is stored once, read by every head (original_lm_head)."""
    cfg = heads.config
    if cfg.medusa_inner_size:
        raise MedusaError(
            f"vLLM's Medusa format holds only residual blocks x + SiLU(W x + b); these heads use MLP blocks "
            f"(inner size {cfg.medusa_inner_size}): train residual heads (medusa train --inner-size 0)")
    if cfg.shared_lm_head and lm_head_weight is None:
        raise MedusaError("these heads share the base LM head: exporting to vLLM needs the base model (--model)")
    state = {}
    for i, head in enumerate(heads.blocks):
        for j, block in enumerate(head):
            state[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight
            state[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias
        if not cfg.shared_lm_head:
            state[f"lm_heads.{i}.weight"] = heads.lm_heads[i].weight
    if cfg.shared_lm_head:
        state["lm_heads.0.weight"] = lm_head_weight
    dtype = dtype or next(heads.parameters()).dtype
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in state.items()},
              out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({
        "model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": cfg.medusa_num_heads,
        "num_hidden_layers": cfg.medusa_num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "truncated_vocab_size": cfg.vocab_size, "medusa_fc_bias": True, "original_lm_head": cfg.shared_lm_head,
        "base_model_name_or_path": cfg.base_model_name_or_path,
    }, indent=2) + "\n")
