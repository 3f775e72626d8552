"""Block linears (kernels/blocks.py): fp32 weights that are GGUF Q4_1 / Q8_0 block values are found
back bit for bit, the kernel's rows are one-row products, and decoding on them stays lossless."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from medusa_decoding.spec import DecodeSpec
from medusa_decoding.config import MedusaError, NgramConfig, Numerics
from medusa_decoding.engine import MedusaModel
from medusa_decoding.models import use_fast_attention
from medusa_decoding.kernels import blocks
from medusa_decoding.verifiers.compiled import CompiledBackend, compiles_by_default
from medusa_decoding.verifiers.transformers import EagerBackend

from conftest import byte_tokenizer, random_heads, tiny_llama

needs_kernel = pytest.mark.skipif(blocks.supported(torch.zeros(1)) is not None,
                                  reason=f"block linears: {blocks.supported(torch.zeros(1))}")


def gguf_like_llama(seed: int = 1):
    """A tiny Llama whose linears hold Q4_1 values and whose LM head (304 rows) Q8_0 values, as a model
    loaded from such a GGUF does."""
    base = tiny_llama(max_positions=512, seed=seed, vocab=304)
    with torch.no_grad():
        for name, m in base.named_modules():
            if isinstance(m, nn.Linear):
                kind = blocks.BlockKind.Q8_0 if name == "lm_head" else blocks.BlockKind.Q4_1
                m.weight.copy_(blocks.quantize(m.weight, kind))
    use_fast_attention(base)
    return base


@needs_kernel
@pytest.mark.parametrize("kind", list(blocks.BlockKind))
def test_recover_finds_the_blocks_and_refuses_a_weight_one_ulp_off(kind):
    w = blocks.quantize(torch.randn(48, 96, generator=torch.Generator().manual_seed(0)), kind)
    found = blocks.recover(w)
    assert found is not None and found.kind is kind and found.shape == (48, 96)
    assert found.nbytes < w.numel() * 4 / 3
    off = w.clone()
    off[17, 40] = torch.nextafter(off[17, 40], torch.tensor(float("inf")))
    assert blocks.recover(off) is None
    assert blocks.recover(torch.randn(48, 96)) is None  # plain fp32 weights stay stock
    assert blocks.recover(w[:40]) is None  # rows not a multiple of the panel


@needs_kernel
def test_the_kernels_one_pass_recovery_equals_the_reference():
    """blocks.cpp's blocks_recover gives the codes, scales and mins _solve gives, block by block, on
    Q4_1 and Q8_0 values (zero blocks, constant blocks and scales stored one fp16 step off included),
    and fails where _solve fails."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32 * 8, generator=g) * torch.logspace(-4, 1, 64)[:, None]
    w[3, :64], w[5, 32:64] = 0.0, 0.25  # a zero block, a constant block
    for kind in blocks.BlockKind:
        v = blocks.quantize(w, kind).reshape(-1, 32).contiguous()
        if kind is blocks.BlockKind.Q4_1:  # blocks whose scale is one fp16 step off the nearest
            d = torch.tensor(0.0123, dtype=torch.float16).view(torch.int16)
            d_off = (d + 1).view(torch.float16).float()
            v[7] = d_off * torch.arange(32).remainder(16).float() + torch.tensor(-0.5)
        q, d, m, ok = blocks.kernel().blocks_recover(v, kind.bits)
        ref = blocks._solve(v, kind)
        assert ok and ref is not None
        codes = q.view(torch.int8) if kind is blocks.BlockKind.Q8_0 else q
        assert torch.equal(codes.to(torch.int16), ref[0]) and torch.equal(d, ref[1]) and torch.equal(m, ref[2])
        off = v.clone()
        off[11, 5] = torch.nextafter(off[11, 5], torch.tensor(float("inf")))
        assert not blocks.kernel().blocks_recover(off, kind.bits)[3] and blocks._solve(off, kind) is None


