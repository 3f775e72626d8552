"""`medusa generate | ...`: parse the arguments, then call the library.

A user error prints one line `error: ...` to stderr and exits with status 2.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from .bench.config import BenchConfig
from .calibrate import ANSWER_TOKENS, PROMPTS
from .config import DEFAULT_MODEL, CalibrationMode, CompileMode, DistillConfig, GenerationConfig, LoadConfig, MedusaError, NgramConfig, Numerics, SamplingConfig, TrainConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Medusa speculative decoding for Hugging Face causal language models.")

ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Built-in alias, Hugging Face model folder or .gguf file.")
HeadsOpt = typer.Option(None, "--heads", help="Medusa heads, or a hydra/eagle drafter folder; default: the drafter shipped for the built-in model (with --tree: its Medusa heads).")
DtypeOpt = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto (bf16 on GPUs and on CPUs with bf16 in hardware: AVX-512 BF16 or AMX, but fp32 there too where the linears run on a GGUF's blocks; fp32 on other CPUs, where bf16 trees cost 4-5x more).")
DeviceOpt = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto.")
ExactOpt = typer.Option(None, "--exact/--no-exact", help="Exact mode: every decoding forward row-invariant, so bf16 speculative output equals bf16 plain output bit for bit, whatever the batch. Default: on where this machine's calibration measures it costs at most 10% of tokens/s (bf16 and fp16; fp32 output is exact either way).")
CompileOpt = typer.Option(None, "--compile/--no-compile", help="torch.compile the verification step. Default (auto): in float32, the graphs this machine has saved are loaded (~1-2 s each) and the missing ones run eager (`medusa compile` builds them, ~30-70 s each on a 2-core CPU; a server builds them in a child process while idle); --compile: build every graph in this process, waiting; --no-compile: eager.")
TreeOpt = typer.Option(None, "--tree", help="Medusa heads: a tree JSON file (list of paths), or 'dynamic'; default: the heads' calibrated tree, else the built-in one.")
BudgetOpt = typer.Option(None, "--tree-budget", help="Nodes of a dynamic or drafted tree, root included (default: 16, or the hydra/eagle drafter's own).")
NgramOpt = typer.Option(NgramConfig.length, "--ngram", help="An n-gram branch of this many tokens copied from the context (prompt lookup), verified with the drafter's tree; 0: none.")
DatastoreOpt = typer.Option(None, "--datastore", help="A datastore file (medusa datastore: the model's own answers): where the n-gram branch looks when the context has no match; default: the context only.")
CalibrationOpt = typer.Option(CalibrationMode.AUTO.value, "--calibration", help="The drafter's budget: auto (fitted to this machine from its verify and drafting costs, measured once in ~10-30 s and cached under $MEDUSA_CACHE), refresh (measure again) or shipped (the checkpoint's own).")
NoMedusaOpt = typer.Option(False, "--no-medusa", help="Plain decoding through the same engine (the baseline).")
NumericsOpt = typer.Option(Numerics.FP32.value, "--numerics", help="The arithmetic of the linear layers on a GGUF's blocks: fp32 (the model's own, the default) or int8 (activations quantized to 8 bits per row and block of 32, as llama.cpp computes: 2-5x cheaper layers on CPUs without AMX, other tokens than fp32 after a near-tie; speculation stays token-identical to plain decoding in int8). docs/ENGINE.md has the agreement figures.")


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def decode_spec(heads: Optional[Path], tree: Optional[str], no_medusa: bool, ngram: int = NgramConfig.length,
                tree_budget: Optional[int] = None, compile: Optional[bool] = None, exact: Optional[bool] = None,
                calibration: str = CalibrationMode.AUTO.value, datastore: Optional[Path] = None,
                numerics: str = Numerics.FP32.value):
    """The DecodeSpec of generate's and serve's method options (compile None: mode auto); with no
    options, DecodeSpec() itself: what the Python API decodes by default."""
    from .spec import DecodeSpec

    if ngram < 0:
        fail(f"--ngram must be >= 0, got {ngram}")
    if datastore is not None and (not ngram or no_medusa):
        fail("--datastore feeds the n-gram branch: drop " + ("--no-medusa" if no_medusa else "--ngram 0"))
    options = dict(tree=tree, tree_budget=tree_budget, ngram=ngram, datastore=datastore, exact=exact,
                   compile=CompileMode.AUTO if compile is None else CompileMode.parse(compile),
                   calibration=calibration, numerics=numerics)
    if no_medusa:
        return DecodeSpec.plain(**options | dict(tree=None, tree_budget=None, ngram=None))
    return DecodeSpec(**options) if heads is None else DecodeSpec(drafter=str(heads), **options)


def load_model(model: str, spec, dtype: str, device: str):
    """The model `generate` and `serve` run: the library assembles the spec (engine.MedusaModel.from_spec)."""
    from .engine import MedusaModel

    return MedusaModel.from_pretrained(model, spec, dtype=dtype, device=device, report=lambda line: typer.echo(line, err=True))


def structured_output(json_schema: Optional[Path], regex: Optional[str]):
    """generate's --json-schema FILE / --regex R -> a config.Grammar, or None."""
    import json

    from .config import Grammar, GrammarKind

    if json_schema is not None and regex is not None:
        fail("give --json-schema or --regex, not both")
    if regex is not None:
        return Grammar(GrammarKind.REGEX, regex)
    if json_schema is None:
        return None
    try:
        schema = json.loads(json_schema.read_text())
    except OSError as e:
        fail(f"--json-schema: cannot read {json_schema} ({e.strerror})")
    except json.JSONDecodeError as e:
        fail(f"--json-schema: {json_schema} is not JSON ({e})")
    if not isinstance(schema, dict):
        fail(f"--json-schema: {json_schema} must hold a JSON object (a schema)")
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))


