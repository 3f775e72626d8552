"""Replay n-gram branch settings over known answers: which chain length beside the drafter's tree and
which copy_run pay on this machine, without decoding once per setting.

    .venv/bin/python scripts/replay_ngram.py --suite sharegpt --limit 48 --compiled
    .venv/bin/python scripts/replay_ngram.py --suite spec-bench --limit 4 --compiled  # 4 first turns a category
    .venv/bin/python scripts/replay_ngram.py --suite spec-bench --limit 4 --datastore ds.safetensors  # and its chains

On the built-in model and its shipped drafter. For each prompt: its plain greedy answer, then one
forward over prompt + answer for the base's hidden states at every position, and at every position
the drafter's tree (at --budget) and the chain the n-gram lookup finds there. A setting is replayed
step by step: a step rooted at answer position i accepts as far as its branches agree with the
answer (greedy acceptance is exactly that), costs t(nodes)/t(1) + the drafting from this machine's
cost curve (--compiled: the saved compiled step's, costs.compiled_costs, what compile mode auto runs
once its graphs are built; else the eager step's), and the next step is rooted at i + 1 + accepted;
after a step that accepted copy_run chain tokens the next one verifies the copy chain alone
(ngram.py). Prints each setting's expected speed-up over plain decoding, per-prompt median and mean,
overall and by category, and the mean accepted length. With --datastore, each setting is replayed
three ways: without it, with its chains (where the context has none) as context chains, and with
them never starting copy steps. The trees come from features computed in one forward over the whole
answer, not step by step: the same up to rounding.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import numpy as np
import torch

from medusa_decoding import costs
from medusa_decoding.bench.prompts import load_suite, select
from medusa_decoding.config import CompileMode, NgramConfig
from medusa_decoding.datastore import Datastore
from medusa_decoding.engine import MedusaModel, make_backend
from medusa_decoding.models import shipped_drafter
from medusa_decoding.proposers.ngram import agreed, lookup


def tree_agreed(tokens: list[int], parent: list[int], answer: np.ndarray) -> int:
    """Depth of the tree's longest branch (root first) that follows the answer from the root."""
    node = 0
    for depth, token in enumerate(answer.tolist()):
        node = next((i for i in range(node + 1, len(tokens)) if parent[i] == node and tokens[i] == token), None)
        if node is None:
            return depth
    return len(answer)


@torch.inference_mode()
def branches(model, text: str, budget: int, max_new_tokens: int, longest: int, store: Datastore | None) -> dict:
    """The plain answer to `text`, and at each of its positions what the tree and the chain agree with
    (the chain from the context, else from the datastore: `stored` marks those)."""
    ids = model.encode(text).reshape(-1)
    answer = np.array(model.generate(ids, max_new_tokens=max_new_tokens, use_medusa=False).token_ids)
    verifier = model.verifier()
    row, _, hidden = verifier.add(torch.cat([ids, torch.from_numpy(answer)]), 8)  # hidden [T, k D]
    verifier.release(row)
    context = np.concatenate([ids.numpy(), answer])
    proposer, start, lookup_config = model.drafter.proposer(), ids.numel(), NgramConfig(length=longest)
    tree, chain, stored = [], [], []
    for i in range(len(answer) - 1):
        proposer.observe(hidden[start + i - 1: start + i], torch.tensor(answer[i: i + 1]), None)
        p = proposer.propose(torch.tensor(int(answer[i])), budget)
        tree.append(tree_agreed(p.tokens.tolist(), p.tree.parent.tolist(), answer[i + 1:]))
        found = lookup(context[: start + i + 1], lookup_config, longest)
        stored.append(found is None and store is not None)
        if stored[-1]:
            found = store.lookup(context[: start + i + 1], longest, lookup_config.store_max_ngram,
                                 lookup_config.store_min_ngram)
        chain.append(-1 if found is None else agreed(found, answer[i + 1:]))
    return {"tree": tree, "chain": chain, "stored": stored}


