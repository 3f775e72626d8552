"""Path-aware drafters: each tree node's children are guessed from that node's own branch.

Glossary: T time, N tree nodes (root first), W frontier width (nodes expanded per depth),
K heads, D hidden size, V vocabulary, V' the drafter's shortlist of V.

Medusa heads guess every depth from h_t alone. These two see the branch they extend:
  - HydraHeads (`hydra`): head k reads h_t (or low, middle and last layers fused) and the
    embeddings of the branch's tokens x_{t+1} (the root) .. x_{t+k}, and guesses x_{t+k+1}: an
    MLP per head, no recurrence.
  - EagleLayer (`eagle`): one decoder layer of the base's own architecture (fresh weights)
    reads fc([f_t ; embed(x_{t+1})]) with causal attention over the sequence and predicts the
    next feature f_{t+1}; deeper nodes feed the drafter its own predicted features. It keeps a
    KV cache of its own, as the base does.
Both end in the base's frozen LM head, restricted to a shortlist of V' frequent tokens (kept
in the checkpoint): a drafter never proposes a token outside it, which costs acceptance only,
never exactness (the base verifies every candidate), and makes each depth ~V/V' cheaper.

Both draft (proposers/hydra.py, proposers/eagle.py) with EAGLE-2's rule (`grow_tree`): expand the W best nodes of each depth by their
cumulative log-probability, then keep the budget - 1 best nodes of all depths. A child never
scores above its parent, so the kept nodes form a tree.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .config import CONFIG_NAME, DEFAULT_MODEL, WEIGHTS_NAME, DrafterKind, JsonConfig, MedusaError
from .heads import check_fits
from .kernels.blocks import Blocks, block_linear, blocks_or_none
from .kernels.packed import packed_linear, packed_or_none

DRAFTERS = (DrafterKind.HYDRA.value, DrafterKind.EAGLE.value)  # the kinds this file builds


SHORTLIST_SIZE = 8192  # V': a drafter's tokens, the most frequent of its training answers


@dataclass
class DrafterConfig(JsonConfig):
    """A path-aware drafter's shape and its drafting defaults; saved as config.json."""

    drafter: str = "eagle"  # "hydra" or "eagle"
    hidden_size: int = 576  # D, must equal the base's
    vocab_size: int = 49152  # V, must equal the base's
    base_model_name_or_path: str = DEFAULT_MODEL
    shortlist_size: int = SHORTLIST_SIZE  # V': tokens the drafter may propose (ids stored with the weights)
    num_heads: int = 4  # hydra: K heads, so at most K depths
    inner_size: int = 1152  # hydra: the MLP's inner width
    # drafting defaults (EAGLE-2's rule): depths drafted, nodes expanded per depth, nodes kept
    draft_depth: int = 4
    draft_width: int = 4
    draft_budget: int = 16  # root included
    # the base hidden states it fuses (EAGLE-3; indices into the decoder's hidden states, 0 the
    # embeddings, L the last layer's after the final norm, which must come last). None: the last alone
    feature_layers: list[int] | None = None

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise MedusaError(f"unknown drafter {self.drafter!r}; use one of {', '.join(DRAFTERS)} (or medusa heads)")
        if self.feature_layers is not None and len(self.feature_layers) < 2:
            raise MedusaError("feature_layers (fused features) need at least two layers")
        if self.draft_depth < 1 or self.draft_width < 1 or self.draft_budget < 2:
            raise MedusaError("drafting needs depth >= 1, width >= 1 and a budget of at least 2 nodes")


@dataclass
class DraftTree:
    """One step's drafted tree, the root first, parents before children."""

    tokens: torch.Tensor  # [N] long
    parent: torch.Tensor  # [N] long, -1 for the root
    depth: torch.Tensor  # [N] long, 0 for the root
    score: torch.Tensor  # [N] float: the drafter's cumulative log-probability of each node's branch
    max_depth: int


