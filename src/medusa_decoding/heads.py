"""Medusa heads: K residual MLP heads on the base model's last hidden state.

Glossary: B batch, T time, K heads, D hidden size, V vocabulary.
Head k (k = 1..K) at position t guesses token t+k+1; the base LM head at t gives token t+1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import CONFIG_NAME, WEIGHTS_NAME, HeadsConfig, MedusaError



def check_fits(base_model, hidden_size: int, vocab_size: int, what: str) -> None:
    """Raise MedusaError naming both shapes when a drafter (`what`) was made for another base."""
    cfg = base_model.config.get_text_config()
    if (hidden_size, vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise MedusaError(
            f"{what} do not fit the base model: {what} have hidden_size={hidden_size}, vocab_size={vocab_size}; "
            f"base has hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}"
        )


class ResBlock(nn.Module):
    """x + SiLU(W x + b). W and b start at zero: SiLU(0) = 0, so a fresh block is the identity
    and an untrained head predicts what the base model predicts (one step late)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MLPBlock(nn.Module):
    """x + W2 SiLU(W1 x + b1) + b2, W2 and b2 zero-initialised: a fresh block is the identity.
    Unlike ResBlock it can move a coordinate down as far as up (SiLU's floor is -0.28)."""

    def __init__(self, hidden_size: int, inner_size: int):
        super().__init__()
        self.up = nn.Linear(hidden_size, inner_size)
        self.down = nn.Linear(inner_size, hidden_size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.silu(self.up(x)))


class MedusaHeads(nn.Module):
    """K heads, each `medusa_num_layers` ResBlocks (own weights) then an LM head.

    With `shared_lm_head` the base model's output layer is used (passed to `forward`, never
    stored here), so a checkpoint holds only the blocks: 4 heads on SmolLM2 are ~5 MB in fp32.
    """

    def __init__(self, config: HeadsConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        # A fresh ResBlock per layer per head: `[ResBlock(d)] * n` would share one module.
        inner = config.medusa_inner_size

        def block() -> nn.Module:
            return MLPBlock(d, inner) if inner else ResBlock(d)

        self.blocks = nn.ModuleList(
            nn.Sequential(*[block() for _ in range(config.medusa_num_layers)]) for _ in range(config.medusa_num_heads)
        )
        self.lm_heads = (
            None
            if config.shared_lm_head
            else nn.ModuleList(nn.Linear(d, config.vocab_size, bias=False) for _ in range(config.medusa_num_heads))
        )

    kind = "medusa"  # proposers.REGISTRY's key

    @property
    def num_heads(self) -> int:
        return self.config.medusa_num_heads

    @classmethod
    def for_base(cls, base_model, num_heads: int = 4, num_layers: int = 1, shared_lm_head: bool = True,
                 name_or_path: str = "", inner_size: int = 0) -> MedusaHeads:
        """Fresh heads sized for `base_model`, on its device and dtype; own LM heads copy the base's."""
        cfg = base_model.config.get_text_config()
        heads = cls(HeadsConfig(
            medusa_num_heads=num_heads, medusa_num_layers=num_layers, hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size, base_model_name_or_path=name_or_path or cfg.name_or_path,
            shared_lm_head=shared_lm_head, medusa_inner_size=inner_size,
        ))
        lm_head = base_model.get_output_embeddings()
        if heads.lm_heads is not None:
            for head in heads.lm_heads:
                head.weight.data.copy_(lm_head.weight.data)
        return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)

    def features(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [..., D] -> per-head features [K, ..., D] (before the LM head); only the
        first num_heads heads when given (a shallow tree needs no more)."""
        return torch.stack([block(hidden) for block in self.blocks[:num_heads]])

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None, with_features: bool = False,
                vocab_rows: int | None = None, num_heads: int | None = None):
        """hidden [..., T, D] -> logits [K, ..., T, V] (and features [K, ..., T, D] when
        with_features). `lm_head` is the base model's output layer, needed when it is shared.
        vocab_rows: project only the first rows of T (training pays the V-wide projection
        on a subset of positions). num_heads: run only the first heads (K = num_heads)."""
        feats = self.features(hidden, num_heads)
        rows = feats if vocab_rows is None else feats[..., :vocab_rows, :]
        if self.lm_heads is None:
            if lm_head is None:
                raise ValueError("these heads share the base LM head: pass lm_head=base.get_output_embeddings()")
            logits = lm_head(rows)
        else:
            logits = torch.stack([head(f) for head, f in zip(self.lm_heads, rows)])
        return (feats, logits) if with_features else logits

    def check_fits(self, base_model) -> None:
        """Refuse heads trained for another hidden size or vocabulary, naming both."""
        check_fits(base_model, self.config.hidden_size, self.config.vocab_size, "heads")

    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write config.json and model.safetensors; dtype (e.g. bfloat16) halves the file."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path / CONFIG_NAME)
        state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, path / WEIGHTS_NAME, metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> MedusaHeads:
        """Load heads saved by save_pretrained, or a FasterDecoding Medusa or vLLM Medusa checkpoint."""
        from . import interop  # format readers: config and state dicts, no heads (one-way import)

        path = Path(path).expanduser()
        if path.is_dir() and interop.is_faster_decoding(path):
            config, state = interop.load_faster_decoding(path)
        elif path.is_dir() and interop.is_vllm(path):
            config, state = interop.load_vllm(path)
        else:
            if not (path / CONFIG_NAME).is_file():
                raise MedusaError(f"no Medusa heads at {path}: expected {CONFIG_NAME} and {WEIGHTS_NAME}")
            raw = json.loads((path / CONFIG_NAME).read_text())
            if not (path / WEIGHTS_NAME).is_file():
                raise MedusaError(f"{path} has {CONFIG_NAME} but no {WEIGHTS_NAME}")
            if "medusa_num_heads" not in raw:
                raise MedusaError(f"{path / CONFIG_NAME} is not a Medusa heads config (no medusa_num_heads)")
            config, state = HeadsConfig.from_dict(raw), load_file(path / WEIGHTS_NAME)
        heads = cls(config)
        missing, unexpected = heads.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise MedusaError(
                f"weights at {path} do not match its config: "
                f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
            )
        return heads.to(device=device, dtype=dtype).eval()