def replay(known: dict, cost, budget: int, length: int | None, copy_run: int, copy_length: int,
           store: str = "copies") -> tuple[float, float]:
    """Expected speed-up over plain decoding of one setting on one answer (length None: no chain),
    and its mean accepted length. cost(n, drafted) -> a step's cost relative to a plain one; budget:
    the tree's nodes. store: what datastore chains do: "copies" (as context chains), "no-copies"
    (never start copy steps), "off" (not proposed)."""
    tree, chain, stored = known["tree"], known["chain"], known["stored"]
    if store == "off":
        chain = [-1 if s else c for c, s in zip(chain, stored)]
    i, spent, copying, steps = 0, 0.0, False, 0
    while i < len(tree):
        found = chain[i] >= 0 and length is not None
        if copying and found:  # the copy chain alone
            accepted, spent, on_chain = min(chain[i], copy_length), spent + cost(1 + copy_length, False), True
        elif found:
            accepted = max(tree[i], min(chain[i], length))
            spent, on_chain = spent + cost(budget + length, True), min(chain[i], length) > tree[i]
        else:
            accepted, spent, on_chain = tree[i], spent + cost(budget, True), False
        accepted = min(accepted, len(tree) - 1 - i)
        copying = on_chain and NgramConfig(copy_run=copy_run).copies_after(accepted) and not (stored[i] and store == "no-copies")
        i += 1 + accepted
        steps += 1
    return len(tree) / spent, len(tree) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="sharegpt", help="sharegpt (held-out first turns) or spec-bench")
    ap.add_argument("--limit", type=int, default=48, help="prompts (sharegpt) or prompts a category (spec-bench)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--budget", type=int, default=None,
                    help="the tree's nodes (default: the best tree alone on this machine's costs)")
    ap.add_argument("--compiled", action="store_true",
                    help="the compiled step's costs (its one-node graph must be saved)")
    ap.add_argument("--settings", default="0:0,1:1,2:2,2:3,3:2,3:3,4:2,4:4,8:2,8:4",
                    help="length:copy_run pairs (length 0: the tree alone)")
    ap.add_argument("--datastore", default=None,
                    help="a datastore file (datastore.py): chains from it where the context has none, replayed "
                         "without it, as context chains and without copy steps")
    args = ap.parse_args()
    store = Datastore.load(args.datastore) if args.datastore else None
    model = MedusaModel.from_pretrained("smollm2-135m-instruct", heads=shipped_drafter("smollm2-135m-instruct"),
                                        dtype="auto", device="cpu", ngram=NgramConfig(), compile="off",
                                        exact=False, calibration="shipped")
    settings = [tuple(map(int, s.split(":"))) for s in args.settings.split(",")]
    copy_length = NgramConfig().copy_length
    sizes = sorted({1, 1 + copy_length} | {n for b in costs.BUDGETS for n in [b] + [b + L for L, _ in settings]})
    ((curve, path, _),) = costs.machine_curves(model, sizes, model.drafter, list(costs.BUDGETS)).values()
    if args.compiled and curve.compiled is None:
        compiled = make_backend(model.base, CompileMode.AUTO)
        curve.compiled = costs.compiled_ratio(model.backend, compiled, model.drafter.feature_layers)
        if curve.compiled is None:
            raise SystemExit("no saved one-node graph on this machine yet: run `medusa generate` once (compile mode "
                             "auto builds it in the background), then again")
        costs.save_curve(curve, path)
    verify, draft = costs.compiled_costs(curve) if args.compiled else (curve.verify, curve.draft)
    draft = draft[costs.drafter_key(model.drafter)]
    budget_nodes = args.budget or costs.choose_budget(model.drafter.acceptance(), verify, draft)[0]
    drafting = draft[budget_nodes]
    print(f"cost curve: {path}")
    step = "compiled" if args.compiled else "eager"
    print(f"budget {budget_nodes}, {step} costs: tree {costs.interpolate(verify, budget_nodes) + drafting:.2f}, "
          f"chain alone {costs.interpolate(verify, 1 + copy_length):.2f} plain steps")

    def cost(n: int, drafted: bool) -> float:
        return costs.interpolate(verify, n) + (drafting if drafted else 0.0)

    prompts = load_suite(args.suite, args.limit if args.suite == "sharegpt" else None)
    prompts = select(prompts, args.limit, 1) if args.suite != "sharegpt" else prompts[: args.limit]
    known = [(p.category, branches(model, p.turns[0], budget_nodes, args.max_new_tokens, copy_length, store))
             for p in prompts]
    for length, copy_run in settings:
        for use in (["off", "copies", "no-copies"] if store is not None and length else ["off"]):
            by, taus = defaultdict(list), []
            for category, k in known:
                if len(k["tree"]):
                    speedup, tau = replay(k, cost, budget_nodes, length or None, copy_run, copy_length, use)
                    by[category].append(speedup)
                    taus.append(tau)
            every = [r for rs in by.values() for r in rs]
            what = f"chain {length}, copy_run {copy_run}" if length else "tree alone"
            what += "" if store is None or not length else f", store {use}"
            cats = " ".join(f"{c[:6]} {statistics.median(rs):.2f}" for c, rs in by.items()) if len(by) > 1 else ""
            print(f"{what:40s} x{statistics.median(every):.3f} median, x{statistics.mean(every):.3f} mean, "
                  f"tau {statistics.mean(taus):.2f}  {cats}")


if __name__ == "__main__":
    main()