@needs_kernel
@pytest.mark.parametrize("kind", list(blocks.BlockKind))
def test_the_kernel_computes_with_exactly_the_recovered_weights_and_rows_alone(kind):
    assert blocks.kernel() is not None  # built, and its operator registered
    g = torch.Generator().manual_seed(1)
    w = blocks.quantize(torch.randn(64, 160, generator=g), kind)
    found = blocks.recover(w)
    assert torch.equal(blocks.block_linear(torch.eye(160), found, None).T, w)  # each weight, bit for bit
    x = torch.randn(40, 160, generator=g)
    alone = torch.cat([blocks.block_linear(x[i:i + 1], found, None) for i in range(40)])
    for n in (2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 40):  # every path and grouping of rows the kernel makes
        assert torch.equal(blocks.block_linear(x[:n], found, None), alone[:n])
    ref = F.linear(x, w)
    assert float((alone - ref).abs().max() / ref.abs().max()) < blocks.TOLERANCE
    assert blocks.check(w, found) is None


@pytest.mark.skipif(blocks.isa() == "AVX2", reason="the AVX-512 path needs an AVX-512 CPU")
@pytest.mark.parametrize("kind", list(blocks.BlockKind))
def test_the_avx512_build_gives_the_avx2_build_s_bits(kind):
    avx2 = blocks.build("AVX2", op=False)  # a second build, without the operator
    assert blocks.kernel() is not None and avx2 is not None
    g = torch.Generator().manual_seed(2)
    w = blocks.quantize(torch.randn(80, 96, generator=g), kind)  # 5 panels: 4 side by side and one alone
    found = blocks.recover(w)
    x = torch.randn(40, 96, generator=g)
    for n in range(1, 41):  # AVX-512 in registers up to 8 rows, then through a buffer or in chunks of <= 16
        theirs = avx2.blocks_linear(x[:n], found.codes, found.d, found.m, kind.bits, 0, False)
        assert torch.equal(blocks.block_linear(x[:n], found, None), theirs), n
        for limit in (blocks.FEW_ROWS, blocks.ALL_ROWS):  # either choice of stream_rows()
            ours = torch.ops.medusa_blocks.linear(x[:n], found.codes, found.d, found.m, kind.bits, limit, False)
            assert torch.equal(ours, theirs), (n, limit)


@pytest.mark.skipif(blocks.isa() != "AMX", reason="the AMX path needs a CPU with AMX tiles and AVX-512 bf16")
@pytest.mark.parametrize("kind", list(blocks.BlockKind))
def test_the_amx_path_computes_each_weight_exactly_and_each_row_alone_at_every_row_count(kind):
    """On the tile unit: x split into three bf16 pieces, codes exact in bf16, d (and m) applied per
    block. Each weight comes back bit for bit, each row of 1-40 rows (one or more tiles of <= 16 rows)
    is the one-row product, the sums are F.linear's within the tolerance, and check() runs it."""
    if not blocks.amx_ready():
        pytest.skip(f"the AMX path is not ready here (kernel built for {blocks.kernel_target()})")
    g = torch.Generator().manual_seed(5)
    w = blocks.quantize(torch.randn(80, 192, generator=g), kind)  # 5 panels, 6 blocks
    found = blocks.to_amx(blocks.recover(w))
    assert found.amx and found.codes.shape == ((5, 96, 16) if kind is blocks.BlockKind.Q4_1 else (5, 192, 16))
    assert torch.equal(blocks.block_linear(torch.eye(192), found, None).T, w)
    x = torch.randn(40, 192, generator=g) * torch.logspace(-3, 3, 192)  # pieces at many scales
    alone = torch.cat([blocks.block_linear(x[i:i + 1], found, None) for i in range(40)])
    for n in range(1, 41):
        assert torch.equal(blocks.block_linear(x[:n], found, None), alone[:n]), n
    ref = F.linear(x.double(), w.double()).float()
    assert float((alone - ref).abs().max() / ref.abs().max()) < blocks.TOLERANCE
    assert blocks.check(w, found) is None
    found.codes[1, 7, 3] ^= 0x10  # one code of one weight
    assert "off by" in blocks.check(w, found)


