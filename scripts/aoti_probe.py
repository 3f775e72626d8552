"""Probe (issue 15): one verification step as a saved *frozen* graph, through torch.export and
AOTInductor, against the eager step. Not part of the engine yet.

    .venv/bin/python scripts/aoti_probe.py --nodes 1 --dtype bfloat16 --threads 2
    .venv/bin/python scripts/aoti_probe.py --dtype float32 --no-freeze

The slot cache's tensors are inputs of the exported step; its index_copy_ writes stay input
mutations, which the package performs in place. Prints the export and build times, the package's
size and load time, its logits against eager (max difference, argmax) and the median step time
of both (interleaved rounds). Run it on a quiet machine.

Found on the AMD EPYC with AVX-512 bf16 (bf16, 1 node, prefix 200, 2 threads): the package must
be built under torch.no_grad(); with grad enabled inductor skips its oneDNN weight prepacking
(the package then calls 211 plain mm, and its step is 1.1x eager). Under no_grad: 333 prepacked
linears, built in 50 s, 331 MB (the prepacked weights inside), loaded in 0.3 s, 15.5 ms a step
against 24.3 ms eager (a rerun: 15.4 vs 23.5). fp32, frozen: logits within 2.3e-3 of eager,
argmax equal, 656 MB, 22.8 ms a step against 45.8 ms eager.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from medusa_decoding.models import load_base
from medusa_decoding.verifiers.compiled import dummy_args
from medusa_decoding.verifiers.transformers import forward


class Step(torch.nn.Module):
    """The step with the cache's key/value tensors as explicit inputs (what torch.export traces)."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, tokens, positions, mask, write_slots, kv):
        """tokens/positions [B, n], mask [B, 1, n, W], write_slots [n], kv: 2L tensors [R, G, S, d]
        -> logits [B, n, V], hidden [B, n, D]; writes the n new keys/values into kv."""
        for layer, k, v in zip(self.cache.layers, kv[0::2], kv[1::2]):
            layer.keys, layer.values = k, v
        self.cache.write_slots = write_slots
        return forward(self.model, tokens, positions, mask, self.cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--prefix", type=int, default=200, help="tokens already in the cache")
    ap.add_argument("--width", type=int, default=256, help="slots the step reads")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--freeze", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", type=Path, default=Path("runs/aoti"))
    args = ap.parse_args()
    if args.prefix + args.nodes > args.width:
        ap.error("--prefix + --nodes must fit in --width")
    torch.set_num_threads(args.threads)
    model, _, _ = load_base(args.model, dtype=args.dtype, device="cpu")
    model.eval()
    n, start = args.nodes, args.prefix
    _, _, _, _, cache, _ = dummy_args(model, (1, n, args.width, 2 * args.width, 1, None))
    cache.reserve(slice(0, 1), start, n, args.width)
    kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    torch.manual_seed(0)
    for t in kv:
        t.normal_()  # a filled prefix: any finite values do for timing and for comparing paths
    tokens = torch.randint(0, model.config.vocab_size, (1, n))
    positions = torch.arange(start, start + n)[None]
    mask = torch.zeros(1, 1, n, args.width, dtype=model.dtype)
    mask[..., start + n:] = torch.finfo(model.dtype).min  # a chain: each node sees the prefix and those before it
    mask[0, 0, :, start:start + n] = torch.zeros(n, n).masked_fill(torch.ones(n, n).triu(1).bool(), torch.finfo(model.dtype).min)
    inputs = (tokens, positions, mask, cache.write_slots, kv)
    step = Step(model, cache)
    before = [t.clone() for t in kv]
    with torch.inference_mode():
        ref = step(*inputs)

    with torch.no_grad():  # grad enabled: no oneDNN weight prepacking in the package
        t0 = time.perf_counter()
        program = torch.export.export(step, inputs)
        print(f"export {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        path = args.out / f"step-{n}-{args.dtype}-{'frozen' if args.freeze else 'unfrozen'}.pt2"
        path.parent.mkdir(parents=True, exist_ok=True)
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                           inductor_configs={"freezing": args.freeze})
        print(f"build {time.perf_counter() - t0:.1f} s, {Path(package).stat().st_size / 1e6:.0f} MB", flush=True)
    t0 = time.perf_counter()
    runner = torch._inductor.aoti_load_package(package)
    print(f"load {time.perf_counter() - t0:.1f} s", flush=True)

    for t, b in zip(kv, before):
        t.copy_(b)
    with torch.inference_mode():
        out = runner(*inputs)
    written = all(not torch.equal(t[0, :, start:start + n], b[0, :, start:start + n]) for t, b in zip(kv, before))
    diff = (out[0].float() - ref[0].float()).abs().max().item()
    same = bool((out[0].argmax(-1) == ref[0].argmax(-1)).all())
    print(f"logits: max difference {diff:.3g}, argmax equal {same}; new slots written in place: {written}")

    times: dict[str, list[float]] = {"eager": [], "aoti": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, fn in (("eager", step), ("aoti", runner)):
                t0 = time.perf_counter()
                fn(*inputs)
                times[name].append(time.perf_counter() - t0)
    print(", ".join(f"{k} {statistics.median(v) * 1000:.1f} ms" for k, v in times.items()),
          f"(median of {args.rounds} interleaved, {args.dtype}, {n} node(s), prefix {start}, {args.threads} threads)")


if __name__ == "__main__":
    main()
