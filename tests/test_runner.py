"""The verifier's fast paths (slot cache, short-query attention, compiled step) against the reference
path (transformers' DynamicCache and SDPA): same attention, same kept cache, same greedy tokens (fp32)."""

import pytest
import torch

from medusa_decoding.spec import DecodeSpec
from medusa_decoding.kernels.attention import MIN_KEYS, fits_short_query_attention, register_attention, short_query_attention
from medusa_decoding.cache import SlotCache, keep_path, new_cache
from medusa_decoding.config import DEFAULT_TREE, GenerationConfig, MedusaError, NgramConfig, SamplingConfig
from medusa_decoding.engine import GenerationStats, MedusaModel
from medusa_decoding.models import use_fast_attention
from medusa_decoding.tree import build_tree
from medusa_decoding.verifiers.compiled import round_width
from medusa_decoding.verifiers.transformers import EagerBackend, TransformersVerifier, forward

from conftest import EOS, decode, byte_tokenizer, random_heads, save_tiny, tiny_llama


class Groups:  # what transformers passes as `module`: only num_key_value_groups is read
    def __init__(self, groups):
        self.num_key_value_groups = groups
        self.is_causal = True


def reference_attention(q, k, v, mask):
    """Plain SDPA on repeated key/value heads: q [B, H, n, d], k/v [B, G, S, d] -> [B, n, H, d]."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    n, s = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(n, s, dtype=torch.bool).tril(s - n)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("batch,heads,groups", [(1, 9, 3), (2, 4, 4), (1, 4, 1)])
@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_short_query_attention_equals_sdpa(batch, heads, groups, n, mask_kind):
    g = torch.Generator().manual_seed(n)
    s = MIN_KEYS + 21  # the kernel's own path (fewer keys go to SDPA)
    q = torch.randn(batch, heads, n, 16, generator=g)
    k, v = torch.randn(2, batch, groups, s, 16, generator=g)
    allowed = torch.rand(batch, 1, n, s, generator=g) > 0.3
    allowed[..., -n:] |= torch.eye(n, dtype=torch.bool)  # every query sees itself
    mask = {"none": None, "bool": allowed,
            "additive": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)}[mask_kind]
    got, weights = short_query_attention(Groups(heads // groups), q, k, v, mask, scaling=16**-0.5)
    assert weights is None and got.shape == (batch, n, heads, 16)
    want = reference_attention(q, k, v, allowed if mask_kind != "none" else None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fast_attention_only_where_it_fits():
    from transformers import Gemma3TextConfig

    assert fits_short_query_attention(tiny_llama().config)
    assert not fits_short_query_attention(Gemma3TextConfig(num_hidden_layers=2))  # sliding-window layers
    model = tiny_llama()
    assert use_fast_attention(model) == register_attention() == model.config._attn_implementation


@pytest.mark.parametrize("rows", [1, 3])
def test_slot_cache_keeps_what_plain_decoding_builds(rows):
    """Verify a tree for each of `rows` rows (prompts of different lengths) on a SlotCache and
    commit one path per row: each row's first slots equal a plain forward's cache of its tokens."""
    model = tiny_llama()
    tree = build_tree(DEFAULT_TREE)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (tree.num_nodes,), generator=torch.Generator().manual_seed(2))
    for path in tree.retrieve:
        verifier = TransformersVerifier(EagerBackend(model))
        nodes = path[path >= 0]
        prompts = [torch.randint(0, 256, (30 - 7 * r,), generator=g) for r in range(rows)]
        with torch.no_grad():
            added = [verifier.add(p, 4)[0] for p in prompts]  # room too small on purpose: it grows
            verifier.verify(added, [tokens] * rows, [tree] * rows)
            verifier.commit(added, [nodes[: len(nodes) - r] if r < len(nodes) else nodes[:1] for r in range(rows)])
        assert isinstance(verifier.cache, SlotCache)
        for r, (row, prompt) in enumerate(zip(added, prompts)):
            kept = nodes[: len(nodes) - r] if r < len(nodes) else nodes[:1]
            assert row.length == len(prompt) + len(kept) <= verifier.cache.capacity
            ref = new_cache(model)
            with torch.no_grad():
                forward(model, torch.cat([prompt, tokens[kept]])[None], torch.arange(row.length)[None], None, ref)
            for got, want in zip(verifier.cache.layers, ref.layers):
                torch.testing.assert_close(got.keys[row.index : row.index + 1, :, : row.length], want.keys,
                                           atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got.values[row.index : row.index + 1, :, : row.length], want.values,
                                           atol=1e-5, rtol=1e-5)


def test_slot_cache_refuses_a_forward_that_does_not_fit():
    cache = SlotCache(tiny_llama(), 16)
    with pytest.raises(MedusaError, match="does not fit"):
        cache.reserve(slice(0, 1), 10, 8)
    with pytest.raises(MedusaError, match="does not fit"):
        cache.reserve(slice(0, 1), 0, 4, width=3)
    with pytest.raises(MedusaError, match="does not fit"):
        cache.reserve(slice(0, 2), 0, 4)
    assert round_width(1) == round_width(256) == 256 and round_width(257) == 512


def generate(model, prompt, heads=None, tree=DEFAULT_TREE, backend=None, ngram=None, max_new_tokens=40):
    out = []
    for chunk in decode(model, torch.tensor([prompt]), heads, build_tree(tree),
                        GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True), SamplingConfig(), {EOS},
                        GenerationStats(), ngram=ngram, backend=backend):
        out += chunk
    return out


def long_prompts(n, length=100):
    """Long enough for the short-query kernel's own path (>= MIN_KEYS keys), with repeats to copy."""
    g = torch.Generator().manual_seed(length)
    out = []
    for _ in range(n):
        half = torch.randint(0, 256, (length // 2,), generator=g).tolist()
        out.append(half + half)
    return out


@pytest.mark.parametrize("ngram", [None, NgramConfig(length=4)])
def test_fast_path_gives_the_reference_tokens(ngram):
    """SDPA + DynamicCache (reference) == short-query kernel + SlotCache, plain and speculative."""
    reference = tiny_llama()
    fast = tiny_llama()
    use_fast_attention(fast)
    heads = random_heads(reference)
    for prompt in long_prompts(3):
        want = generate(reference, prompt, backend=EagerBackend(reference, slots=False))
        assert generate(fast, prompt) == want
        assert generate(fast, prompt, heads=heads, ngram=ngram) == want
        assert generate(reference, prompt, heads=heads, ngram=ngram, backend=EagerBackend(reference, slots=False)) == want


def test_compiled_runner_gives_the_eager_tokens_and_warmup_covers_every_shape():
    """torch.compile'd steps (static shapes) == eager reference, plain and with a tree + n-gram
    branch; after `warmup` a generation compiles nothing new."""
    reference = tiny_llama(max_positions=512)
    fast = tiny_llama(max_positions=512)
    use_fast_attention(fast)
    heads = random_heads(reference)
    tok = byte_tokenizer()
    model = MedusaModel(fast, tok, heads=heads, ngram=NgramConfig(length=4), compile=True)
    assert model.tree_sizes() == sorted({1, 1 + model.ngram.copy_chain, model.tree.num_nodes, build_tree(DEFAULT_TREE, 4).num_nodes})
    spent = model.warmup(300) + model.warmup(300, use_medusa=False)
    assert spent > 0 and {(b, n, w) for b, n, w, *_ in model.backend.shapes} == {
        (1, n, w) for n in model.tree_sizes() for w in (256, 512)}
    before = model.backend.compile_s
    for prompt in long_prompts(2, length=220):  # crosses from width 256 to 512
        want = generate(reference, prompt, backend=EagerBackend(reference, slots=False))
        ids = torch.tensor([prompt])
        assert model.generate(ids, max_new_tokens=40, use_medusa=False, ignore_eos=True).token_ids == want
        assert model.generate(ids, max_new_tokens=40, ignore_eos=True).token_ids == want
    assert model.backend.compile_s == before
    # two generations at once: each has its own verifier and cache, neither disturbs the other
    first, second = long_prompts(2, length=120)
    want = [generate(reference, p, backend=EagerBackend(reference, slots=False), max_new_tokens=20) for p in (first, second)]
    streams = [model.stream(torch.tensor([p]), max_new_tokens=20, use_medusa=False, ignore_eos=True) for p in (first, second)]
    iterators = [iter(s) for s in streams]
    for _ in range(25):
        for it in iterators:
            next(it, None)
    assert [s.token_ids for s in streams] == want and model.backend._spare is not None


GRAPH_RUN = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from conftest import byte_tokenizer, tiny_llama
from medusa_decoding.engine import MedusaModel
from medusa_decoding.models import use_fast_attention

model = tiny_llama(max_positions=512)
use_fast_attention(model)
m = MedusaModel(model, byte_tokenizer(), compile=True)
out = m.generate(torch.tensor([list(range(5, 45))]), max_new_tokens=12, use_medusa=False, ignore_eos=True)
print(json.dumps({{"tokens": out.token_ids, **m.backend.stats()}}))
"""


def test_a_second_process_loads_the_compiled_graphs_instead_of_compiling(tmp_path):
    """fp32 graphs are saved under $MEDUSA_CACHE/compiled: the next process loads every one (and
    gives the same tokens); another thread count or architecture has another key."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = GRAPH_RUN.format(tests=str(Path(__file__).parent))

    def run() -> dict:
        env = {**os.environ, "MEDUSA_CACHE": str(tmp_path)}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["frozen"] is False and first["graphs"] >= 1 and first["loaded"] == 0
    assert second["loaded"] == second["graphs"] == first["graphs"] and second["tokens"] == first["tokens"]
    assert len(list((tmp_path / "compiled").iterdir())) == 1
    # on CPU the saved graphs call their kernels from a C++ wrapper (inductor's cpp_wrapper), not Python
    saved = list((tmp_path / "compiled").glob("*/*.pt2"))
    assert saved and all(b"cpp_wrapper_src" in p.read_bytes() for p in saved)
    from medusa_decoding.verifiers.compiled import graph_key

    model = tiny_llama(max_positions=512)
    use_fast_attention(model)
    keys = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        keys.append(graph_key(model))
    torch.set_num_threads(1)
    assert keys[0] != keys[1] and graph_key(tiny_llama(max_positions=256)) != graph_key(tiny_llama(max_positions=512))


def test_frozen_graphs_give_the_eager_tokens(tmp_path):
    """The frozen path (bf16/fp16 on CPU by default; forced here in fp32): the reference tokens,
    and nothing saved (a frozen graph cannot be)."""
    from medusa_decoding.verifiers.compiled import CompiledBackend

    reference, fast = tiny_llama(max_positions=512), tiny_llama(max_positions=512)
    use_fast_attention(fast)
    backend = CompiledBackend(fast, freeze=True, graphs=tmp_path)
    model = MedusaModel(fast, byte_tokenizer(), backend=backend)
    prompt = long_prompts(1, length=60)[0]
    want = generate(reference, prompt, backend=EagerBackend(reference, slots=False), max_new_tokens=16)
    assert model.generate(torch.tensor([prompt]), max_new_tokens=16, use_medusa=False, ignore_eos=True).token_ids == want
    assert backend.stats()["frozen"] and backend.loaded == 0 and len(backend.shapes) == 1 and not any(tmp_path.iterdir())


def test_compile_auto_runs_eager_while_a_background_process_builds_the_graphs(tmp_path_factory, tmp_path):
    """Mode auto: a shape without a saved graph runs eager (no compiling in the run) and is listed
    for a background builder, which saves its graph; the same backend then loads it, and a fresh
    backend starts compiled. Every run gives the eager reference's tokens."""
    import os
    import time

    from medusa_decoding.verifiers.compiled import LOCK, WANTED, CompiledBackend, builder_alive

    folder, _ = save_tiny(tmp_path_factory, max_positions=512, with_heads=False)
    os.environ["MEDUSA_CACHE"], before = str(tmp_path), os.environ["MEDUSA_CACHE"]
    try:
        model = MedusaModel.from_pretrained(str(folder), DecodeSpec.plain(compile="auto"), dtype="float32", device="cpu")
        backend = model.backend
        assert isinstance(backend, CompiledBackend) and backend.mode.value == "auto" and not backend.freeze
        backend.background = True  # a server's choice: a child process builds what is listed
        backend.builder_idle_s = 0.0  # the builder exits once the list is done
        ids = torch.tensor([long_prompts(1, length=40)[0]])
        reference = MedusaModel.from_pretrained(str(folder), DecodeSpec.plain(compile="off"), dtype="float32", device="cpu",
                                                attn_implementation="sdpa")
        want = reference.generate(ids, max_new_tokens=12, use_medusa=False, ignore_eos=True).token_ids
        t0 = time.perf_counter()
        assert model.generate(ids, max_new_tokens=12, use_medusa=False, ignore_eos=True).token_ids == want
        assert time.perf_counter() - t0 < 10  # nothing compiled in this process
        stats = backend.stats()
        assert stats["graphs"] == 0 and stats["eager_steps"] >= 11 and stats["missing"] == 1
        assert backend.builder is not None and len(list((backend.folder / WANTED).glob("*.json"))) == 1
        assert backend.builder.wait(timeout=300) == 0, (backend.folder / "builder.log").read_text()[-2000:]
        assert not builder_alive(backend.folder) and not (backend.folder / LOCK).exists()
        assert len(list(backend.folder.glob("*.pt2"))) == 1 and not list((backend.folder / WANTED).glob("*.json"))
        backend.missing = dict.fromkeys(backend.missing, 0.0)  # as if RECHECK_S had passed
        backend.load_s = 0.0  # loading is free: a saved graph is loaded at once
        assert model.generate(ids, max_new_tokens=12, use_medusa=False, ignore_eos=True).token_ids == want
        assert backend.loaded == 1 and backend.stats()["graphs"] == 1 and backend.stats()["missing"] == 0
        again = MedusaModel.from_pretrained(str(folder), DecodeSpec.plain(compile="auto"), dtype="float32", device="cpu")
        again.backend.load_s = 0.0  # loading is free: a saved graph is loaded at once
        assert again.generate(ids, max_new_tokens=12, use_medusa=False, ignore_eos=True).token_ids == want
        assert again.backend.stats()["eager_steps"] == 0 and again.backend.loaded == 1 and again.backend.builder is None
        # exact mode keeps its eager kernels under auto
        from medusa_decoding.engine import make_backend

        exact = MedusaModel.from_pretrained(str(folder), DecodeSpec.plain(compile="auto"), dtype="bfloat16", device="cpu",
                                            attn_implementation="exact")
        assert not exact.backend.compiled and not make_backend(exact.base, "auto").compiled
    finally:
        os.environ["MEDUSA_CACHE"] = before


def test_compile_auto_starts_no_process_and_medusa_compile_builds_what_runs_listed(tmp_path_factory, tmp_path):
    """A one-shot run in mode auto starts no builder: it runs a missing shape eager and lists it;
    `medusa compile` (builder.compile_method) builds the listed shapes in the foreground, and the
    next run loads them, with the same tokens."""
    import os

    from medusa_decoding.builder import compile_method
    from medusa_decoding.verifiers.compiled import LOCK, WANTED

    folder, _ = save_tiny(tmp_path_factory, max_positions=512, with_heads=False)
    os.environ["MEDUSA_CACHE"], before = str(tmp_path), os.environ["MEDUSA_CACHE"]
    try:
        model = MedusaModel.from_pretrained(str(folder), DecodeSpec.plain(compile="auto"), dtype="float32", device="cpu")
        backend = model.backend
        ids = torch.tensor([long_prompts(1, length=40)[0]])
        want = model.generate(ids, max_new_tokens=12, use_medusa=False, ignore_eos=True).token_ids
        assert backend.builder is None and not (backend.folder / LOCK).exists()
        assert len(list((backend.folder / WANTED).glob("*.json"))) == 1 and backend.stats()["eager_steps"] >= 11
        built, loaded = compile_method(model, [ids], 12, progress=False)
        assert built == 1 and loaded == 0 and not list((backend.folder / WANTED).glob("*.json"))
        # a saved graph is loaded once its shape's eager steps have spent what the load costs: not
        # in a run this short (as fast as eager), at once where loading is free
        again = MedusaModel.from_pretrained(str(folder), DecodeSpec.plain(compile="auto"), dtype="float32", device="cpu")
        assert again.generate(ids, max_new_tokens=12, use_medusa=False, ignore_eos=True).token_ids == want
        stats = again.backend.stats()
        assert stats["loaded"] == 0 and stats["deferred"] == 1 and stats["missing"] == 0 and stats["eager_steps"] >= 11
        again.backend.spent = dict.fromkeys(again.backend.spent, 1e9)  # as if a long generation ran eager
        assert again.generate(ids, max_new_tokens=12, use_medusa=False, ignore_eos=True).token_ids == want
        assert again.backend.loaded == 1 and again.backend.stats()["eager_steps"] == stats["eager_steps"]
    finally:
        os.environ["MEDUSA_CACHE"] = before


def test_a_servers_builder_ends_when_the_server_is_killed(tmp_path_factory, tmp_path):
    """The child that builds a server's graphs never outlives it, even when the server is killed
    (SIGKILL: no atexit runs): the kernel's parent-death signal, or the builder's watch, ends it."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    folder, _ = save_tiny(tmp_path_factory, max_positions=512, with_heads=False)
    script = f"""
import os, signal, time, torch
from medusa_decoding.engine import MedusaModel
from medusa_decoding.spec import DecodeSpec
m = MedusaModel.from_pretrained({str(folder)!r}, DecodeSpec.plain(compile="auto"), dtype="float32", device="cpu")
m.backend.background = True
m.generate(torch.arange(5, 45)[None], max_new_tokens=4, use_medusa=False, ignore_eos=True)
print(m.backend.builder.pid, flush=True)
time.sleep(8)  # the builder is at work (importing torch, loading the model)
os.kill(os.getpid(), signal.SIGKILL)
"""
    env = os.environ | {"MEDUSA_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == -9, run.stderr[-2000:]
    pid = int(run.stdout.split()[-1])

    def alive() -> bool:  # a zombie (Z) waits for init to reap it: it runs nothing
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.perf_counter() + 10
    while alive() and time.perf_counter() < deadline:
        time.sleep(0.1)
    assert not alive()


def test_a_step_reading_feature_layers_compiles_on_a_model_that_never_ran(tmp_path):
    """The background builder compiles on a fresh model: for a drafter that reads several layers (the
    shipped fused hydra), transformers installs its output-capturing hooks on the first such forward,
    under a lock dynamo cannot trace; every builder failed there until build_graph ran one eager step."""
    from medusa_decoding.verifiers.compiled import build_graph, dummy_args

    fast = tiny_llama(max_positions=512)
    use_fast_attention(fast)
    with torch.inference_mode():
        build_graph(dummy_args(fast, (1, 4, 64, 128, 1, (0, 2))), tmp_path / "step.pt2")
    assert (tmp_path / "step.pt2").is_file()


def test_compile_auto_pauses_a_builder_while_it_decodes_and_resumes_it_when_idle(tmp_path):
    """A builder at work on the folder (here a stand-in process holding its lock) is stopped at the
    first step and continued when the last cache is released: on 2 cores a compiler beside a
    decode step made it ~20x slower."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from medusa_decoding.verifiers.compiled import LOCK, CompiledBackend

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def settled(pid: int, stopped: bool) -> bool:
        """A signal takes effect when its process next runs: on a loaded machine, a moment later."""
        deadline = time.perf_counter() + 5
        while (state(pid) == "T") != stopped and time.perf_counter() < deadline:
            time.sleep(0.02)
        return (state(pid) == "T") == stopped

    model = tiny_llama(max_positions=512)
    use_fast_attention(model)
    backend = CompiledBackend(model, graphs=tmp_path, mode="auto")
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        backend.folder.mkdir(parents=True)
        (backend.folder / LOCK).write_text(str(stand_in.pid))
        from medusa_decoding.engine import Request

        decoder = MedusaModel(model, byte_tokenizer(), backend=backend).decoder(1, use_medusa=False)
        decoder.add(Request(torch.arange(5, 45), GenerationConfig(max_new_tokens=6, ignore_eos=True), SamplingConfig()))
        decoder.step()
        assert settled(stand_in.pid, stopped=True)
        decoder.close()  # the last row released: nothing decodes here
        assert settled(stand_in.pid, stopped=False) and backend._held is None
    finally:
        stand_in.kill()


def test_the_compiled_cache_holds_what_sequences_need_not_the_whole_context():
    """A compiled step's cache is a graph input of fixed size: COMPILED_SLOTS slots a row (the model's
    context where it is shorter), more only for a sequence that needs them. Not the whole 8,192-token
    context: a server's 8 rows held 3 GB of fp32 SmolLM2 cache that way."""
    from medusa_decoding.verifiers.compiled import COMPILED_SLOTS, CompiledBackend

    base = tiny_llama(max_positions=8192)
    backend = CompiledBackend(base)
    assert backend.new_cache(100, 2).capacity == COMPILED_SLOTS < 8192
    assert backend.new_cache(3000, 1).capacity == round_width(3000) >= 3000
    short = CompiledBackend(tiny_llama(max_positions=256))
    assert short.new_cache(10, 1).capacity == round_width(256)
