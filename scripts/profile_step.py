"""Where the time of one verification step goes: the reference path (transformers' SDPA and
DynamicCache), the eager fast path (short-query attention, slot cache; its linears prepacked where
kernels/packed.py packs them, `stock` without) and the compiled step, saved (weights as graph
inputs, what compile mode auto loads) or frozen (weights folded in).

    .venv/bin/python scripts/profile_step.py --prefix 200 --nodes 1,16 --threads 2
    .venv/bin/python scripts/profile_step.py --paths eager,saved,frozen --nodes 1,8 --top 0
    .venv/bin/python scripts/profile_step.py --dtype float32 --paths saved,saved-int8 --graphs cache --top 0

A path with `-int8` runs the GGUF blocks' linears in the int8 numerics (config.Numerics).

Prints the median step time of each path (interleaved rounds) and torch.profiler's top operators.
Run it on a quiet machine: other jobs skew every figure.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from medusa_decoding.config import Numerics
from medusa_decoding.models import load_base, use_fast_attention
from medusa_decoding.platform import cache_dir
from medusa_decoding.tree import build_tree
from medusa_decoding.verifiers.compiled import CompiledBackend
from medusa_decoding.verifiers.transformers import EagerBackend, TransformersVerifier


def chain(n: int):
    return build_tree([(0,) * d for d in range(1, n)])  # n nodes, each sees all before it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefix", type=int, default=200, help="tokens already in the cache")
    ap.add_argument("--nodes", default="1,16", help="comma-separated tree sizes to time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--paths", default="reference,eager,compiled",
                    help="of reference, eager, stock, compiled (the default freezing), saved, frozen; eager and "
                         "saved also as eager-int8, saved-int8")
    ap.add_argument("--graphs", default=None, help="where saved graphs are found or built: 'cache' ($MEDUSA_CACHE/"
                    "compiled, what medusa compile built) or a folder (default: a new temporary one)")
    ap.add_argument("--top", type=int, default=8, help="operators shown per profile")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _, _ = load_base(args.model, dtype=args.dtype, device="cpu", attn_implementation="sdpa")
    sizes = [int(n) for n in args.nodes.split(",")]
    paths = args.paths.split(",")
    prompt = torch.randint(100, 10_000, (1, args.prefix), generator=torch.Generator().manual_seed(0))
    fast = use_fast_attention(model)
    attention = dict.fromkeys(paths, fast) | {"reference": "sdpa"}
    graphs = (cache_dir() / "compiled" if args.graphs == "cache" else Path(args.graphs) if args.graphs
              else Path(tempfile.mkdtemp()))
    int8 = Numerics.INT8
    backends = {"reference": lambda: EagerBackend(model, slots=False), "eager": lambda: EagerBackend(model),
                "eager-int8": lambda: EagerBackend(model, numerics=int8),
                "stock": lambda: EagerBackend(model, packed=False),
                "compiled": lambda: CompiledBackend(model, graphs=graphs),
                "saved": lambda: CompiledBackend(model, freeze=False, graphs=graphs),
                "saved-int8": lambda: CompiledBackend(model, freeze=False, graphs=graphs, numerics=int8),
                "frozen": lambda: CompiledBackend(model, freeze=True, graphs=graphs)}
    backends = {path: backends[path]() for path in paths}

    def step_fn(path: str, n: int):
        tree = chain(n)
        model.set_attn_implementation(attention[path])
        verifier = TransformersVerifier(backends[path])
        row, _, _ = verifier.add(prompt[0], n + 1)
        tokens = torch.full((n,), 42)

        def step():  # nothing committed: the next step overwrites (the dynamic cache is cropped)
            verifier.verify([row], [tokens], [tree])
            if not backends[path].slots:
                verifier.cache.crop(-n)
        return step

    with torch.inference_mode():
        steps = {}
        for path in paths:
            for n in sizes:
                steps[path, n] = step_fn(path, n)
                t0 = time.perf_counter()
                model.set_attn_implementation(attention[path])
                steps[path, n]()  # compiles the compiled path's graph
                if backends[path].compiled:
                    print(f"compiled {n} nodes: first call {time.perf_counter() - t0:.1f} s")
        times = {key: [] for key in steps}
        for _ in range(args.rounds):  # interleaved: drift hits every path alike
            for key, step in steps.items():
                model.set_attn_implementation(attention[key[0]])
                t0 = time.perf_counter()
                step()
                times[key].append(time.perf_counter() - t0)
        print(f"\nstep time, median of {args.rounds} (ms), prefix {args.prefix}, {args.dtype}, {args.threads} threads")
        for (path, n), ts in times.items():
            print(f"  {path:10s} {n:3d} nodes  {statistics.median(ts) * 1000:6.2f}")
        for (path, n), step in steps.items() if args.top else ():
            model.set_attn_implementation(attention[path])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
            print(f"\n{path}, {n} nodes: top operators (5 steps)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
