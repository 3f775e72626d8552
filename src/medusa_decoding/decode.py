"""The decode loop: 1 propose, 2 verify (one forward with the tree mask), 3 accept, 4 commit.

Glossary: T prompt length, N tree nodes (root first), K heads, D hidden, V vocabulary.
Plain decoding is the same loop with the one-node tree and no heads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from .acceptance import accept
from .cache import keep_path
from .config import GenerationConfig, MedusaError, NgramConfig, SamplingConfig
from .drafters import DraftSession, EagleDrafter, HydraHeads
from .heads import MedusaHeads
from .proposers import NgramProposer
from .runner import Runner
from .tree import DynamicTree, TreeBuffers, build_tree, dynamic_tree, select_tree, tree_from_parents, tree_tokens

ROOT_ONLY = build_tree([])


@dataclass
class GenerationStats:
    """Per-generation counters; a step is one verification forward."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    # tokens emitted per step, bonus included (the first token, from the prefill, is not a step)
    accepted_lengths: list[int] = field(default_factory=list)
    # accepted_per_depth[d]: steps in which a depth-(d+1) candidate was accepted
    accepted_per_depth: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ngram_steps: int = 0  # steps whose tree carried an n-gram branch
    ngram_accepted: int = 0  # candidates accepted on the n-gram branch
    copy_steps: int = 0  # steps that verified the n-gram chain alone (NgramConfig.copy_run)

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / max(len(self.accepted_lengths), 1)

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [a / max(self.steps, 1) for a in self.accepted_per_depth]

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> str:
        depth = " ".join(f"{a:.2f}" for a in self.acceptance_per_depth)
        return (
            f"{self.new_tokens} tokens in {self.wall_s:.2f} s ({self.tokens_per_s:.1f} tok/s), "
            f"{self.steps} steps, mean accepted length {self.mean_accepted_length:.2f}"
            + (f", acceptance per depth [{depth}]" if depth else "")
            + f", prefill {self.prefill_s * 1000:.0f} ms"
        )

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "steps": self.steps,
            "mean_accepted_length": self.mean_accepted_length, "acceptance_per_depth": self.acceptance_per_depth,
            "accepted_lengths": self.accepted_lengths, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
            "tokens_per_s": self.tokens_per_s, "ngram_steps": self.ngram_steps,
            "ngram_accepted": self.ngram_accepted, "copy_steps": self.copy_steps,
        }


def context_length(model) -> int:
    return model.config.get_text_config().max_position_embeddings


def tree_bias(tree: TreeBuffers, dtype: torch.dtype, device) -> torch.Tensor:
    """[N, N] additive mask: 0 where a node sees a node (itself, its ancestors), dtype min elsewhere.
    Additive, not bool: with eager attention a bool 4D mask is silently wrong."""
    bias = torch.zeros(tree.mask.shape, dtype=dtype, device=device)
    return bias.masked_fill_(~tree.mask.to(device), torch.finfo(dtype).min)


class StepTrees:
    """The tree of each step: a static tree (TreeBuffers), with or without the n-gram chain,
    or a DynamicTree selected from the heads' probabilities every step."""

    def __init__(self, tree: TreeBuffers | DynamicTree, ngram_length: int, dtype: torch.dtype, device):
        self.dtype, self.device = dtype, device
        if isinstance(tree, DynamicTree):
            u = tree.universe
            if u.ngram_length != ngram_length:
                tree = dynamic_tree(u.topk, u.max_depth, tree.budget, ngram_length)
            self.dynamic, self.static = tree.to(device), []
            self.depth_limit = tree.universe.depth_limit
            self.heads_needed = tree.universe.max_depth
        else:
            self.dynamic = None
            self.static = [tree.to(device)]  # [0]: without, [1]: with the n-gram chain
            if ngram_length:
                self.static.append(build_tree(tree.paths, ngram_length).to(device))
            self.biases = [tree_bias(t, dtype, device) for t in self.static]  # [N, N] each
            self.depth_limit = max(t.depth_limit for t in self.static)
            self.heads_needed = tree.max_depth  # heads beyond the tree's depth are not run

    def pick(self, with_ngram: bool, head_logits: torch.Tensor | None):
        """head_logits [K, V] or None -> (tree, bias [N, N], head_topk [K, topk] or None)."""
        if self.dynamic is None:
            tree = self.static[int(with_ngram)]
            topk = head_logits.topk(tree.topk, dim=-1).indices if tree.max_depth else None
            return tree, self.biases[int(with_ngram)], topk
        u = self.dynamic.universe
        log_probs, topk = torch.log_softmax(head_logits.float(), -1).topk(u.topk, dim=-1)  # [K, width] each
        tree = select_tree(self.dynamic, log_probs[: u.max_depth], with_ngram)
        return tree, tree_bias(tree, self.dtype, self.device), topk