def compile_summary(backend, stats) -> str:
    """What the compiled step did in this run, for generate's stats line ('' when eager): the time
    spent compiling or loading graphs, and the decoding's own tokens/s without it."""
    if not backend.compiled:
        return ""
    s = backend.stats()
    said = ""
    if s["compile_s"] > 0:
        decoding_s = max(stats.wall_s - s["compile_s"], 1e-9)
        said = (f", {s['compile_s']:.1f} s of it compiling or loading {s['graphs']} graphs "
                f"(decoding alone: {stats.new_tokens / decoding_s:.1f} tok/s)")
    if s["eager_steps"]:
        why = ([f"{s['missing']} graphs not built (medusa compile builds them)"] if s["missing"] else []) + (
            [f"{s['deferred']} saved ones not worth loading for this run"] if s["deferred"] else [])
        said += f"; {s['eager_steps']} steps ran eager: " + ", ".join(why)
    return said


@app.callback()
def _group() -> None:
    """Medusa speculative decoding for Hugging Face causal language models."""


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Wrap the prompt in the model's chat template (default: when it has one)."),
    model: str = ModelOpt,
    heads: Optional[Path] = HeadsOpt,
    tree: Optional[str] = TreeOpt,
    tree_budget: Optional[int] = BudgetOpt,
    max_new_tokens: int = typer.Option(GenerationConfig.max_new_tokens, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(SamplingConfig.temperature, "--temperature", "-t", help="0 is greedy."),
    top_p: float = typer.Option(SamplingConfig.top_p, "--top-p"),
    top_k: int = typer.Option(SamplingConfig.top_k, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    acceptance: Optional[str] = typer.Option(None, "--acceptance", help="greedy, rejection (lossless) or typical (lossy); default: greedy at temperature 0, rejection otherwise."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    no_medusa: bool = NoMedusaOpt,
    ngram: int = NgramOpt,
    datastore: Optional[Path] = DatastoreOpt,
    compile: Optional[bool] = CompileOpt,
    exact: Optional[bool] = ExactOpt,
    calibration: str = CalibrationOpt,
    numerics: str = NumericsOpt,
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Structured output: the answer is JSON valid under this JSON schema file (speculation stays lossless under it)."),
    regex: Optional[str] = typer.Option(None, "--regex", help="Structured output: the whole answer matches this regular expression."),
) -> None:
    """Generate text for one prompt, streamed to stdout; a line of stats goes to stderr."""
    if not prompt.strip():
        fail("the prompt is empty")
    grammar = structured_output(json_schema, regex)
    GenerationConfig(max_new_tokens=max_new_tokens, stop=stop)  # validate before the model loads
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, acceptance=acceptance)
    SamplingConfig(**sampling)
    spec = decode_spec(heads, tree, no_medusa, ngram, tree_budget, compile, exact, calibration, datastore, numerics)
    m = load_model(model, spec, dtype, device)
    stream = m.stream(prompt, max_new_tokens=max_new_tokens, chat=chat, stop=stop, grammar=grammar, **sampling)
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    typer.echo(f"[{m.method().describe()}] {stream.stats.summary()}{compile_summary(m.backend, stream.stats)}", err=True)


@app.command("compile")
def compile_graphs(
    model: str = ModelOpt,
    heads: Optional[Path] = HeadsOpt,
    tree: Optional[str] = TreeOpt,
    tree_budget: Optional[int] = BudgetOpt,
    ngram: int = NgramOpt,
    max_new_tokens: int = typer.Option(GenerationConfig.max_new_tokens, "--max-new-tokens", "-n", help="Tokens per prompt of the run that lists the shapes (longer answers need wider graphs)."),
    prompts: int = typer.Option(3, "--prompts", help="Built-in prompts decoded to list the shapes."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    calibration: str = CalibrationOpt,
    numerics: str = NumericsOpt,
) -> None:
    """Build the compiled step's graphs for this method on this machine, in the foreground: the shapes
    a run of --prompts prompts needs, and those earlier runs listed (they ran them eager). Later
    generate, bench and serve runs load them (compile mode auto)."""
    from .bench.prompts import BUILTIN, load_suite
    from .builder import compile_method

    if not 1 <= prompts <= 39:
        fail(f"--prompts must be between 1 and 39, got {prompts}")
    GenerationConfig(max_new_tokens=max_new_tokens)
    # int8: compile mode auto runs eager (compiles_by_default), so every shape is compiled as it is met
    compiled = True if Numerics.parse(numerics) is Numerics.INT8 else None
    spec = decode_spec(heads, tree, False, ngram, tree_budget, compiled, None, calibration, numerics=numerics)
    m = load_model(model, spec, dtype, device)
    if not m.backend.compiled:
        typer.echo(f"nothing to build: {model} runs eager here by default ({m.backend.stats()['backend']}: "
                   "packed linears or exact mode, as fast as a saved graph)", err=True)
        return
    texts = [p.turns[0] for p in load_suite(BUILTIN)[:prompts]]
    built, loaded = compile_method(m, texts, max_new_tokens)
    typer.echo(f"built {built} graphs, {loaded} already saved, in {m.backend.folder}", err=True)


@app.command("distill-data")
def distill_data(
    out: Path = typer.Option(..., "--out", help="Folder for features/, data.jsonl and manifest.json (resumable: rerun the same command to go on)."),
    model: str = ModelOpt,
    data: str = typer.Option("sharegpt", "--data", help="'sharegpt' or a JSON/JSONL file of ShareGPT-shaped records."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Stop when the folder holds this many conversations."),
    max_new_tokens: int = typer.Option(DistillConfig.max_new_tokens, "--max-new-tokens"),
    temperature: float = typer.Option(DistillConfig.temperature, "--temperature", help="0: greedy answers, what greedy decoding will see."),
    batch_size: int = typer.Option(DistillConfig.batch_size, "--batch-size", help="Sequences decoded together (continuous batching)."),
    max_prompt_tokens: int = typer.Option(DistillConfig.max_prompt_tokens, "--max-prompt-tokens", help="Longer first prompts are skipped (counted)."),
    turns: int = typer.Option(DistillConfig.turns, "--turns", help="User turns asked per conversation: follow-ups come after the model's own answers."),
    max_length: int = typer.Option(DistillConfig.max_length, "--max-length", help="Prompt + answer tokens; a follow-up that would not fit is not asked."),
    exclude: str = typer.Option("auto", "--exclude", help="Benchmark suites whose prompts no training prompt may match (exact or near duplicate), comma-separated; auto: every suite found here (builtin always, spec-bench where $MEDUSA_SPEC_BENCH names its file, humaneval where installed); '' for none."),
    pack: Optional[Path] = typer.Option(None, "--pack", help="Write the --out folder's conversations as token ids to this file (.jsonl.gz, ~2 bytes a token, no features) and exit: small enough to commit."),
    unpack: Optional[Path] = typer.Option(None, "--unpack", help="Rebuild the --out folder from a --pack file (features by one forward a conversation, ~0.1 s each; resumable); with --limit, go on distilling up to it."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
) -> None:
    """Self-distillation data: the base model's own answers to ShareGPT's user turns, with its features."""
    from .bench.prompts import has_suite, load_suite
    from .data import Contamination
    from .distill import distill
    from .packs import pack as pack_folder
    from .packs import unpack as unpack_file

    if pack is not None:
        typer.echo(f"packed {pack_folder(out, pack)} conversations of {out} into {pack}", err=True)
        return
    if unpack is not None:
        if not unpack.is_file():
            fail(f"--unpack {unpack}: no such file")
        typer.echo(f"rebuilt {unpack_file(unpack, out, source=data, device=device)} conversations of {unpack} in {out}",
                   err=True)
        if limit is None:  # rebuilt only; a --limit goes on from there
            return
    cfg = DistillConfig(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=batch_size,
                        max_prompt_tokens=max_prompt_tokens, turns=turns, max_length=max_length)
    suites = [name.strip() for name in exclude.split(",") if name.strip()]
    if exclude == "auto":
        suites = [name for name in ("builtin", "spec-bench", "humaneval") if has_suite(name)]
        missing = [name for name in ("spec-bench", "humaneval") if name not in suites]
        typer.echo(f"contamination check against: {', '.join(suites)}"
                   + (f" (not found here: {', '.join(missing)})" if missing else ""), err=True)
    texts = {f"{suite}:{p.id}:{i}": t for suite in suites for p in load_suite(suite) for i, t in enumerate(p.turns)}
    index = Contamination(texts) if texts else None
    counts = distill(model, out, source=data, limit=limit, cfg=cfg, exclude=index, dtype=dtype, device=device)
    typer.echo("; ".join(f"{k}: {v}" for k, v in sorted(counts.items())), err=True)


@app.command()
def datastore(
    data: Path = typer.Option(..., "--data", help="A medusa distill-data folder, or its --pack file (.jsonl.gz): the base model's own answers."),
    out: Path = typer.Option(..., "--out", help="The datastore file to write (.safetensors; ~2 bytes a token)."),
    split: str = typer.Option("train", "--split", help="train (what drafters train on: held-out answers stay held out), eval or all."),
) -> None:
    """A datastore for the n-gram branch: the answers of self-distilled data, searched by the context's longest suffix where the context itself has no match (generate/serve/bench --datastore FILE)."""
    import time

    from .packs import answers_of
    from .datastore import Datastore

    if split not in ("train", "eval", "all"):
        fail(f"--split must be train, eval or all, got {split!r}")
    t0 = time.perf_counter()
    answers = [a for part in (("train", "eval") if split == "all" else (split,)) for a in answers_of(data, part)]
    store = Datastore.from_answers(answers)
    out.parent.mkdir(parents=True, exist_ok=True)
    store.save(out, {"source": str(data), "split": split, "answers": len(answers), "tokens": store.size})
    typer.echo(f"{len(answers)} answers, {store.size} tokens -> {out} ({out.stat().st_size / 2**20:.1f} MiB) in "
               f"{time.perf_counter() - t0:.1f} s", err=True)


@app.command()
def serve(
    model: str = ModelOpt,
    heads: Optional[Path] = HeadsOpt,
    tree: Optional[str] = TreeOpt,
    tree_budget: Optional[int] = BudgetOpt,
    ngram: int = NgramOpt,
    datastore: Optional[Path] = DatastoreOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 exposes the server to the network)."),
    port: int = typer.Option(8000, "--port"),
    max_batch_size: int = typer.Option(8, "--max-batch-size", help="Sequences decoded together; more requests wait in a queue."),
    adaptive: bool = typer.Option(True, "--adaptive/--fixed-budget", help="Choose each step's tree budget from measured throughput at the current number of active sequences (plain decoding when that is faster); --fixed-budget: always the method's own."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    no_medusa: bool = typer.Option(False, "--no-medusa", help="Plain batched decoding (the baseline)."),
    compile: Optional[bool] = CompileOpt,
    exact: Optional[bool] = ExactOpt,
    calibration: str = CalibrationOpt,
    numerics: str = NumericsOpt,
) -> None:
    """OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) running the same method as generate, with continuous batching; a page on / shows each answer's tokens coloured by how they were produced."""
    if max_batch_size < 1:
        fail(f"--max-batch-size must be >= 1, got {max_batch_size}")
    if not 0 < port < 65536:
        fail(f"--port must be in 1..65535, got {port}")
    try:
        from .server import serve as run_server
    except ImportError as e:
        fail(f"the server needs fastapi, uvicorn and prometheus-client: pip install 'medusa-decoding[serve]' ({e})")
    spec = decode_spec(heads, tree, no_medusa, ngram, tree_budget, compile, exact, calibration, datastore, numerics)
    m = load_model(model, spec, dtype, device)
    typer.echo(f"the page: http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/", err=True)
    run_server(m, host=host, port=port, max_batch_size=max_batch_size, use_medusa=not no_medusa, adaptive=adaptive)


@app.command("load-test")
def load_test(
    url: list[str] = typer.Option([], "--url", help="A running server, e.g. http://127.0.0.1:8000 (repeatable)."),
    serve: list[str] = typer.Option([], "--serve", help="Start `medusa serve ARGS` on a free port for the test, stopped after it (repeatable; \"\" for the defaults)."),
    clients: int = typer.Option(LoadConfig.clients, "--clients", help="Concurrent clients."),
    duration: float = typer.Option(LoadConfig.duration_s, "--duration", help="Seconds of load."),
    max_tokens: int = typer.Option(LoadConfig.max_tokens, "--max-tokens", help="Per answer."),
    seed: int = typer.Option(LoadConfig.seed, "--seed"),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the report (JSON) here."),
) -> None:
    """Load and fault test of servers: concurrent clients, streams dropped mid-way, malformed requests; every
    greedy answer must equal the same request's answer alone, every 4xx carry an error, every slot end free.
    Prints the report (JSON); exit 1 if anything went wrong."""
    import asyncio
    import json

    cfg = LoadConfig(clients=clients, duration_s=duration, max_tokens=max_tokens, seed=seed)
    if not url and not serve:
        fail("give --url (a running server) or --serve (start one)")
    try:
        from .server.load import run_load, started_servers
    except ImportError as e:
        fail(f"the load test needs the serve extra: pip install 'medusa-decoding[serve]' ({e})")
    with started_servers(serve) as started:
        report = asyncio.run(run_load([*url, *started], cfg))
    text = json.dumps(report, indent=2)
    typer.echo(text)
    if out is not None:
        out.write_text(text + "\n")
    raise typer.Exit(0 if report["ok"] else 1)


@app.command()
def calibrate(
    heads: Path = typer.Option(..., "--heads", help="Heads folder; the tree is saved there as tree.json unless --out. A hydra/eagle drafter: its drafting depth/width/budget are measured and saved in its config.json."),
    model: str = ModelOpt,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL of prompts (Spec-Bench format or {\"prompt\": ...}); default: held-out ShareGPT."),
    limit: int = typer.Option(PROMPTS, "--limit", help="Calibration prompts."),
    max_new_tokens: int = typer.Option(ANSWER_TOKENS, "--max-new-tokens"),
    out: Optional[Path] = typer.Option(None, "--out", help="Where to save the tree (default: HEADS/tree.json)."),
    ngram: int = typer.Option(NgramConfig.length, "--ngram", help="hydra/eagle: fit the budget with this n-gram branch, as generate runs by default (0: none)."),
    grid: bool = typer.Option(False, "--grid", help="hydra/eagle: also time every drafting depth/budget against plain decoding end to end and save the best in config.json (the long version, ~1 h)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
) -> None:
    """Fit the tree to the heads and this device: head accuracy, verify latency, best tree (or, for a
    hydra/eagle drafter, its acceptance at every budget, saved as acceptance.json, and the budget
    that fits this machine; --grid: the drafting setting measured fastest against plain decoding)."""
    import torch

    from . import calibrate as cal
    from .engine import MedusaModel

    if limit < 1 or max_new_tokens < 1:
        fail("--limit and --max-new-tokens must be >= 1")
    if ngram < 0:
        fail(f"--ngram must be >= 0, got {ngram}")
    from .spec import DecodeSpec

    # the drafter as the checkpoint holds it, eager: what is measured here must not be fitted already
    m = MedusaModel.from_pretrained(model, DecodeSpec(drafter=str(heads), ngram=ngram, compile=CompileMode.OFF, exact=False,
                                                      calibration=CalibrationMode.SHIPPED), dtype=dtype, device=device)
    texts = cal.calibration_prompts(prompts, limit)
    if not m.drafter.fits_tree:
        _calibrate_drafter(m, texts, max_new_tokens, heads, out, grid)
        return
    sequences = []
    with typer.progressbar(texts, label="greedy answers", file=sys.stderr) as bar:
        for text in bar:
            ids = m.encode(text)
            answer = m.generate(ids, max_new_tokens=max_new_tokens)
            sequences.append((ids.shape[1], torch.cat([ids[0].cpu(), torch.tensor(answer.token_ids)])))
    accuracy = cal.head_accuracy(m.base, m.heads, sequences)
    typer.echo("measuring verification latency ...", err=True)
    latency = cal.verify_latency(m.backend)
    result = cal.fit(accuracy, latency, cal.heads_latency(m.backend, m.heads))
    target = out or heads / "tree.json"
    cal.save(result, target)
    typer.echo("head  top-1  top-5  top-10")
    for k, row in enumerate(accuracy, start=1):
        typer.echo(f"{k:>4}  {row[0]:5.3f}  {sum(row[:5]):5.3f}  {sum(row):6.3f}")
    typer.echo("nodes  expected tau  cost  expected speed-up")
    for c in result.curve:
        mark = "  <- chosen" if c["n"] == result.best["n"] else ""
        typer.echo(f"{c['n']:>5}  {c['expected_tau']:12.2f}  {c['cost']:4.2f}  {c['expected_speedup']:17.2f}{mark}")
    typer.echo(f"saved {target}", err=True)


def _calibrate_drafter(m, texts: list[str], max_new_tokens: int, heads: Path, out: Optional[Path], grid: bool) -> None:
    """A hydra/eagle drafter: its acceptance at every budget (saved with the checkpoint), then the
    budget fitted to this machine; grid: also every drafting setting against plain decoding."""
    import shutil

    from . import calibrate as cal

    folder = out or heads
    if out is not None:
        shutil.copytree(heads, out, dirs_exist_ok=True)
    inputs = [m.encode(t) for t in texts]
    ngram, m.ngram = m.ngram, None  # the drafter's own acceptance: no n-gram branch
    with typer.progressbar(length=len(inputs), label="acceptance by budget", file=sys.stderr) as bar:
        accepted = cal.acceptance_curve(m, inputs, max_new_tokens, progress=lambda i: bar.update(1))
    m.ngram = ngram
    cal.save_acceptance(accepted, folder)
    m.drafter.source = folder
    typer.echo(f"saved {folder / cal.ACCEPTANCE_NAME} ({accepted['steps']} steps)", err=True)
    fit = m.fit_to_machine(refresh=True)
    typer.echo("budget  n-gram chain  expected tau  cost  expected speed-up (this machine)")
    for r in fit.table:
        mark = "  <- chosen" if r["budget"] == fit.budget and fit.chain in (None, r["chain"]) else ""
        typer.echo(f"{r['budget']:>6}  {r['chain']:>12}  {r['expected_tau']:12.2f}  {r['cost']:4.2f}  "
                   f"{r['expected_speedup']:17.2f}{mark}")
    typer.echo(fit.line, err=True)
    if not grid:
        return
    with typer.progressbar(length=len(inputs), label=f"{len(cal.DRAFT_GRID)} drafting settings x plain",
                           file=sys.stderr) as bar:
        result = cal.fit_drafter(m, inputs, max_new_tokens, progress=lambda i: bar.update(1))
    cal.save_drafter_fit(result, folder)
    typer.echo("depth  width  budget  tau   tok/s  speed-up vs plain (median)")
    for r in sorted(result["grid"], key=lambda r: -r["median_speedup"]):
        mark = "  <- chosen" if r is result["best"] else ""
        typer.echo(f"{r['depth']:>5}  {r['width']:>5}  {r['budget']:>6}  {r['mean_accepted_length']:4.2f}  "
                   f"{r['tokens_per_s']:6.1f}  {r['median_speedup']:5.2f}{mark}")
    typer.echo(f"saved the chosen setting in {folder / 'config.json'}, the grid in {folder / 'calibration.json'}", err=True)


@app.command()
def export(
    heads: Path = typer.Argument(..., help="A drafter's checkpoint folder (Medusa heads: ours or FasterDecoding's)."),
    out: Path = typer.Argument(..., help="Folder to write."),
    format: str = typer.Option("vllm", "--format", help="vllm: vLLM's Medusa speculator (residual Medusa heads); speculators, sglang: EAGLE-3 drafters."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="The base model the drafter was trained on."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, bfloat16 or float16; default: the checkpoint's own."),
) -> None:
    """Write a drafter in another engine's format, for vLLM to serve (docs/VLLM.md)."""
    import torch

    from .models import load_base
    from .proposers import EXPORT_FORMATS, export as export_drafter

    if format not in EXPORT_FORMATS:
        fail(f"unknown format {format!r}; use one of {', '.join(EXPORT_FORMATS)}")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        fail(f"--dtype {dtype}: use float32, bfloat16 or float16")
    if not heads.is_dir():
        fail(f"{heads}: no such folder")
    base, _, _ = load_base(model, dtype="float32", device="cpu")
    kind = export_drafter(heads, base, format, out, getattr(torch, dtype) if dtype else None)
    typer.echo(f"wrote {out}: {kind} drafter in the {format} format", err=True)


@app.command()
def train(
    out: Path = typer.Option(..., "--out", help="Folder for the heads, checkpoints, features, log.jsonl and metrics.json."),
    model: str = ModelOpt,
    data: str = typer.Option(TrainConfig.data, "--data", help="A distill-data folder (its recorded features are used: the base does not run), 'sharegpt' or a JSON/JSONL file."),
    drafter: str = typer.Option(TrainConfig.drafter, "--drafter", help="medusa: heads on h_t; hydra: heads that also read their branch's tokens; eagle: a one-layer feature drafter."),
    init: Optional[str] = typer.Option(TrainConfig.init, "--init", help="Warm start: a checkpoint folder of the --drafter kind, or 'shipped' (the built-in model's); its shape and shortlist are kept."),
    heads: int = typer.Option(TrainConfig.num_heads, "--heads", help="Number of heads K (hydra: the deepest level drafted)."),
    recipe: str = typer.Option(TrainConfig.recipe, "--recipe", help="eagle: eagle1 (last-layer feature, + --feature-weight) or eagle3 (low/middle/last features fused, token loss only, 7 passes)."),
    fused: bool = typer.Option(TrainConfig.fused, "--fused", help="hydra: heads read the base's low, middle and last layers fused (recorded by distill-data), not the last alone."),
    unroll: Optional[int] = typer.Option(TrainConfig.unroll, "--unroll", help="eagle: training passes on its own predicted features (depths trained); default: the recipe's (3 or 7)."),
    layers: int = typer.Option(TrainConfig.num_layers, "--layers", help="Residual blocks per head."),
    inner_size: int = typer.Option(TrainConfig.inner_size, "--inner-size", help="0: Medusa's ResBlock x + SiLU(Wx + b); N: an MLP block x + W2 SiLU(W1 x) of inner width N."),
    own_lm_head: bool = typer.Option(TrainConfig.own_lm_head, "--own-lm-head", help="Train an LM head per head (large) instead of sharing the base's."),
    targets: str = typer.Option(TrainConfig.targets, "--targets", help="tokens: the data's tokens; kd: the base model's distribution."),
    feature_weight: float = typer.Option(TrainConfig.feature_weight, "--feature-weight", help="Weight of the EAGLE-style feature regression term."),
    vocab_fraction: float = typer.Option(TrainConfig.vocab_fraction, "--vocab-fraction", help="Share of positions that pay the vocabulary-wide loss."),
    train_vocab: int = typer.Option(TrainConfig.train_vocab, "--train-vocab", help="Vocabulary losses over only the N most frequent label tokens (0: all)."),
    decay: float = typer.Option(TrainConfig.decay, "--decay", help="Head k's loss weight is decay**(k-1)."),
    epochs: float = typer.Option(TrainConfig.epochs, "--epochs"),
    lr: float = typer.Option(TrainConfig.lr, "--lr"),
    warmup_steps: int = typer.Option(TrainConfig.warmup_steps, "--warmup-steps"),
    batch_size: int = typer.Option(TrainConfig.batch_size, "--batch-size", help="Positions per step and process."),
    grad_accum: int = typer.Option(TrainConfig.grad_accum, "--grad-accum"),
    max_length: int = typer.Option(TrainConfig.max_length, "--max-length"),
    max_conversations: Optional[int] = typer.Option(TrainConfig.max_conversations, "--max-conversations"),
    eval_conversations: int = typer.Option(TrainConfig.eval_conversations, "--eval-conversations"),
    save_every: int = typer.Option(TrainConfig.save_every, "--save-every"),
    seed: int = typer.Option(TrainConfig.seed, "--seed"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    mixed_precision: str = typer.Option(TrainConfig.mixed_precision, "--mixed-precision", help="no, bf16, fp16 or auto."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in --out."),
) -> None:
    """Train Medusa heads, or a hydra/eagle drafter, on a frozen base model, on HF Accelerate."""
    from .train import metrics_table, train as run_training

    cfg = TrainConfig(
        model=model, data=data, out=str(out), drafter=drafter, init=init, recipe=recipe, fused=fused, unroll=unroll, num_heads=heads, num_layers=layers, inner_size=inner_size, own_lm_head=own_lm_head,
        targets=targets, feature_weight=feature_weight, vocab_fraction=vocab_fraction, train_vocab=train_vocab, decay=decay, epochs=epochs, lr=lr,
        warmup_steps=warmup_steps, batch_size=batch_size, grad_accum=grad_accum, max_length=max_length,
        max_conversations=max_conversations, eval_conversations=eval_conversations, save_every=save_every,
        seed=seed, dtype=dtype, device=device, mixed_precision=mixed_precision,
    )
    metrics = run_training(cfg, resume=resume)
    if "interrupted_at" in metrics:
        raise typer.Exit(130)
    typer.echo(metrics_table(metrics))


@app.command()
def evaluate(
    heads: str = typer.Option(..., "--heads", help="A drafter's checkpoint folder, or 'shipped' (the built-in model's default drafter)."),
    data: Path = typer.Option(..., "--data", help="A distill-data folder: its held-out split's recorded features are scored."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Score the first N held-out conversations (default: all)."),
    unroll: int = typer.Option(5, "--unroll", help="Depths an EAGLE drafter is scored at (its own outputs fed back, as it drafts)."),
) -> None:
    """Held-out top-1 / top-5 per depth of a drafter on a distill-data folder (no decoding: the
    folder's recorded features; compares checkpoints trained on other data on the same split)."""
    from .train import evaluate_checkpoint, metrics_table

    if limit is not None and limit < 1:
        fail(f"--limit must be >= 1, got {limit}")
    if unroll < 1:
        fail(f"--unroll must be >= 1, got {unroll}")
    if heads != "shipped" and not Path(heads).is_dir():
        fail(f"--heads {heads}: no such folder")
    typer.echo(metrics_table({"eval": evaluate_checkpoint(heads, data, limit, unroll)}))


@app.command()
def bench(
    model: str = ModelOpt,
    heads: Optional[Path] = HeadsOpt,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL in Spec-Bench's format: question_id, category, turns; an optional \"schema\" (a JSON schema) decodes that prompt's answers under it."),
    suite: Optional[str] = typer.Option(None, "--suite", help="builtin (the default: 3 prompts for each of Spec-Bench's 13 categories, shipped with the package), json (24 extraction and generation prompts, each decoded under its JSON schema; schema validity reported), spec-bench (the file $MEDUSA_SPEC_BENCH names), humaneval or sharegpt (held-out first turns)."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated: plain, default (what generate runs with no method options), medusa, dynamic, hydra, eagle, hf, hf-pld; plain/medusa/dynamic/hydra/eagle+ngram add an n-gram branch (from the context, else from --datastore when given); default/hydra/eagle@shipped keep the checkpoint's own budget; @exact runs one in exact mode, @compiled on the saved compiled graphs, @stock eager on the stock linear layers (no prepacked weights), @serve through the OpenAI server (medusa serve) in this process, one request at a time; llama.cpp: the same GGUF decoded by llama.cpp; vllm, vllm-ngram, vllm-medusa: vLLM on the same model, plain, with its n-gram speculation, with the Medusa heads exported (make vllm first; docs/VLLM.md) (default: plain,default,hf,hf-pld)."),
    ngram: int = typer.Option(NgramConfig.length, "--ngram-length", help="Tokens of the n-gram branch of +ngram methods."),
    copy_run: int = typer.Option(NgramConfig.copy_run, "--ngram-copy-run", help="Chain tokens accepted in a step after which the n-gram chain is verified alone (copy steps); 0: never, the chain beside every tree."),
    datastore: Optional[Path] = DatastoreOpt,
    tree_budget: Optional[int] = typer.Option(None, "--tree-budget", help="Nodes of the dynamic tree (default 16) or of a hydra/eagle drafter's tree (default: its own)."),
    tree: list[Path] = typer.Option([], "--tree", help="Tree JSON file (repeatable): one method medusa:<file stem> each."),
    drafter: list[Path] = typer.Option([], "--drafter", help="A hydra or eagle checkpoint (repeatable) for methods hydra/eagle; default: the shipped ones."),
    limit: Optional[int] = typer.Option(None, "--limit", help="First N prompts of each category."),
    turns: Optional[int] = typer.Option(None, "--turns", help="Turns per prompt (default: all; 1: first turns only)."),
    max_new_tokens: int = typer.Option(BenchConfig.max_new_tokens, "--max-new-tokens", "-n", help="Per turn."),
    temperature: float = typer.Option(BenchConfig.temperature, "--temperature", "-t", help="0 is greedy; > 0 samples (seeded) and skips identity checks."),
    seed: int = typer.Option(BenchConfig.seed, "--seed"),
    repeats: int = typer.Option(BenchConfig.repeats, "--repeats", help="Rounds of every method per prompt."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder (default: bench_out/<timestamp>)."),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes", help="Comma-separated, e.g. 1,2,4,8,16: also measure plain vs default (load-adaptive budgets, as medusa serve runs it) under continuous batching at each batch size (first turns, greedy)."),
    batch_only: bool = typer.Option(BenchConfig.batch_only, "--batch-only", help="Only the --batch-sizes measurement, no per-prompt method comparison."),
    compile: bool = typer.Option(BenchConfig.compile, "--compile/--no-compile", help="Our engine's methods on the compiled verification step, every graph built (or loaded from $MEDUSA_CACHE) before it is timed; default: eager."),
    calibration: str = CalibrationOpt,
) -> None:
    """Methods side by side on the same prompts: results.json, report.md and plots in --out."""
    from .bench import parse_batch_sizes, run_bench

    cfg = BenchConfig(
        model=model, heads=str(heads) if heads else None, prompts=str(prompts) if prompts else None, suite=suite,
        methods=methods, trees=[str(t) for t in tree], drafters=[str(d) for d in drafter], limit=limit, turns=turns, max_new_tokens=max_new_tokens,
        temperature=temperature, seed=seed, repeats=repeats, dtype=dtype, device=device, out=str(out) if out else None,
        ngram_length=ngram, ngram_copy_run=copy_run, tree_budget=tree_budget,
        batch_sizes=parse_batch_sizes(batch_sizes) if batch_sizes is not None else None, batch_only=batch_only,
        compile=compile, calibration=calibration, datastore=str(datastore) if datastore else None,
    )
    run_bench(cfg)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for noisy in ("transformers", "httpx", "urllib3", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from typer._click import exceptions as click  # typer vendors its own click

    try:
        code = app(standalone_mode=False)
    except MedusaError as e:
        typer.echo(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", err=True)
        sys.exit(2)
    except click.NoArgsIsHelpError:  # the help text is already printed
        sys.exit(0)
    except click.UsageError as e:  # bad or missing option: one line, and where to look
        hint = f" (see 'medusa {e.ctx.info_name} --help')" if e.ctx is not None else ""
        typer.echo(f"error: {e.format_message()}{hint}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
