"""Probe (issue 15): the 1-node verify step as a saved *frozen* graph, through torch.export and
AOTInductor. The slot cache's tensors are inputs, and its index_copy_ writes are input mutations.

    python scripts/aoti_probe.py THREADS NODES FREEZE DTYPE     # e.g. 2 1 1 bfloat16

It prints the export and compile times, the package size and load time, the logit difference
from eager, and eager vs AOTI step times (median of 20 interleaved). Found on the AVX-512 EPYC
(bf16): aoti_compile_and_package must run under torch.no_grad(). With grad enabled, inductor
skips its oneDNN weight prepacking (the package then calls 211 plain mm). Under no_grad it
emits the prepacked linears (333 mkldnn calls). The package holds 331 MB (the prepacked weights)
and loads in 0.3 s; the step takes 15.5 ms against 24.3 ms eager. Not yet in the engine.
"""
import sys, time, torch
from pathlib import Path
from medusa_decoding.models import load_base
from medusa_decoding.cache import SlotCache
from medusa_decoding.verifiers.transformers import forward

FREEZE = bool(int(sys.argv[3])) if len(sys.argv) > 3 else True
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
model, tok, _ = load_base("smollm2-135m-instruct", dtype=(sys.argv[4] if len(sys.argv) > 4 else "bfloat16"), device="cpu")
model.eval()
OUT = "runs/aoti"
Path(OUT).mkdir(parents=True, exist_ok=True)
B, n, width, capacity = 1, int(sys.argv[2]) if len(sys.argv) > 2 else 1, 256, 512

class Step(torch.nn.Module):
    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache
    def forward(self, tokens, positions, mask, write_slots, kv):
        cache = self.cache
        for layer, (k, v) in zip(cache.layers, zip(kv[0::2], kv[1::2])):
            layer.keys, layer.values = k, v
        cache.write_slots = write_slots
        return forward(self.model, tokens, positions, mask, cache)

cache = SlotCache(model, capacity, B)
cache.reserve(slice(0, B), 200, n, width)
kv = [t for l in cache.layers for t in (l.keys, l.values)]
torch.manual_seed(0)
for t in kv: t.normal_()
tokens = torch.randint(0, 49152, (B, n)); positions = torch.arange(200, 200 + n)[None].expand(B, n).contiguous()
mask = torch.zeros(B, 1, n, width, dtype=model.dtype); mask[..., 200 + n:] = float("-inf")
ws = torch.arange(200, 200 + n)
step = Step(model, cache)
with torch.inference_mode():
    ref_kv = [t.clone() for t in kv]
    ref = step(tokens, positions, mask, ws, kv)
    written = [t.clone() for t in kv]
t0 = time.perf_counter()
with torch.no_grad():
    ep = torch.export.export(step, (tokens, positions, mask, ws, kv))
print("export", round(time.perf_counter() - t0, 1), "s; mutations:", len(ep.graph_signature.user_inputs_to_mutate), flush=True)
t0 = time.perf_counter()
with torch.no_grad():
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=f"{OUT}/step-{n}-{int(FREEZE)}-{model.dtype}-nograd.pt2", inductor_configs={"freezing": FREEZE})
print("aoti compile", round(time.perf_counter() - t0, 1), "s", Path(pkg).stat().st_size / 1e6, "MB", flush=True)
t0 = time.perf_counter()
runner = torch._inductor.aoti_load_package(pkg)
print("load", round(time.perf_counter() - t0, 1), "s", flush=True)
for t, r in zip(kv, ref_kv): t.copy_(r)
with torch.inference_mode():
    out = runner(tokens, positions, mask, ws, kv)
print("logits max diff", (out[0].float() - ref[0].float()).abs().max().item(), "argmax equal", bool((out[0].argmax(-1) == ref[0].argmax(-1)).all()))
print("cache written", all(torch.equal(a, b) for a, b in zip(kv, written)))
times = {"eager": [], "aoti": []}
with torch.inference_mode():
    for _ in range(20):
        for name, fn in (("eager", lambda: step(tokens, positions, mask, ws, kv)), ("aoti", lambda: runner(tokens, positions, mask, ws, kv))):
            t0 = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t0)
import statistics
print({k: round(statistics.median(v) * 1000, 1) for k, v in times.items()}, "ms median")