def decode(
    model,
    input_ids: torch.Tensor,
    heads: MedusaHeads | HydraHeads | EagleDrafter | None,
    tree: TreeBuffers | DynamicTree,
    generation: GenerationConfig,
    sampling: SamplingConfig,
    eos_token_ids: set[int],
    stats: GenerationStats,
    ngram: NgramConfig | None = None,
    draft_budget: int | None = None,
    runner: Runner | None = None,
) -> Iterator[list[int]]:
    """Yield the new tokens of each step (a list of ids) for one prompt, input_ids [1, T].

    heads None: no head candidates (plain decoding, or prompt lookup alone with `ngram`).
    tree: a static tree, or a DynamicTree re-selected every step from the heads' probabilities.
    A path-aware drafter (HydraHeads, EagleDrafter) drafts its own tree every step instead, of
    draft_budget nodes (default: the drafter's own).
    ngram: add a branch of tokens copied from the context whenever its last tokens recur.
    runner: how the base model runs (eager or compiled, which cache); default: eager.
    Stops after an EOS token (emitted), at max_new_tokens or at the context length; `stats` is
    filled in as it goes. Greedy output is token-identical to plain decoding whatever the drafts.
    """
    device = input_ids.device
    ctx = context_length(model)
    prompt_len = input_ids.shape[1]
    if prompt_len == 0:
        raise MedusaError("the prompt is empty")
    if prompt_len >= ctx:
        raise MedusaError(f"the prompt has {prompt_len} tokens; the model's context is {ctx}, leave room to generate")
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    session = DraftSession(heads, model, budget=draft_budget) if isinstance(heads, (HydraHeads, EagleDrafter)) else None
    if session is not None:
        heads, tree = None, ROOT_ONLY
    trees = StepTrees(tree if heads is not None else ROOT_ONLY, ngram.length if ngram else 0, model.dtype, device)
    lm_head = model.get_output_embeddings()
    ngram_proposer = NgramProposer(ngram) if ngram is not None else None
    copy_trees = StepTrees(ROOT_ONLY, ngram.copy_chain, model.dtype, device) if ngram is not None else None
    copying = False  # the last step accepted ngram.copy_run tokens or more from the n-gram chain
    stats.prompt_tokens = prompt_len
    depth_limit = max(trees.depth_limit, session.depth if session else 0, ngram.copy_chain if ngram else 0)
    stats.accepted_per_depth = [0] * depth_limit

    # Prefill: the prompt's last position gives the first token (the first root) and the
    # hidden state the heads read for the first tree.
    t0 = time.perf_counter()
    runner = runner or Runner(model)
    cache = runner.new_cache(prompt_len + generation.max_new_tokens + 2 * depth_limit + 2)
    try:
        with torch.inference_mode():
            logits, hidden = runner.prefill(input_ids, cache)
            first = accept(input_ids[0, -1:], logits, ROOT_ONLY, sampling, generator)
        root, last_hidden = first.bonus, hidden[-1]  # [], [D]
        if session is not None:
            session.advance(hidden, torch.cat([input_ids[0, 1:], root.reshape(1)]))
        prefix = prompt_len  # tokens in the cache; the root is emitted but not yet cached
        token = int(root)
        context = np.array(input_ids[0].tolist() + [token], dtype=np.int64)  # for the n-gram proposer
        stats.new_tokens = 1
        stats.prefill_s = time.perf_counter() - t0
        yield [token]
        if (token in eos_token_ids and not generation.ignore_eos) or generation.max_new_tokens == 1:
            return

        t0 = time.perf_counter()
        while prefix + 1 < ctx:
            with torch.inference_mode():
                # 1. propose: the heads read the last accepted position (a hydra/eagle drafter drafts
                #    a tree node by node); an n-gram branch joins when the context's last tokens
                #    occurred before; the step's tree takes both
                copied = ngram_proposer.propose(context, ngram.copy_chain if copying else None) if ngram_proposer else None
                with_ngram = copied is not None and len(copied) > 0
                draft = None
                if prefix + depth_limit + 2 > ctx:  # too close to the context end for a tree
                    step_tree, bias, head_topk, with_ngram = ROOT_ONLY, None, None, False
                elif copying and with_ngram:  # the answer copies its context: the chain alone
                    step_tree, bias, head_topk = copy_trees.pick(True, None)
                    stats.copy_steps += 1
                elif session is not None:  # a path-aware drafter drafts the step's tree itself
                    draft = session.propose(root)
                    step_tree = tree_from_parents(draft.parent, draft.depth, draft.max_depth,
                                                  ngram.length if with_ngram else 0)
                    bias, head_topk = tree_bias(step_tree, model.dtype, device), None
                else:
                    head_logits = None
                    if heads is not None:
                        head_logits = heads(last_hidden, lm_head, num_heads=trees.heads_needed)  # [K, V]
                    step_tree, bias, head_topk = trees.pick(with_ngram, head_logits)
                ngram_tokens = ngram_proposer.padded(copied, device, step_tree.ngram_length) if with_ngram else None  # [L]
                if draft is not None and step_tree.num_nodes > 1:
                    tokens = torch.cat([draft.tokens] + ([ngram_tokens] if with_ngram else []))  # [N]
                else:
                    tokens = tree_tokens(step_tree, root, head_topk, ngram_tokens)  # [N]
                # 2. verify: one forward over every node, each at position prefix + depth
                logits, hidden = runner.step(tokens, prefix + step_tree.depth, bias, prefix, cache)
                # 3. accept: the longest path the base model agrees with, plus the bonus token
                result = accept(tokens, logits, step_tree, sampling, generator)
                # 4. commit: keep the accepted path's cache entries; the bonus is the next root
                keep_path(cache, prefix, result.nodes)
                emitted = torch.cat([tokens[result.nodes[1:]], result.bonus.reshape(1)])  # [A]
                if session is not None:  # the drafter reads the verified features of the accepted path
                    session.advance(hidden[result.nodes], emitted)
            new = emitted.tolist()  # one host read: the accepted candidates and the bonus token
            prefix += len(new)
            root, last_hidden = result.bonus, hidden[result.nodes[-1]]
            stats.steps += 1
            stats.accepted_lengths.append(len(new))
            for d in range(len(new) - 1):
                stats.accepted_per_depth[d] += 1
            copying = False
            if with_ngram:
                stats.ngram_steps += 1
                if len(new) > 1 and int(result.nodes[1]) >= step_tree.num_nodes - step_tree.ngram_length:
                    stats.ngram_accepted += len(new) - 1
                    copying = 0 < ngram.copy_run <= len(new) - 1

            room = generation.max_new_tokens - stats.new_tokens
            new = new[:room]
            if not generation.ignore_eos:
                for i, t in enumerate(new):
                    if t in eos_token_ids:
                        new = new[: i + 1]
                        break
            if ngram_proposer:
                context = np.concatenate([context, np.array(new, dtype=np.int64)])
            stats.new_tokens += len(new)
            stats.decode_s = time.perf_counter() - t0
            yield new
            if stats.new_tokens >= generation.max_new_tokens or (
                not generation.ignore_eos and new[-1] in eos_token_ids
            ):
                return
    finally:  # a compiled runner hands its cache to the next generation
        runner.release(cache)
