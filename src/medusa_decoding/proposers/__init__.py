"""Proposers: what guesses a step's candidate tokens, and the tree they form.

Glossary: T context length, N tree nodes (root first), A verified positions of a step (the root
and the accepted candidates), D hidden size.

Two levels, as transformers' candidate generators and vLLM's proposers have them:
  - a `Drafter` holds what every sequence shares (weights, the tree shape, drafting options)
    and makes one `Proposer` per sequence (row);
  - a `Proposer` is one row's drafting state, two methods:
      propose(root, budget) -> Proposal: tokens [N] and their tree (mask, depth, parent), root
          first; or None for the root alone (nothing worth verifying, or budget 1);
      observe(hidden [A, D], next_tokens [A], nodes [A] | None): the positions just verified,
          the token that follows each, and which nodes of the last proposal were accepted.
Branch proposers (the n-gram branch of ngram.py, the grammar's forced tokens of forced.py) wrap
another proposer, or none: each hangs a chain under the root, a `Branch` of the proposal, by which
the decoder labels the tokens accepted on it.

`REGISTRY` maps a drafter kind (the `drafter` field of a checkpoint's config.json, a
`DrafterKind` for the built-in ones) to how that checkpoint is loaded, wrapped and trained. It
is the only place a kind is looked up: a new drafter, for inference and training, is one file
plus one `register` call.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import CONFIG_NAME, DrafterKind, MedusaError, NgramConfig
from ..tree import TreeBuffers



class Source(str, enum.Enum):
    """Where an emitted token came from (its provenance)."""

    PREFILL = "prefill"  # the first token, from the prompt's forward
    BONUS = "bonus"  # the base model's own token that ends a step
    DRAFT = "draft"  # a drafter's candidate that the base model accepted
    NGRAM = "ngram"  # an n-gram candidate (copied from the context) that the base model accepted
    FORCED = "forced"  # a token the grammar allowed alone, proposed beside the tree, accepted


@dataclass(frozen=True)
class Branch:
    """A chain of candidates hung under the root beside the drafter's tree (ngram.py, forced.py)."""

    source: Source  # what proposed it
    length: int  # its nodes


@dataclass
class Proposal:
    """One row's candidates for one verification step."""

    tokens: torch.Tensor  # [N] long, the root first
    tree: TreeBuffers  # mask [N, N], depth [N], parent [N]
    branches: tuple[Branch, ...] = ()  # chains under the root, in node order: the tree's last nodes
    score: torch.Tensor | None = None  # [N_head] float: a drafter's cumulative log-probability of each branch
    # [N, W] int32: each node's grammar mask, where a grammar filter (constrained.py) walked the tree
    masks: torch.Tensor | None = None

    def source_of(self, node: int) -> Source:
        """Which proposer a node below the root came from: its branch's, else the drafter (DRAFT)."""
        end = self.tree.num_nodes
        for branch in reversed(self.branches):
            if node >= end - branch.length:
                return branch.source
            end -= branch.length
        return Source.DRAFT

    def with_branch(self, tokens: torch.Tensor, tree: TreeBuffers, branch: Branch) -> Proposal:
        """This proposal with `branch`'s tokens [L] appended, `tree` being its tree with the chain."""
        return Proposal(torch.cat([self.tokens, tokens]), tree, self.branches + (branch,), self.score)


class Proposer:
    """One row's drafting state. The default proposes nothing (plain decoding)."""

    depth_limit: int = 0  # the deepest node it may propose

    def start(self, prompt: torch.Tensor) -> None:
        """prompt [T] long: the row's prompt, before its prefill."""

    def propose(self, root: torch.Tensor, budget: int | None = None) -> Proposal | None:
        """root [] long (the next token, emitted, not yet verified); budget: nodes of the tree,
        root included (None: the drafter's own; 1: the root alone) -> a Proposal, or None."""
        return None

    def observe(self, hidden: torch.Tensor, next_tokens: torch.Tensor, nodes: torch.Tensor | None) -> None:
        """hidden [A, D]: the base's last hidden states at A newly verified positions (those of the
        drafter's feature_layers, concatenated, when it has them); next_tokens
        [A]: the token after each (the last is the next root); nodes [A]: the accepted nodes of
        the last proposal (None after the prefill, or when the step verified the root alone)."""

    def use_graphs(self, graphs) -> None:
        """Draft on `graphs` (verifiers.compiled.DraftGraphs: its drafter's drafting compiled) where
        they are built; a proposer without a drafting module ignores them."""

    def counters(self) -> dict[str, int]:
        """Its own counts over the row's steps so far (the n-gram branch: ngram_steps, copy_steps);
        a proposer that wraps another adds the inner one's."""
        return {}