def fused_layers(depth: int) -> list[int]:
    """EAGLE-3's low, middle and top features of a base of `depth` layers: hidden states 2, depth // 2
    and depth (the last layer's, after the final norm: what the LM head reads); fewer on a shallow base."""
    return sorted({min(2, depth - 1), max(depth // 2, 1), depth})


def keep_order(score: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """What grow_tree keeps the most of: a node's cumulative log-prob, ties going to the shallower
    node (calibrate's acceptance by budget ranks nodes by the same key)."""
    return score - 1e-4 * depth.float()


def grow_tree(first: torch.Tensor, expand, width: int, depth: int, budget: int) -> tuple[torch.Tensor, ...]:
    """EAGLE-2's rule on any drafter.

    first [V'] log-probs of the depth-1 tokens; expand(frontier [W] node ids, tokens [n], parent
    [n]) -> log-probs [W, V'] of the frontier's children (node ids index the drafted nodes, 0 is
    the root). Returns (tokens [N] shortlist indices, parent [N], depth [N], score [N]) of the
    kept nodes, root first and parents before children; the root's token is a placeholder (0).

    Only what the budget can keep is drafted. A node at depth d is kept only with its d - 1
    ancestors and every node that outranks it (a higher cumulative log-prob at its depth or
    above: its higher-ranked siblings, the frontier nodes ranked above its parent), so at depth d
    only the budget - d best frontier nodes are expanded, each for its budget - d best children
    (at budget 4: 2 and 1 nodes expanded at depths 2 and 3, not W each); the tree is the same.
    """
    device = first.device
    score, top = first.float().topk(min(width, budget - 1, first.shape[-1]))  # [W]
    tokens = [first.new_zeros(1, dtype=torch.long), top]
    parents = [torch.full((1,), -1, dtype=torch.long, device=device), torch.zeros_like(top)]
    scores = [torch.zeros(1, device=device), score]
    depths = [torch.zeros(1, dtype=torch.long, device=device), torch.ones_like(top)]
    frontier, frontier_score, n = torch.arange(1, 1 + len(top), device=device), score, 1 + len(top)
    for d in range(2, min(depth, budget - 1) + 1):
        reach = budget - d  # the most frontier nodes, and children of each, that can be kept
        frontier, frontier_score = frontier[:reach], frontier_score[:reach]  # ranked best first
        log_probs = expand(frontier, torch.cat(tokens), torch.cat(parents))  # [W, V']
        child_score, child = log_probs.float().topk(min(width, reach, log_probs.shape[-1]), dim=-1)  # [W, W] each
        cum = (frontier_score[:, None] + child_score).reshape(-1)  # [W * W]
        tokens.append(child.reshape(-1))
        parents.append(frontier[:, None].expand_as(child).reshape(-1))
        scores.append(cum)
        depths.append(torch.full_like(cum, d, dtype=torch.long))
        best = cum.topk(min(width, cum.numel())).indices  # the next frontier
        frontier, frontier_score = n + best, cum[best]
        n += cum.numel()
    score_all, depth_all = torch.cat(scores), torch.cat(depths)
    ranked = keep_order(score_all[1:], depth_all[1:])
    keep = ranked.topk(min(budget - 1, n - 1)).indices.sort().values + 1  # parents first
    nodes = torch.cat([keep.new_zeros(1), keep])  # [N]
    remap = torch.full((n,), -1, dtype=torch.long, device=device)
    remap[nodes] = torch.arange(len(nodes), device=device)
    parent_all = torch.cat(parents)
    parent = torch.where(parent_all[nodes] >= 0, remap[parent_all[nodes].clamp(min=0)], -1)
    return torch.cat(tokens)[nodes], parent, depth_all[nodes], score_all[nodes]


class Shortlist:
    """The base LM head restricted to the drafter's V' tokens: feature [..., D] -> log-probs [..., V']."""

    def __init__(self, lm_head: nn.Module, vocab: torch.Tensor):
        self.vocab = vocab.to(lm_head.weight.device)  # [V'] token ids
        self.weight = lm_head.weight[self.vocab]  # [V', D]
        self.packed: torch.Tensor | None = None  # the weight prepacked for oneDNN (pack), or None
        self.blocks: Blocks | None = None  # the weight on its GGUF blocks (pack), or None

    def pack(self) -> bool:
        """Project on the weight prepacked for oneDNN (bf16/fp16 on CPU, kernels/packed.py) or on
        its GGUF blocks (fp32 on CPU, kernels/blocks.py), where that is exact here -> either."""
        self.packed = packed_or_none(self.weight)
        self.blocks = blocks_or_none(self.weight) if self.packed is None else None
        return self.packed is not None or self.blocks is not None

    def log_probs(self, features: torch.Tensor) -> torch.Tensor:
        x = features.to(self.weight.dtype)
        if self.packed is not None:
            logits = packed_linear(x, self.packed, None)
        elif self.blocks is not None:
            logits = block_linear(x, self.blocks, None)
        else:
            logits = F.linear(x, self.weight)
        return torch.log_softmax(logits.float(), dim=-1)


class _Drafter(nn.Module):
    """What both drafters share: config, shortlist ids, checks, saving."""

    config: DrafterConfig
    max_depth: int | None = None  # the deepest level it can draft (None: as deep as asked)

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        # the token ids the drafter may propose; filled by training (most frequent labels)
        self.register_buffer("vocab", torch.arange(config.shortlist_size, dtype=torch.long))
        # fused features (EAGLE-3): each layer RMS-normalised first (SmolLM2's middle layers run at
        # 3-10x the last one's scale), then k D -> D
        d, layers = config.hidden_size, config.feature_layers or []
        self.fuse_norms = nn.ModuleList(nn.RMSNorm(d, eps=1e-6) for _ in layers) if layers else None
        self.fuse = nn.Linear(len(layers) * d, d) if layers else None

    def from_base(self, features: torch.Tensor) -> torch.Tensor:
        """The base's hidden states at verified positions [..., k D] (k = len(feature_layers), 1
        without) -> the drafter's input feature [..., D]: fuse([norm_1(h_1) ; ... ; norm_k(h_k)])."""
        if self.fuse is None:
            return features
        parts = features.chunk(len(self.fuse_norms), dim=-1)
        return self.fuse(torch.cat([norm(p) for norm, p in zip(self.fuse_norms, parts)], dim=-1))

    @property
    def kind(self) -> str:
        return self.config.drafter

    def check_fits(self, base_model) -> None:
        check_fits(base_model, self.config.hidden_size, self.config.vocab_size, f"{self.kind} drafter weights")

    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path / CONFIG_NAME)
        state = {k: v.detach().to("cpu", dtype if v.is_floating_point() and dtype else v.dtype).contiguous()
                 for k, v in self.state_dict().items()}
        save_file(state, path / WEIGHTS_NAME, metadata={"format": "pt"})

    def shortlist(self, base_model) -> Shortlist:
        return Shortlist(base_model.get_output_embeddings(), self.vocab)


class HydraHeads(_Drafter):
    """K sequential heads: head k maps [c_t ; e(x_{t+1}) ; ... ; e(x_{t+k})] ((k+2) D) to a
    feature h_t + W2 SiLU(W1 [...] + b1) + b2 (W2, b2 zero-initialised), read by the LM head
    as a guess of x_{t+k+1}. e is the base's frozen input embedding, passed in; c_t is h_t, or
    with `feature_layers` the fused low, middle and last layers (from_base), computed once a step."""

    @property
    def max_depth(self) -> int:
        """The deepest level it drafts: one depth per head."""
        return self.config.num_heads

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        d, inner = config.hidden_size, config.inner_size
        self.up = nn.ModuleList(nn.Linear((k + 2) * d, inner) for k in range(config.num_heads))
        self.down = nn.ModuleList(nn.Linear(inner, d) for _ in range(config.num_heads))
        for layer in [*self.down, *([self.fuse] if self.fuse is not None else [])]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def split(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's hidden states at a position [..., k D] (the last layer's last) -> (h_t [..., D],
        what the heads read of them c_t [..., D]: h_t, plus the fused layers where it fuses them; the
        fusion starts at zero, so a fresh fused hydra is a plain one)."""
        hidden = features[..., -self.config.hidden_size:]
        return hidden, hidden + self.from_base(features) if self.fuse is not None else hidden

    def head(self, k: int, hidden: torch.Tensor, path_embeds: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Head k (0-based): hidden [..., D] h_t, path_embeds [..., k+1, D], context [..., D] c_t
        (split) -> feature [..., D]."""
        x = torch.cat([context, path_embeds.flatten(-2)], dim=-1)  # [..., (k+2) D]
        return hidden + self.down[k](nn.functional.silu(self.up[k](x)))

    def forward(self, features: torch.Tensor, path_embeds: torch.Tensor) -> torch.Tensor:
        """Training: features [B, k D] (h_t, or the fused layers', the last one last), path_embeds
        [B, K, D] (the true x_{t+1..t+K}) -> features [K, B, D]."""
        hidden, context = self.split(features)
        return torch.stack([self.head(k, hidden, path_embeds[:, : k + 1], context)
                            for k in range(self.config.num_heads)])


class EagleLayer(_Drafter):
    """fc([f_t ; e(x_{t+1})]) -> one decoder layer of the base's class -> predicted f_{t+1}.

    With `feature_layers` (EAGLE-3), f_t at a verified position is fused from several base layers
    (from_base); deeper nodes read the drafter's own output as before, and the LM head reads it
    through a norm of its own (`readout`).

    The layer is built from the base's own decoder-layer class and config (one layer, fresh
    weights), with the base's rotary embedding: no modeling code here. Needs the base model
    to be built, so it is made with `for_base` / `from_pretrained(path, base)`."""

    def __init__(self, config: DrafterConfig, base_model):
        super().__init__(config)
        decoder = base_model.get_decoder()
        text = copy.deepcopy(base_model.config.get_text_config())
        text.num_hidden_layers = 1
        if hasattr(text, "layer_types") and text.layer_types:
            text.layer_types = text.layer_types[:1]
        try:
            self.layer = type(decoder.layers[0])(text, layer_idx=0)
            self.rotary = type(decoder.rotary_emb)(config=text)
        except Exception as e:  # noqa: BLE001 - an architecture whose layer cannot stand alone
            raise MedusaError(f"cannot build an EAGLE drafter layer for {type(decoder).__name__}: {e}") from None
        self.text_config = text
        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d)
        self.out_norm = nn.RMSNorm(d, eps=1e-6) if config.feature_layers else None

    def readout(self, out: torch.Tensor) -> torch.Tensor:
        """The drafter's output [..., D] -> the feature the base LM head reads [..., D]."""
        return out if self.out_norm is None else self.out_norm(out)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """features [B, T, D] (f_t, or predicted ones), embeds [B, T, D] (e(x_{t+1})), position_ids
        [B, T], mask [B, 1, T, S] additive or None (causal), cache: the drafter's own -> [B, T, D]."""
        x = self.fc(torch.cat([features, embeds.to(features.dtype)], dim=-1))
        pos_emb = self.rotary(x, position_ids)
        if mask is None:
            t = x.shape[1]
            mask = torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu_(1)[None, None]
        return self.layer(x, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=cache is not None,
                          position_embeddings=pos_emb)

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.text_config)


def for_base(kind: str, base_model, name_or_path: str = "", **overrides) -> HydraHeads | EagleLayer:
    """A fresh drafter sized for `base_model`, on its device and dtype."""
    cfg = base_model.config.get_text_config()
    config = DrafterConfig(drafter=kind, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                           base_model_name_or_path=name_or_path or cfg.name_or_path, **overrides)
    config.shortlist_size = min(config.shortlist_size, cfg.vocab_size)
    drafter = HydraHeads(config) if kind == "hydra" else EagleLayer(config, base_model)
    weight = base_model.get_output_embeddings().weight
    return drafter.to(device=weight.device, dtype=weight.dtype)


def from_pretrained(path: str | Path, base_model) -> HydraHeads | EagleLayer:
    """Load a drafter saved by save_pretrained, sized and placed for `base_model`."""
    path = Path(path).expanduser()
    raw = json.loads((path / CONFIG_NAME).read_text())
    if not (path / WEIGHTS_NAME).is_file():
        raise MedusaError(f"{path} has {CONFIG_NAME} but no {WEIGHTS_NAME}")
    config = DrafterConfig.from_dict(raw)
    check_fits(base_model, config.hidden_size, config.vocab_size, f"{config.drafter} drafter weights")
    drafter = HydraHeads(config) if config.drafter == "hydra" else EagleLayer(config, base_model)
    state = load_file(path / WEIGHTS_NAME)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise MedusaError(
            f"weights in {path / WEIGHTS_NAME} do not match a {config.drafter} drafter for this base: "
            f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
        )
    weight = base_model.get_output_embeddings().weight
    return drafter.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