def test_a_kernel_that_does_not_build_falls_back_to_the_next_instruction_set(monkeypatch):
    """An AMX CPU with a compiler that has no AMX (gcc < 11) runs the AVX-512 build, not the stock
    layers; where nothing builds, None."""
    built = {"AVX512": "avx512 module", "AVX2": "avx2 module"}
    monkeypatch.setattr(blocks, "isa", lambda: "AMX")
    monkeypatch.setattr(blocks, "build", lambda target, op=True: built.get(target))
    try:
        blocks.kernel_target.cache_clear()
        assert blocks.kernel_target() == "AVX512" and blocks.kernel() == "avx512 module"
        built.clear()
        blocks.kernel_target.cache_clear()
        assert blocks.kernel_target() is None and blocks.kernel() is None
    finally:
        blocks.kernel_target.cache_clear()


@needs_kernel
def test_the_check_finds_blocks_that_are_not_the_weight():
    assert blocks.kernel() is not None
    w = blocks.quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)))
    found = blocks.recover(w)
    found.codes[0, 3, 0] ^= 0x01  # one code of one weight
    assert "off by" in blocks.check(w, found)


@needs_kernel
def test_a_lossy_copy_puts_weights_that_are_not_blocks_on_q8_0_blocks_of_their_own():
    """A drafter's fp32 layers (block_copy(lossy=Q8_0)): quantized, the GGUF-valued one kept exact."""
    g = torch.Generator().manual_seed(3)
    net = nn.Sequential(nn.Linear(64, 32), nn.SiLU(), nn.Linear(32, 48))
    with torch.no_grad():
        net[0].weight.copy_(blocks.quantize(net[0].weight))  # Q4_1 values already: recovered as they are
        before = net[2].weight.clone()
    amx = " on AMX" if blocks.amx_ready() else ""
    assert blocks.block_copy(net)[1] == {"q4_1" + amx: 1, "stock": 1}
    copy, counts = blocks.block_copy(net, lossy=blocks.BlockKind.Q8_0)
    assert counts == {"q4_1" + amx: 1, "q8_0 of fp32" + amx: 1}
    assert all(isinstance(copy[i], blocks.BlockLinear) for i in (0, 2))
    assert torch.equal(net[2].weight, before) and isinstance(net[2], nn.Linear)  # the module is left as it was
    x = torch.randn(5, 64, generator=g)
    with torch.inference_mode():
        want = F.linear(F.silu(net[0](x)), blocks.quantize(before, blocks.BlockKind.Q8_0), net[2].bias)
        got = copy(x)
    assert float((got - want).abs().max() / want.abs().max()) < blocks.TOLERANCE
    assert not torch.allclose(got, net(x), rtol=0, atol=1e-7)  # the weights did change