class Drafter:
    """What every row of one method shares; `proposer()` makes a row's state."""

    kind: str = "plain"
    # True: `medusa calibrate` fits a static tree to its heads' accuracy (Medusa heads); False: it
    # measures the acceptance of the trees it drafts at every budget (acceptance.json)
    fits_tree: bool = False
    weights = None  # the nn.Module it drafts with (MedusaHeads, HydraHeads, ...), if any
    # the base hidden states its proposers observe (verifiers.transformers.forward's `layers`);
    # None: the last layer's, after the final norm
    feature_layers: tuple[int, ...] | None = None
    # True: its proposals score their nodes (Proposal.score), so a grammar filter may ask for a bigger
    # tree and keep the best valid nodes (proposers/constrained.py)
    scored: bool = False

    def proposer(self) -> Proposer:
        return Proposer()

    def draft_module(self):
        """The nn.Module whose forward is one step's drafting at fixed sizes, for a compiled
        backend to compile (verifiers.compiled.DraftGraphs); None: it drafts eager only."""
        return None

    def tree_sizes(self) -> set[int]:
        """Node counts of the trees it proposes at its default budget (compiled shapes)."""
        return {1}

    @property
    def default_budget(self) -> int:
        return max(self.tree_sizes())

    def acceptance(self, ngram: NgramConfig | None = None) -> dict[int, float] | None:
        """budget -> expected accepted length per step (bonus included), measured on held-out
        data and shipped with the checkpoint: what costs.fit_to_machine chooses a budget from
        (None: unknown, the drafter keeps its own budget). ngram: with that n-gram chain beside
        each tree (budget 1: the chain alone), where the checkpoint measured it, else None."""
        return None

    def set_budget(self, budget: int) -> None:
        """Make `budget` (nodes, root included; 1: the root alone, the drafter rests) its own
        budget from now on."""
        raise MedusaError(f"a {self.kind} drafter has no budget to set")

    def describe(self) -> str:
        return "plain"


ACCEPTANCE_NAME = "acceptance.json"  # a checkpoint's acceptance statistics (medusa calibrate)


def chain_settings(ngram: NgramConfig) -> dict:
    """What an acceptance file records of the n-gram branch its chain figures were counted for."""
    return {"length": ngram.length, "max_ngram": ngram.max_ngram, "min_ngram": ngram.min_ngram,
            "copy_run": ngram.copy_run, "copy_length": ngram.copy_length}


