"""Self-distillation on a tiny random base: the features recorded while decoding are the base's own
hidden states at every position, the assistant mask covers the answers (follow-up turns too),
a kill and a rerun give what one uninterrupted run gives, duplicates and benchmark prompts never
enter the data, and an EAGLE-3 drafter trains on the folder without running the base again."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from medusa_decoding.bench.prompts import load_jsonl_prompts
from medusa_decoding.config import DistillConfig, MedusaError
from medusa_decoding.data import Contamination, is_held_out
from medusa_decoding.distill import distill, read_done
from medusa_decoding.packs import unpack as unpack_file
from medusa_decoding.engine import MedusaModel
from medusa_decoding.models import load_base
from medusa_decoding.train import train
from medusa_decoding.training import load_positions

from conftest import run_cli, save_tiny
from test_train import cfg as train_cfg

CFG = DistillConfig(max_new_tokens=12, batch_size=4, max_length=200, shard_size=3, turns=2)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory, with_heads=False)[0]


def chats(path, n=10, follow_ups=True, held_out=0):
    """ShareGPT-shaped records; every other one has a second user turn; the last `held_out` have
    ids of the fixed held-out split."""
    spare = (f"h{j}" for j in range(100000) if is_held_out(f"h{j}"))
    with path.open("w") as f:
        for i in range(n):
            sep = "\u2028" if i == 1 else " "  # a line separator inside a JSON string (str.splitlines splits there)
            turns = [{"from": "human", "value": f"question {i}:{sep}what comes after {i * 7}?"},
                     {"from": "gpt", "value": "(the source's answer, never used)"}]
            if follow_ups and i % 2:
                turns += [{"from": "human", "value": f"and after {i * 7 + 1}?"}]
            f.write(json.dumps({"id": next(spare) if i >= n - held_out else f"q{i}", "conversations": turns}) + "\n")
    return path


def records(folder):
    """id -> (ids, mask, hidden, lower) over every shard."""
    return records_of(sorted((folder / "features").glob("*.safetensors")))


def records_of(shards):
    """id -> (ids, mask, hidden, lower) over these shards, in their order."""
    out = {}
    for shard in shards:
        data = load_file(shard)
        with safe_open(shard, "pt") as f:
            ids = json.loads(f.metadata()["ids"])
        off = data["offsets"].tolist()
        for k, cid in enumerate(ids):
            a, b = off[k], off[k + 1]
            out[cid] = tuple(data[key][a:b] for key in ("ids", "mask", "hidden", "lower"))
    return out


def test_recorded_features_are_the_base_hidden_states_and_the_mask_covers_the_answers(base_dir, tmp_path):
    data = chats(tmp_path / "c.jsonl")
    counts = distill(str(base_dir), tmp_path / "d", source=str(data), cfg=CFG, dtype="float32", device="cpu",
                     progress=False)
    assert counts["written"] == 10 and counts["2-turn conversations"] == 5
    model, tok, _ = load_base(str(base_dir), dtype="float32", device="cpu")
    recs = records(tmp_path / "d")
    texts = {json.loads(line)["id"]: json.loads(line) for line in (tmp_path / "d" / "data.jsonl").read_text().split("\n") if line.strip()}
    assert set(recs) == set(texts) == {f"q{i}" for i in range(10)}
    for cid, (ids, mask, hidden, lower) in recs.items():
        with torch.no_grad():
            hs = model.get_decoder()(input_ids=ids[None], output_hidden_states=True).hidden_states
        # every position but the last (never verified: zeros), to bf16's precision
        torch.testing.assert_close(hidden[:-1].float(), hs[2][0, :-1], atol=0.05, rtol=0.02)
        torch.testing.assert_close(lower[:-1].float(), hs[1][0, :-1], atol=0.05, rtol=0.02)
        assert not hidden[-1].any()
        turns = texts[cid]["conversations"]
        answers = [t["value"] for t in turns if t["from"] == "gpt"]
        assert len(answers) == (2 if int(cid[1:]) % 2 else 1)
        assert "(the source's answer" not in json.dumps(turns)
        masked = tok.decode(ids[mask.bool()], skip_special_tokens=True)
        assert masked.replace("\n", "") == "".join(answers).replace("\n", "")  # answers, nothing else
        assert tok.decode(ids[~mask.bool()], skip_special_tokens=True).count("question") == 1
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["conversations"] == 10 and manifest["conversations_per_minute"] > 0


def test_a_killed_run_resumed_equals_an_uninterrupted_one(base_dir, tmp_path):
    data = chats(tmp_path / "c.jsonl", n=9)
    kw = dict(source=str(data), cfg=CFG, dtype="float32", device="cpu", progress=False)
    distill(str(base_dir), tmp_path / "full", **kw)
    first = distill(str(base_dir), tmp_path / "resumed", stop_after=4, **kw)
    assert 4 <= first["written"] < 9 and first["interrupted (not written; resumed next run)"] > 0
    second = distill(str(base_dir), tmp_path / "resumed", **kw)
    assert second["already done"] == first["written"] and second["written"] == 9 - first["written"]
    a, b = records(tmp_path / "full"), records(tmp_path / "resumed")
    assert set(a) == set(b)
    for cid in a:
        assert torch.equal(a[cid][0], b[cid][0]) and torch.equal(a[cid][1], b[cid][1]), cid
        torch.testing.assert_close(a[cid][2].float(), b[cid][2].float(), atol=0.05, rtol=0.02)
    lines = [line for line in (tmp_path / "resumed" / "data.jsonl").read_text().split("\n") if line.strip()]
    assert len(lines) == 9 == len({json.loads(line)["id"] for line in lines})
    assert sum(len(v) for v in read_done(tmp_path / "resumed").values()) == 9
    with pytest.raises(MedusaError, match="other settings"):
        distill(str(base_dir), tmp_path / "resumed", source=str(data), cfg=DistillConfig(max_new_tokens=5, batch_size=4),
                dtype="float32", device="cpu", progress=False)


def test_duplicates_and_planted_benchmark_prompts_never_enter_the_data(base_dir, tmp_path, capsys, monkeypatch):
    bench = tmp_path / "question.jsonl"
    question = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."
    with bench.open("w") as f:
        f.write(json.dumps({"question_id": 81, "category": "writing", "turns": [question, "Rewrite it."]}) + "\n")
        f.write(json.dumps({"question_id": 82, "category": "math", "turns": ["What is 2 + 3 * 4?"]}) + "\n")
    index = Contamination({f"spec-bench:{p.id}:{i}": t for p in load_jsonl_prompts(bench) for i, t in enumerate(p.turns)})
    assert index.match(question.upper() + "!!") == "spec-bench:81:0"  # exact after normalising
    assert index.match(f"Hi there. {question[:-1]} and the food, please.") == "spec-bench:81:0"  # near duplicate
    assert index.match("what is 2 + 3 * 4") == "spec-bench:82:0"
    assert index.match("Compose a poem about Hawaii.") is None
    path = tmp_path / "c.jsonl"
    rows = [[question], ["Tell me a joke."], ["tell me a JOKE"], ["Plan a trip.", "what is 2+3*4?"],
            [f"Please: {question}"], ["Name three colours."]]
    with path.open("w") as f:
        for i, users in enumerate(rows):
            turns = [t for u in users for t in ({"from": "human", "value": u}, {"from": "gpt", "value": "x"})]
            f.write(json.dumps({"id": f"r{i}", "conversations": turns}) + "\n")
    monkeypatch.setenv("MEDUSA_SPEC_BENCH", str(bench))
    run_cli(capsys, monkeypatch, "distill-data", "--model", str(base_dir), "--data", str(path), "--out",
            str(tmp_path / "d"), "--max-new-tokens", "8", "--batch-size", "2", "--turns", "2", "--exclude", "spec-bench",
            "--dtype", "float32", "--device", "cpu")
    kept = {json.loads(line)["id"] for line in (tmp_path / "d" / "data.jsonl").read_text().split("\n") if line.strip()}
    assert kept == {"r1", "r5"}  # r0, r4: the question; r2: r1 again; r3: its follow-up is a benchmark's
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["counts"]["matches a benchmark prompt"] == 3 and manifest["counts"]["duplicate prompt"] == 1


def test_eagle3_trains_on_a_distilled_folder_and_drafts_losslessly(base_dir, tmp_path, capsys, monkeypatch):
    data = chats(tmp_path / "c.jsonl", n=28, held_out=4)
    distill(str(base_dir), tmp_path / "d", source=str(data), cfg=CFG, dtype="float32", device="cpu", progress=False)
    metrics = train(train_cfg(base_dir, tmp_path / "d", tmp_path / "run", drafter="eagle", recipe="eagle3", unroll=5,
                              train_vocab=64, batch_size=128, epochs=2, eval_conversations=8), progress=False)
    assert metrics["recipe"] == "eagle3" and metrics["feature_layers"] == [1, 2]
    assert len(metrics["eval"]["top1"]) == 5 and metrics["eval"]["positions"][0] > 0  # per pass: depths 1-5
    assert len(list((tmp_path / "d" / "features").glob("eval-*"))) >= 1
    assert not (tmp_path / "run" / "features").exists()  # the base never ran for features
    m = MedusaModel.from_pretrained(str(base_dir), heads=tmp_path / "run", compile="off", dtype="float32",
                                    device="cpu")
    assert m.drafter.feature_layers == (1, 2)
    plain = m.generate("question 3: what comes", max_new_tokens=30, use_medusa=False)
    spec = m.generate("question 3: what comes", max_new_tokens=30)
    assert spec.token_ids == plain.token_ids
    # `medusa evaluate` scores the saved drafter as training scored it, from the same features
    code, out, _ = run_cli(capsys, monkeypatch, "evaluate", "--heads", tmp_path / "run", "--data", tmp_path / "d",
                           "--limit", "8", "--unroll", "5")
    assert code == 0 and [float(r.split()[1]) for r in out.strip().splitlines()[1:]] == pytest.approx(
        metrics["eval"]["top1"], abs=6e-4)
    with pytest.raises(MedusaError, match="no feature loss"):
        train_cfg(base_dir, tmp_path / "d", tmp_path / "x", drafter="eagle", recipe="eagle3", feature_weight=1.0)
    with pytest.raises(MedusaError, match="eagle drafter"):
        train_cfg(base_dir, tmp_path / "d", tmp_path / "x", drafter="hydra", recipe="eagle3")


@pytest.mark.parametrize("fused", [False, True], ids=["hydra", "hydra-fused"])
def test_evaluate_scores_a_hydra_checkpoint_as_training_did_and_refuses_what_it_cannot_score(base_dir, tmp_path, capsys,
                                                                                            monkeypatch, fused):
    data = chats(tmp_path / "c.jsonl", n=16, held_out=4)
    distill(str(base_dir), tmp_path / "d", source=str(data), cfg=CFG, dtype="float32", device="cpu", progress=False)
    metrics = train(train_cfg(base_dir, tmp_path / "d", tmp_path / "run", drafter="hydra", train_vocab=64,
                              batch_size=32, epochs=1, eval_conversations=8, fused=fused), progress=False)
    assert metrics["feature_layers"] == ([1, 2] if fused else None)
    if fused:
        # training reads, at every position, what the verifier gives the drafter at inference: the
        # recorded layers 1 and 2 in that order (tests/test_drafters.py checks the verifier's side)
        shards = sorted((tmp_path / "d" / "features").glob("train-*.safetensors"))
        pos = load_positions(shards, 4, fused=True)
        want = torch.cat([torch.cat([r[3], r[2]], -1) for r in records_of(shards).values()])
        assert torch.equal(pos.features(torch.arange(want.shape[0])), want)
        m = MedusaModel.from_pretrained(str(base_dir), heads=tmp_path / "run", compile="off", dtype="float32",
                                    device="cpu")
        assert m.drafter.feature_layers == (1, 2)
        plain = m.generate("question 3: what comes", max_new_tokens=30, use_medusa=False)
        assert m.generate("question 3: what comes", max_new_tokens=30).token_ids == plain.token_ids
        with pytest.raises(MedusaError, match="reads fused features; pass --fused"):
            train(train_cfg(base_dir, tmp_path / "d", tmp_path / "warm", drafter="hydra", init=str(tmp_path / "run"),
                            train_vocab=64, batch_size=32, epochs=0.1), progress=False)
    code, out, _ = run_cli(capsys, monkeypatch, "evaluate", "--heads", tmp_path / "run", "--data", tmp_path / "d")
    rows = out.strip().splitlines()[1:]
    assert code == 0 and len(rows) == len(metrics["eval"]["top1"])
    assert [int(r.split()[3]) for r in rows] == metrics["eval"]["positions"]
    assert [float(r.split()[1]) for r in rows] == pytest.approx(metrics["eval"]["top1"], abs=6e-4)
    for args, said in [(("--heads", tmp_path / "nope", "--data", tmp_path / "d"), "no such folder"),
                       (("--heads", tmp_path / "run", "--data", tmp_path), "not a distill-data folder"),
                       (("--heads", tmp_path / "run", "--data", tmp_path / "d", "--limit", "0"), "--limit must be >= 1"),
                       (("--heads", "shipped", "--data", tmp_path / "d"), "no drafter is shipped")]:
        code, _, err = run_cli(capsys, monkeypatch, "evaluate", *args)
        assert code == 2 and said in err, (args, err)


def test_a_packed_folder_unpacks_to_the_same_conversations_and_resumes(base_dir, tmp_path, capsys, monkeypatch):
    """--pack keeps token ids and spans only; --unpack rebuilds the shards (features by one forward,
    to bf16 precision), data.jsonl and the manifest, and a later run goes on from there."""
    data = chats(tmp_path / "c.jsonl", n=9, held_out=2)
    kw = dict(source=str(data), cfg=CFG, dtype="float32", device="cpu", progress=False)
    distill(str(base_dir), tmp_path / "d", stop_after=5, **kw)
    packed = tmp_path / "d.jsonl.gz"
    code, _, err = run_cli(capsys, monkeypatch, "distill-data", "--out", tmp_path / "d", "--pack", packed)
    written = len(records(tmp_path / "d"))
    assert code in (0, None) and f"packed {written} conversations" in err
    assert packed.stat().st_size < 0.2 * sum(p.stat().st_size for p in (tmp_path / "d" / "features").iterdir())
    code, _, err = run_cli(capsys, monkeypatch, "distill-data", "--out", tmp_path / "u", "--unpack", packed,
                           "--data", data, "--device", "cpu")
    assert code in (0, None) and f"rebuilt {written} conversations" in err
    a, b = records(tmp_path / "d"), records(tmp_path / "u")
    assert set(a) == set(b) and len(a) == written
    for cid in a:
        assert torch.equal(a[cid][0], b[cid][0]) and torch.equal(a[cid][1], b[cid][1]), cid
        for k in (2, 3):
            torch.testing.assert_close(a[cid][k].float(), b[cid][k].float(), atol=0.05, rtol=0.02)
    texts = [{json.loads(line)["id"]: json.loads(line) for line in (tmp_path / f / "data.jsonl").read_text().split("\n")
              if line.strip()} for f in ("d", "u")]
    assert texts[0].keys() == texts[1].keys()
    for cid, record in texts[0].items():  # an earlier turn's answer is rebuilt from its re-rendered tokens
        turns, again = record["conversations"], texts[1][cid]["conversations"]
        assert [t for t in turns if t["from"] == "human"] == [t for t in again if t["from"] == "human"]
        assert turns[-1] == again[-1] and record["finish"] == texts[1][cid]["finish"]
    assert json.loads((tmp_path / "u" / "manifest.json").read_text())["tokens"] == json.loads(
        (tmp_path / "d" / "manifest.json").read_text())["tokens"]
    assert unpack_file(packed, tmp_path / "u", source=str(data), device="cpu", progress=False) == 0  # nothing to redo
    # a datastore reads the same training answers from the folder and from its pack, the chat header before each
    from medusa_decoding.packs import answers_of
    from medusa_decoding.datastore import LEAD, Datastore

    answers = list(answers_of(tmp_path / "d"))
    assert answers == list(answers_of(packed))
    kept = records(tmp_path / "d")
    train = [r for r in kept if not is_held_out(r)]
    masks = [kept[r][1].bool() for r in train]
    assert len(answers) == sum(int(m[0]) + int((m[1:] & ~m[:-1]).sum()) for m in masks)  # one a run of the mask
    ids, mask = kept[train[0]][:2]
    start = int(mask.nonzero()[0])
    assert answers[0][:LEAD + 1] == ids[start - LEAD: start + 1].tolist()
    code, _, err = run_cli(capsys, monkeypatch, "datastore", "--data", packed, "--out", tmp_path / "ds.safetensors")
    assert code in (0, None) and f"{len(answers)} answers" in err
    assert Datastore.load(tmp_path / "ds.safetensors").size == sum(len(a) + 1 for a in answers)
    more = distill(str(base_dir), tmp_path / "u", **kw)
    assert more["already done"] == written and more["written"] == 9 - written