@needs_kernel
def int8_reference(x: torch.Tensor, found: blocks.Blocks) -> torch.Tensor:
    """The int8 numerics in float64: each row's blocks of 32 quantized to round(x * 127 / max|x|) (fp32,
    ties to even), times the integer codes, scaled by d e (and m e sum c for Q4_1), summed."""
    n, k = found.shape
    v = x.reshape(x.shape[0], k // 32, 32)
    top = v.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    c = (v * inv).round().double()
    e = (top / 127.0).double()
    p = found.codes.shape[0]
    if found.kind is blocks.BlockKind.Q4_1:
        q = torch.cat([found.codes & 15, found.codes >> 4], -1)  # [P, K, 16]
    else:
        q = found.codes
    q = q.double().permute(0, 2, 1).reshape(n, k // 32, 32)  # [N, K/32, 32]
    d = found.d.double().permute(0, 2, 1).reshape(n, k // 32)
    sums = torch.einsum("rbk,nbk->rnb", c, q)  # [rows, N, blocks]: integers
    y = (sums * d[None] * e[:, None, :, 0])
    if found.kind is blocks.BlockKind.Q4_1:
        m = found.m.double().permute(0, 2, 1).reshape(n, k // 32)
        y = y + m[None] * (e[..., 0] * c.sum(-1))[:, None, :]
    return y.sum(-1)


@needs_kernel
@pytest.mark.parametrize("kind", list(blocks.BlockKind))
def test_the_int8_path_is_the_integer_product_of_rows_quantized_alone(kind):
    """Numerics.INT8: the kernel's int8 path is the float64 product of each row quantized per block
    with the layer's own codes (to fp32 rounding), each row of a product is the one-row product at
    every grouping of rows, and the extreme codes (0/15, -128/127) and zero blocks of x are handled."""
    g = torch.Generator().manual_seed(2)
    w = blocks.quantize(torch.randn(64, 160, generator=g), kind)
    found = blocks.recover(w)
    if kind is blocks.BlockKind.Q8_0:  # Q8_0 codes reach -128 in a GGUF, never from `quantize`
        found.codes[0, :32, :4] = -128
        found.codes[1, 32:64, 4:] = 127
    int8 = blocks.for_this_machine(found, Numerics.INT8)
    assert int8.int8 and blocks.to_int8(found).codes.shape[1] == 160 // 4
    x = torch.randn(40, 160, generator=g) * torch.logspace(-3, 2, 40)[:, None]
    x[3, 32:64] = 0.0
    alone = torch.cat([blocks.block_linear(x[i:i + 1], int8, None) for i in range(40)])
    ref = int8_reference(x, found)
    assert float(((alone.double() - ref).abs() / ref.abs().amax(-1, keepdim=True)).max()) < 1e-6
    for n in (2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 17, 40):
        assert torch.equal(blocks.block_linear(x[:n], int8, None), alone[:n])
    exact = blocks.block_linear(x, blocks.for_this_machine(found), None)
    err = float(((alone - exact).abs() / exact.abs().amax(-1, keepdim=True)).max())
    assert 1e-5 < err < blocks.INT8_TOLERANCE  # another arithmetic than fp32's, close to it
    other = blocks.quantize(torch.randn(64, 160, generator=g), kind)
    assert blocks.check(w, blocks.to_int8(blocks.recover(other))) is not None  # the check still tells other weights


def test_the_step_runs_on_blocks_and_gives_the_stock_logits_closely():
    base = gguf_like_llama()
    backend = EagerBackend(base)
    assert backend.packed and backend.linears == "blocks" and backend.stats()["backend"] == "eager-blocks"
    on_blocks = [m for m in backend.model.modules() if isinstance(m, blocks.BlockLinear)]
    assert len(on_blocks) == sum(isinstance(m, nn.Linear) for m in base.modules())
    assert {m.blocks.kind for m in on_blocks} == set(blocks.BlockKind)
    assert not any(isinstance(m, blocks.BlockLinear) for m in base.modules())  # the base keeps its layers
    assert {id(p) for p in backend.model.parameters()} == {id(p) for p in base.parameters()}
    ids = torch.randint(3, 200, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = backend.model(ids).logits, base(ids).logits
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5


@needs_kernel
def test_saved_graphs_on_blocks_give_the_eager_tokens_and_load_again(tmp_path):
    """fp32 on blocks compiles (`--compile`, and in compile mode auto): the graphs call the kernel
    as an operator, give the eager blocks step's tokens (plain and speculative), and a new backend
    loads them from disk instead of compiling."""
    base = gguf_like_llama()
    assert compiles_by_default(base)
    tok, heads = byte_tokenizer(), random_heads(base, scale=3.0)
    eager = EagerBackend(base)
    backend = CompiledBackend(base, graphs=tmp_path)
    assert backend.linears == "blocks" and any(isinstance(m, blocks.BlockLinear) for m in backend.model.modules())
    runs = {}
    for name, be in (("eager", eager), ("compiled", backend)):
        for spec in (False, True):
            model = MedusaModel(base, tok, heads=heads if spec else None, tree_budget=4, backend=be)
            runs[name, spec] = model.generate("Hello there, ", chat=False, max_new_tokens=24, ignore_eos=True).token_ids
    assert runs["compiled", False] == runs["eager", False] and runs["compiled", True] == runs["eager", True]
    assert backend.loaded == 0 and len(backend.shapes) > 0 and any(tmp_path.rglob("*.pt2"))
    again = CompiledBackend(base, graphs=tmp_path)
    model = MedusaModel(base, tok, backend=again)
    again_ids = model.generate("Hello there, ", chat=False, max_new_tokens=24, ignore_eos=True).token_ids
    assert again_ids == runs["eager", False]
    assert again.loaded > 0


@needs_kernel
def test_compile_auto_builds_graphs_that_run_on_blocks_in_the_background(tmp_path):
    """Mode auto on a GGUF-valued fp32 model: the step runs eager on blocks while the background
    builder compiles it, and the graph it saves calls the block kernel (it once compiled the stock
    layers under the blocks key) and gives the eager tokens."""
    from torch.profiler import ProfilerActivity, profile

    folder = tmp_path / "model"
    gguf_like_llama(seed=4).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    model = MedusaModel.from_pretrained(str(folder), DecodeSpec.plain(compile="auto"), dtype="float32", device="cpu")
    backend = model.backend
    assert isinstance(backend, CompiledBackend) and backend.mode.value == "auto" and backend.linears == "blocks"
    backend.background = True  # a server's choice: a child process builds what is listed
    backend.builder_idle_s = 0.0  # the builder exits once the list is done
    want = model.generate("Hello there, ", chat=False, max_new_tokens=10, ignore_eos=True).token_ids
    assert backend.stats()["eager_steps"] >= 9 and backend.builder is not None
    assert backend.builder.wait(timeout=300) == 0, (backend.folder / "builder.log").read_text()[-2000:]
    backend.missing = dict.fromkeys(backend.missing, 0.0)  # as if RECHECK_S had passed
    backend.load_s = 0.0  # loading is free: a saved graph is loaded at once
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = model.generate("Hello there, ", chat=False, max_new_tokens=10, ignore_eos=True).token_ids
    assert got == want and backend.loaded == 1 and backend.stats()["graphs"] == 1
    names = [e.name for e in prof.events()]
    on_blocks = sum(isinstance(m, blocks.BlockLinear) for m in backend.model.modules())
    assert names.count("medusa_blocks::linear") >= on_blocks * 9  # every linear of every decode step
    assert "aten::mm" not in names and "aten::addmm" not in names


@needs_kernel
@pytest.mark.parametrize("numerics", list(Numerics))
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_speculative_decoding_on_blocks_gives_plain_decoding_s_tokens(kind, numerics):
    """fp32 and int8 numerics, random drafters (Medusa heads, hydra on a shortlist of the Q8_0 LM head),
    n-gram branch: token-identical to plain decoding on the same blocks in the same numerics, and the
    blocks really ran in it."""
    from test_methods import random_drafter

    base = gguf_like_llama()
    weights = random_heads(base, scale=3.0) if kind == "medusa" else random_drafter(kind, base)
    backend, tok = EagerBackend(base, numerics=numerics), byte_tokenizer()
    assert {m.blocks.int8 for m in backend.model.modules() if isinstance(m, blocks.BlockLinear)} == {
        numerics is Numerics.INT8}
    calls = []
    for m in backend.model.modules():
        if isinstance(m, blocks.BlockLinear):
            m.register_forward_hook(lambda *_: calls.append(1))
    plain = MedusaModel(base, tok, backend=backend)
    spec = MedusaModel(base, tok, heads=weights, ngram=NgramConfig(length=4), tree_budget=6, backend=backend)
    if kind == "hydra":
        assert spec.drafter.short.blocks is not None
    drafting = [m for m in spec.drafter.net.modules() if isinstance(m, (nn.Linear, blocks.BlockLinear))]
    assert drafting and all(isinstance(m, blocks.BlockLinear) for m in drafting)  # the drafter's own on Q8_0
    for prompt in ("Hello there, ", "abcabcabc "):
        want = plain.generate(prompt, chat=False, max_new_tokens=60, ignore_eos=True)
        got = spec.generate(prompt, chat=False, max_new_tokens=60, ignore_eos=True)
        assert got.token_ids == want.token_ids and max(got.stats.accepted_lengths) > 1
    assert calls


@needs_kernel
def test_auto_dtype_keeps_fp32_on_blocks_where_the_cpu_has_bf16_hardware(tmp_path, monkeypatch):
    """On a CPU with AVX-512 BF16 or AMX `auto` loads an fp32 checkpoint in fp32 and keeps it there
    when its linears run on blocks (a GGUF's), else in bf16 as before; elsewhere fp32."""
    from medusa_decoding import models, platform

    for name, base in (("gguf", gguf_like_llama()), ("random", tiny_llama())):
        base.save_pretrained(tmp_path / name)
        byte_tokenizer().save_pretrained(tmp_path / name)
    avx512 = ["avx2", "avx512f", "avx512_bf16"]
    monkeypatch.setattr(platform, "cpu_info", lambda: ("AVX-512 BF16 CPU", avx512))
    assert models.load_base(str(tmp_path / "gguf"), device="cpu")[0].dtype == torch.float32
    assert models.load_base(str(tmp_path / "random"), device="cpu")[0].dtype == torch.bfloat16
    assert models.load_base(str(tmp_path / "gguf"), dtype="bfloat16", device="cpu")[0].dtype == torch.bfloat16
    monkeypatch.setattr(platform, "cpu_info", lambda: ("AMX CPU", [*avx512, "amx_bf16"]))
    assert models.load_base(str(tmp_path / "gguf"), device="cpu")[0].dtype == torch.float32
    assert models.load_base(str(tmp_path / "random"), device="cpu")[0].dtype == torch.bfloat16
    monkeypatch.setattr(blocks, "kernel", lambda: None)  # no kernel here: bf16 after all
    assert models.load_base(str(tmp_path / "gguf"), device="cpu")[0].dtype == torch.bfloat16
    monkeypatch.setattr(platform, "cpu_info", lambda: ("AVX2 CPU", ["avx2"]))
    assert models.load_base(str(tmp_path / "random"), device="cpu")[0].dtype == torch.float32


def test_models_whose_weights_are_not_blocks_stay_stock(monkeypatch):
    base = tiny_llama()
    assert not blocks.recoverable(base) and not EagerBackend(base).packed
    assert "fp32" in blocks.supported(base.lm_head.weight.to(torch.bfloat16))
    gguf = gguf_like_llama()
    assert blocks.recoverable(gguf)
    monkeypatch.setattr(blocks, "kernel", lambda: None)  # no compiler here: stock, not a crash
    assert blocks.block_linears(gguf) is gguf and not EagerBackend(gguf).packed


def test_the_int8_numerics_is_refused_where_the_linears_are_not_on_blocks():
    with pytest.raises(MedusaError, match="numerics int8 is built for linears on a GGUF's blocks"):
        EagerBackend(tiny_llama(), numerics=Numerics.INT8)
    with pytest.raises(MedusaError, match="unknown numerics 'int4'"):
        DecodeSpec(numerics="int4")


@needs_kernel
def test_int8_graphs_are_saved_apart_and_speculation_on_them_gives_plain_decoding_s_tokens(tmp_path):
    """A compiled step in the int8 numerics calls the int8 operators (linears and the row-invariant
    attention), keeps its graphs in a folder of its own (not the fp32 graphs'), and speculative decoding
    on its graphs gives plain decoding's tokens on them; compile mode auto runs int8 eager (a run must not
    mix eager and compiled steps there); the base model keeps its own attention."""
    from torch.profiler import ProfilerActivity, profile

    base = gguf_like_llama()
    tok, heads = byte_tokenizer(), random_heads(base, scale=3.0)
    compiled = CompiledBackend(base, graphs=tmp_path, numerics=Numerics.INT8)
    assert compiled.linears == "blocks-int8" and compiled.folder != CompiledBackend(base, graphs=tmp_path).folder
    assert compiled.model.config._attn_implementation == "medusa_rowwise" != base.config._attn_implementation
    assert not compiles_by_default(base, Numerics.INT8) and compiles_by_default(base)
    runs = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for spec in (False, True):
            model = MedusaModel(base, tok, heads=heads if spec else None, ngram=NgramConfig(length=4) if spec else None,
                                backend=compiled)
            out = model.generate("Hello there, ", chat=False, max_new_tokens=24, ignore_eos=True)
            runs[spec] = out.token_ids
    assert runs[True] == runs[False] and max(out.stats.accepted_lengths) > 1 and len(compiled.shapes) > 1
    names = {e.name for e in prof.events()}
    assert {"medusa_blocks::linear_int8", "medusa_blocks::rowwise_attention"} <= names
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = EagerBackend(base, numerics=Numerics.INT8).model(ids).logits, EagerBackend(base).model(ids).logits
    assert 0 < float((a - b).abs().max() / b.abs().max()) < 0.05