def read_acceptance(folder: str | Path | None, ngram: NgramConfig | None = None) -> dict[int, float] | None:
    """A checkpoint's acceptance.json -> {budget: expected accepted length}, or None; ngram: with
    that chain beside each tree (None where the file has no figures for that chain)."""
    if folder is None or not (Path(folder) / ACCEPTANCE_NAME).is_file():
        return None
    try:
        raw = json.loads((Path(folder) / ACCEPTANCE_NAME).read_text())
        if ngram is None:
            return {int(b): float(tau) for b, tau in raw["expected_tau"].items()}
        measured = raw.get("ngram") or {}
        if "expected_tau_ngram" not in raw or measured != chain_settings(ngram):
            return None
        return {int(b): float(tau) for b, tau in raw["expected_tau_ngram"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise MedusaError(f"{Path(folder) / ACCEPTANCE_NAME} is not a valid acceptance file: {e}") from None


@dataclass(frozen=True)
class DrafterSpec:
    """How one drafter kind is loaded from a checkpoint folder and wrapped for a base model."""

    # (folder, base model) -> the drafter's weights (an nn.Module with a `kind`)
    load: Callable
    # (weights, base model, tree, budget) -> Drafter; tree: a tree file, paths, "dynamic" or None
    wrap: Callable
    # (TrainConfig) -> a training.Trainer: how `medusa train` trains this kind (None: it does not train)
    trainer: Callable | None = None
    # format (one of EXPORT_FORMATS) -> (folder, base model, out folder, dtype | None): writes the
    # checkpoint for another engine (`medusa export`)
    exports: dict[str, Callable] = field(default_factory=dict)
    # why a format it lacks cannot hold this kind, for the refusal
    no_export: str = ""


# other engines' checkpoint formats: vllm (vLLM's Medusa speculator), speculators (vLLM's EAGLE-3
# drafters, from the `speculators` project), sglang (SGLang's EAGLE-3 drafters)
EXPORT_FORMATS = ("vllm", "speculators", "sglang")


REGISTRY: dict[str, DrafterSpec] = {}


def register(kind: str, spec: DrafterSpec) -> None:
    """Make `kind` loadable: the value of `drafter` in a checkpoint's config.json."""
    REGISTRY[str(getattr(kind, "value", kind))] = spec


def checkpoint_kind(folder: str | Path) -> str:
    """The drafter kind a checkpoint folder holds: its config.json's `drafter` field (Medusa
    heads when absent, as in FasterDecoding and vLLM checkpoints)."""
    folder = Path(folder).expanduser()
    try:
        raw = json.loads((folder / CONFIG_NAME).read_text())
    except FileNotFoundError:
        return DrafterKind.MEDUSA.value  # the medusa loader reads the other formats, or says what is missing
    except (OSError, ValueError) as e:
        raise MedusaError(f"{folder / CONFIG_NAME} is not valid JSON: {e}") from None
    kind = raw.get("drafter", DrafterKind.MEDUSA.value) if isinstance(raw, dict) else DrafterKind.MEDUSA.value
    return kind


def spec_for(kind: str) -> DrafterSpec:
    _builtin()
    if kind not in REGISTRY:
        raise MedusaError(f"unknown drafter {kind!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[kind]


def trainer_for(kind: str) -> Callable:
    """How kind `kind` trains (a training.Trainer class); a kind without one is refused."""
    spec = spec_for(kind)
    if spec.trainer is None:
        raise MedusaError(f"drafter {kind!r} has no training recipe; trainable: "
                          + ", ".join(sorted(k for k, s in REGISTRY.items() if s.trainer is not None)))
    return spec.trainer


def export(folder: str | Path, base_model, fmt: str, out: str | Path, dtype: torch.dtype | None = None) -> str:
    """Write the checkpoint in `folder` in another engine's format `fmt` to `out` -> its kind; a
    kind without that format is refused, saying why."""
    if fmt not in EXPORT_FORMATS:
        raise MedusaError(f"unknown export format {fmt!r}; use one of {', '.join(EXPORT_FORMATS)}")
    kind = checkpoint_kind(folder)
    spec = spec_for(kind)
    if fmt not in spec.exports:
        has = f"it exports to {', '.join(spec.exports)} only" if spec.exports else "it has no export"
        raise MedusaError(f"a {kind} drafter cannot be written in the {fmt} format ({has}): {spec.no_export}")
    spec.exports[fmt](Path(folder).expanduser(), base_model, Path(out), dtype)
    return kind


def load(folder: str | Path, base_model):
    """A checkpoint folder -> its weights, sized and placed for `base_model`."""
    return spec_for(checkpoint_kind(folder)).load(Path(folder).expanduser(), base_model)


def wrap(weights, base_model, tree=None, budget: int | None = None) -> Drafter:
    """Drafter weights (e.g. MedusaHeads, HydraHeads) -> the Drafter that proposes with them."""
    return spec_for(weights.kind).wrap(weights, base_model, tree, budget)


def _builtin() -> None:
    """Register the built-in kinds (imported late: each file imports this one)."""
    from . import eagle, hydra, medusa  # noqa: F401
