"""`MedusaModel`: the Python API, in the style of transformers.

    model = MedusaModel.from_pretrained("smollm2-135m-instruct", heads="shipped")
    out = model.generate("Write a haiku about the sea.", max_new_tokens=64)
    print(out.text, out.stats.mean_accepted_length)
    for delta in model.stream("Tell me a joke."):
        print(delta, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .config import DEFAULT_MODEL, DEFAULT_TREE, GenerationConfig, MedusaError, NgramConfig, SamplingConfig
from .decode import GenerationStats, decode
from . import drafters
from .drafters import EagleDrafter, HydraHeads
from .heads import MedusaHeads
from .models import load_base
from .runner import Runner
from .tree import DynamicTree, TreeBuffers, build_tree, dynamic_tree, load_tree_file, validate_paths

TREE_NAME = "tree.json"  # a calibrated tree saved next to the heads
DYNAMIC = "dynamic"  # tree= this: a tree re-selected every step from the heads' probabilities
DYNAMIC_WIDTH, DYNAMIC_DEPTH = 4, 4  # its universe: ranks < 4 of up to 4 heads (340 paths)
DEFAULT_BUDGET = 16  # nodes of a dynamic tree, root included


def shipped_heads(alias: str, kind: str | None = None) -> Path | None:
    """The drafter shipped inside the package for a built-in model, if any: Medusa heads in
    weights/<alias>/, hydra and eagle drafters in weights/<alias>/<kind>/. kind None: the
    default one (weights/<alias>/default.txt names it; Medusa heads without it)."""
    from .models import BUILTIN_MODELS

    if alias not in BUILTIN_MODELS:
        return None
    root = Path(str(resources.files("medusa_decoding") / "weights" / alias))
    if kind is None:
        kind = (root / "default.txt").read_text().strip() if (root / "default.txt").is_file() else "medusa"
    path = root if kind == "medusa" else root / kind
    return path if (path / "config.json").is_file() else None


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]  # the new tokens, EOS included when generation ended on it
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or stop string) or "length" (max_new_tokens or context)


class TextStream:
    """An iterator of text deltas; once exhausted, `.text`, `.token_ids`, `.stats` and
    `.finish_reason` describe the whole generation. Text is held back while it may be the
    start of a stop string or an incomplete UTF-8 character, and never goes past a stop."""

    def __init__(self, tokenizer, tokens: Iterator[list[int]], stats: GenerationStats,
                 generation: GenerationConfig, eos_token_ids: set[int]):
        self._tokenizer = tokenizer
        self._tokens = tokens
        self._stop = generation.stop
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._eos = eos_token_ids
        self.stats = stats
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason = "length"  # "stop" when an EOS token or a stop string ended it

    def _stopped_text(self) -> str | None:
        """The text so far, cut before the first stop string, or None if there is none."""
        text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        self.text = text[: min(cuts)] if cuts else text
        return self.text if cuts else None

    def __iter__(self) -> Iterator[str]:
        sent = 0
        for chunk in self._tokens:
            stopped = False
            for token in chunk:  # token by token, so no token past a stop string is kept
                self.token_ids.append(token)
                if self._stopped_text() is not None:
                    stopped = True
                    break
            if stopped or (self.token_ids and self.token_ids[-1] in self._eos):
                self.finish_reason = "stop"
            if stopped:
                self._tokens.close()
                break
            safe = len(self.text) - self._hold
            while safe > sent and self.text[safe - 1] == "\ufffd":
                safe -= 1
            if safe > sent:
                yield self.text[sent:safe]
                sent = safe
        if len(self.text) > sent:
            yield self.text[sent:]


class MedusaModel:
    """A base causal LM, an optional drafter (Medusa heads, or a path-aware hydra/eagle drafter
    that drafts its own tree every step), a candidate tree, an optional n-gram branch."""

    def __init__(self, base, tokenizer, heads: MedusaHeads | HydraHeads | EagleDrafter | None = None, tree=None, name: str = "",
                 ngram: NgramConfig | bool | None = None, tree_budget: int | None = None,
                 runner: Runner | None = None, compile: bool = False):
        self.base = base
        # how the base runs (eager or compiled); share one runner between models on the same base
        self.runner = runner or Runner(base, compile=compile)
        self.tree_budget = tree_budget  # None: 16 for a dynamic tree, the checkpoint's for a drafter
        self.ngram = NgramConfig() if ngram is True else (ngram or None)
        self.tokenizer = tokenizer
        self.name = name or base.config.name_or_path
        self.heads = None
        self.tree = build_tree([])
        if heads is not None:
            heads.check_fits(base)
            self.heads = heads.to(device=self.device, dtype=base.dtype).eval().requires_grad_(False)
            if not isinstance(heads, (HydraHeads, EagleDrafter)):
                self.tree = self._fit_tree(tree)
            elif isinstance(tree, (str, Path, list, tuple)) and tree != DYNAMIC:
                raise MedusaError(f"a {heads.kind} drafter drafts its own tree every step; give no tree file")
        gen = getattr(base, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = eos if eos is not None else base.config.get_text_config().eos_token_id
        eos = eos if isinstance(eos, (list, tuple)) else [eos]
        self.eos_token_ids = {int(e) for e in eos if e is not None}
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))

    def _fit_tree(self, tree) -> TreeBuffers | DynamicTree:
        k = self.heads.num_heads
        if tree is None:  # the default tree, cut to the heads available
            return build_tree([p for p in DEFAULT_TREE if len(p) <= k])
        if isinstance(tree, DynamicTree):
            if tree.universe.max_depth > k:
                raise MedusaError(f"the dynamic tree reads {tree.universe.max_depth} heads but there are only {k}")
            return tree
        if tree == DYNAMIC:
            return dynamic_tree(DYNAMIC_WIDTH, min(k, DYNAMIC_DEPTH), self.tree_budget or DEFAULT_BUDGET)
        paths = tree.paths if isinstance(tree, TreeBuffers) else (
            load_tree_file(tree) if isinstance(tree, (str, Path)) else validate_paths(tree)
        )
        deepest = max((len(p) for p in paths), default=0)
        if deepest > k:
            raise MedusaError(f"the tree is {deepest} levels deep but the heads have only {k} heads")
        return build_tree(paths)

    def tree_sizes(self, use_medusa: bool = True) -> list[int]:
        """Node counts of the verification steps this model takes: the shapes a compiled runner needs."""
        if not use_medusa:
            return [1]
        if isinstance(self.heads, (HydraHeads, EagleDrafter)):
            trees = {self.tree_budget or self.heads.config.draft_budget}
        elif isinstance(self.tree, DynamicTree) and self.heads is not None:
            trees = {self.tree.budget}
        else:
            trees = {self.tree.num_nodes if self.heads is not None else 1}
        sizes = {1} | trees  # 1: steps near the context end
        if self.ngram:  # with the n-gram chain, and the chain alone on copy steps
            sizes |= {n + self.ngram.length for n in trees} | {1 + self.ngram.copy_chain}
        return sorted(sizes)

    def warmup(self, max_slots: int, use_medusa: bool = True) -> float:
        """Compile every verification shape for sequences up to max_slots tokens (prompt and answer)
        -> seconds; nothing to do for an eager runner."""
        return self.runner.warmup(self.tree_sizes(use_medusa), max_slots)

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    @classmethod
    def from_pretrained(
        cls,
        base: str = DEFAULT_MODEL,
        heads: str | Path | MedusaHeads | None = None,
        tree: str | Path | Sequence[Sequence[int]] | None = None,
        tree_budget: int | None = None,
        dtype: str = "auto",
        device: str = "auto",
        attn_implementation: str = "auto",
        ngram: NgramConfig | bool | None = None,
        compile: bool = False,
    ) -> MedusaModel:
        """Load a base model (built-in alias, HF folder or .gguf) and heads.

        heads: None for plain decoding, a folder, a MedusaHeads, or "shipped" for the heads the
        package ships for a built-in model. tree: paths or a JSON file; by default the heads'
        calibrated tree.json when present, else the built-in default tree; "dynamic" re-selects
        the tree_budget most probable nodes every step. ngram: True (or an NgramConfig) adds a
        prompt-lookup branch to every tree. A hydra/eagle checkpoint drafts its own tree every
        step (tree_budget nodes; default: the checkpoint's). compile: torch.compile the verification
        step (static shapes, compiled on first use or by `warmup`).
        """
        model, tokenizer, _ = load_base(base, dtype=dtype, device=device, attn_implementation=attn_implementation)
        if heads == "shipped":
            heads = shipped_heads(base)
            if heads is None:
                raise MedusaError(f"no heads are shipped for {base!r}; pass a heads folder or heads=None")
        if isinstance(heads, (str, Path)) and drafters.is_drafter(Path(heads).expanduser()):
            heads = drafters.from_pretrained(heads, model)
        elif isinstance(heads, (str, Path)):
            folder = Path(heads).expanduser()
            heads = MedusaHeads.from_pretrained(folder)
            if tree is None and (folder / TREE_NAME).is_file():
                tree = folder / TREE_NAME
        return cls(model, tokenizer, heads=heads, tree=tree, name=base, ngram=ngram, tree_budget=tree_budget,
                   compile=compile)

    def encode(self, prompt: str | list[dict], chat: bool | None = None) -> torch.Tensor:
        """A prompt (text, or chat messages) -> input_ids [1, T] on the model's device."""
        if isinstance(prompt, str) and not prompt.strip():
            raise MedusaError("the prompt is empty")
        if chat is None:
            chat = self.tokenizer.chat_template is not None
        if chat or isinstance(prompt, list):
            if self.tokenizer.chat_template is None:
                raise MedusaError(f"{self.name} has no chat template; use a plain prompt (--no-chat)")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    def stream(
        self,
        prompt: str | list[dict] | torch.Tensor,
        max_new_tokens: int = 256,
        chat: bool | None = None,
        stop: Sequence[str] = (),
        use_medusa: bool = True,
        ignore_eos: bool = False,
        **sampling,
    ) -> TextStream:
        """Generate and stream text deltas. `sampling`: SamplingConfig fields (temperature, top_p,
        top_k, seed, acceptance, ...). A tensor prompt is taken as input_ids [1, T].
        use_medusa=False: plain decoding (no heads, no n-gram branch), the baseline."""
        generation = GenerationConfig(max_new_tokens=max_new_tokens, stop=list(stop), ignore_eos=ignore_eos)
        sampling_config = SamplingConfig(**sampling)
        input_ids = prompt.to(self.device) if isinstance(prompt, torch.Tensor) else self.encode(prompt, chat)
        stats = GenerationStats()
        heads = self.heads if use_medusa else None
        ngram = self.ngram if use_medusa else None
        tokens = decode(self.base, input_ids, heads, self.tree, generation, sampling_config,
                        self.eos_token_ids, stats, ngram=ngram, draft_budget=self.tree_budget, runner=self.runner)
        return TextStream(self.tokenizer, tokens, stats, generation, self.eos_token_ids)

    def generate(self, prompt, max_new_tokens: int = 256, **kwargs) -> GenerationOutput:
        """Generate to the end and return the text, the new token ids and the stats."""
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, **kwargs)
        for _ in stream:
            pass
        return GenerationOutput(stream.text, stream.token_ids, stream.stats, stream.finish_reason)
