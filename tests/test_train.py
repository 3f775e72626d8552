"""Head training on a tiny random base: loss falls, targets are aligned, KD is what it claims,
resume reproduces an uninterrupted run, two accelerate processes agree, bad data is counted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from medusa_decoding.config import MedusaError, TrainConfig
from medusa_decoding.heads import MedusaHeads
from medusa_decoding.train import train
from medusa_decoding.training import IGNORE, Positions, head_losses, load_positions

from conftest import save_tiny


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory, with_heads=False)[0]


def counting_data(path: Path, n: int = 120, seed: int = 0) -> Path:
    """Answers that count up from a random start: the token k+1 steps ahead is predictable."""
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for i in range(n):
            a = int(torch.randint(0, 40, (1,), generator=g))
            answer = " ".join(str(a + j) for j in range(25))
            f.write(json.dumps({"id": f"c{i}", "conversations": [
                {"from": "human", "value": f"count from {a}"}, {"from": "gpt", "value": answer}]}) + "\n")
    return path


def cfg(base_dir, data, out, **kw):
    defaults = dict(model=str(base_dir), data=str(data), out=str(out), dtype="float32", device="cpu",
                    mixed_precision="no", batch_size=64, warmup_steps=2, lr=3e-3, eval_conversations=20,
                    max_length=200, log_every=5)
    return TrainConfig(**(defaults | kw))


def test_loss_decreases_and_metrics_are_written(base_dir, tmp_path):
    data = counting_data(tmp_path / "d.jsonl")
    metrics = train(cfg(base_dir, data, tmp_path / "run", epochs=2, targets="tokens"), progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.7 * log[0]["loss"]
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["eval"]["top1"] == metrics["eval"]["top1"] and len(saved["eval"]["top1"]) == 4
    heads = MedusaHeads.from_pretrained(tmp_path / "run")
    assert heads.config.medusa_num_heads == 4


def test_label_alignment_is_learned(base_dir, tmp_path):
    """A sequence where token t+k+1 is a function of token t: head k reaches ~100% top-1.
    Only the first k labels of an answer (its random start) and its end are unpredictable:
    with 150-token answers that is under 5% of the positions."""
    g = torch.Generator().manual_seed(0)
    with (tmp_path / "d.jsonl").open("w") as f:
        for i in range(80):
            start = int(torch.randint(0, 20, (1,), generator=g))
            answer = "".join(chr(ord("A") + (start + j) % 20) for j in range(150))  # A..T cycling
            f.write(json.dumps({"id": f"s{i}", "conversations": [
                {"from": "human", "value": "go"}, {"from": "gpt", "value": answer}]}) + "\n")
    metrics = train(cfg(base_dir, tmp_path / "d.jsonl", tmp_path / "run", epochs=6, own_lm_head=True,
                        targets="tokens", num_layers=2, inner_size=256, lr=5e-3), progress=False)
    top1 = metrics["eval"]["top1"]
    assert min(top1) > 0.94, top1


def test_positions_align_heads_with_future_tokens(base_dir, tmp_path):
    counting_data(tmp_path / "d.jsonl", n=3)
    from safetensors.torch import save_file
    ids = torch.arange(10, 20)  # one sequence: tokens 10..19, assistant from index 4
    mask = torch.zeros(10, dtype=torch.uint8)
    mask[4:] = 1
    hidden = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 3)  # hidden[t] = t
    save_file({"hidden": hidden, "ids": ids, "mask": mask, "offsets": torch.tensor([0, 10])}, tmp_path / "s.st")
    pos = load_positions([tmp_path / "s.st"], num_heads=2)
    for row in range(len(pos)):
        t = int(pos.index[row])
        for k in range(2):  # head k+1 at t learns token t+k+2, predicted by the base at t+k+1
            label_at = t + k + 2
            if label_at < 10 and mask[label_at]:
                assert pos.labels[row, k] == ids[label_at]
                assert pos.target_index[row, k] == label_at - 1
            else:
                assert pos.labels[row, k] == IGNORE
    assert pos.index.tolist() == [1, 2, 3, 4, 5, 6, 7]  # t=1: head 2 learns token 4, the first of the answer


def test_kd_target_is_the_base_distribution_at_t_plus_k():
    torch.manual_seed(0)
    d, v = 8, 11
    lm_head = torch.nn.Linear(d, v, bias=False)
    heads = MedusaHeads(__import__("medusa_decoding.config", fromlist=["HeadsConfig"]).HeadsConfig(
        medusa_num_heads=2, hidden_size=d, vocab_size=v))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    hidden = torch.randn(6, d)
    pos = Positions(hidden=hidden, index=torch.tensor([0, 1]), labels=torch.tensor([[3, 4], [5, IGNORE]]),
                    target_index=torch.tensor([[1, 2], [2, 3]]))
    c = TrainConfig(targets="kd", decay=0.5)
    loss, _ = head_losses(heads, lm_head, pos, torch.tensor([0, 1]), c)
    with torch.no_grad():
        q = torch.log_softmax(heads(hidden[:2], lm_head), -1)  # [K, 2, V]
        p = torch.log_softmax(lm_head(hidden), -1)  # [6, V]
        # head 1 at t=0,1 -> base at t+1 = 1, 2; head 2 at t=0 -> base at 2 (t=1's label is ignored)
        kl = lambda lp, lq: (lp.exp() * (lp - lq)).sum(-1)
        head1 = (kl(p[1], q[0, 0]) + kl(p[2], q[0, 1])) / 2
        head2 = kl(p[2], q[1, 0])
    torch.testing.assert_close(loss, head1 + 0.5 * head2)


def weights(folder):
    from safetensors.torch import load_file
    return load_file(Path(folder) / "model.safetensors")


def test_resume_reaches_the_same_weights(base_dir, tmp_path):
    data = counting_data(tmp_path / "d.jsonl", n=60)
    full = cfg(base_dir, data, tmp_path / "full", epochs=2, save_every=1000)
    train(full, progress=False)
    split = cfg(base_dir, data, tmp_path / "split", epochs=2, save_every=1000)
    assert train(split, progress=False, stop_after=7) == {"interrupted_at": 7}
    with pytest.raises(MedusaError, match="--resume"):
        train(split, progress=False)
    train(split, resume=True, progress=False)
    a, b = weights(tmp_path / "full"), weights(tmp_path / "split")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_two_processes_under_accelerate_launch_agree(base_dir, tmp_path):
    data = counting_data(tmp_path / "d.jsonl", n=60)
    out = tmp_path / "ddp"
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, torch\n"
        "torch.set_num_threads(1)\n"
        "from medusa_decoding.config import TrainConfig\n"
        "from medusa_decoding.train import train\n"
        f"train(TrainConfig(model={str(base_dir)!r}, data={str(data)!r}, out={str(out)!r}, dtype='float32',\n"
        "    device='cpu', mixed_precision='no', batch_size=32, epochs=1, warmup_steps=1, max_length=200,\n"
        "    eval_conversations=5), progress=False)\n"
    )
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    # --multi_gpu selects accelerate's torchrun launcher; without GPUs the processes run on the
    # CPU with the gloo backend (`--cpu` alone would start a single process).
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    proc = subprocess.run(launcher, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    digests = metrics["weights_sha256_per_process"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert metrics["steps"] >= 2


def test_bad_data_is_counted_not_fatal(base_dir, tmp_path):
    data = counting_data(tmp_path / "d.jsonl", n=80)
    with data.open("a") as f:
        f.write(json.dumps({"id": "x1", "conversations": "not a list"}) + "\n")
        f.write(json.dumps({"id": "x2", "conversations": [{"from": "robot", "value": "?"}]}) + "\n")
        f.write(json.dumps({"id": "x3", "conversations": [
            {"from": "human", "value": "long " * 400}, {"from": "gpt", "value": "ok"}]}) + "\n")
        f.write('{"id": "x4", "conversations": [tru')  # a truncated tail
    metrics = train(cfg(base_dir, data, tmp_path / "run", epochs=1), progress=False)
    counts = metrics["data"]
    assert counts["empty or missing conversations"] == 1
    assert counts["malformed turn"] == 1
    assert counts["no assistant token within max_length"] == 1  # the long prompt leaves no answer
    assert counts["truncated or malformed JSON (rest of file skipped)"] == 1
    with pytest.raises(MedusaError, match="neither 'sharegpt' nor an existing"):
        train(cfg(base_dir, tmp_path / "missing.jsonl", tmp_path / "run2"), progress=False)


def test_shortlist_loss_covers_only_frequent_tokens():
    from medusa_decoding.config import HeadsConfig
    from medusa_decoding.training import shortlist_head

    torch.manual_seed(1)
    d, v = 8, 12
    lm_head = torch.nn.Linear(d, v, bias=False)
    heads = MedusaHeads(HeadsConfig(medusa_num_heads=2, hidden_size=d, vocab_size=v))
    hidden = torch.randn(6, d)
    labels = torch.tensor([[3, 3], [3, 5], [5, IGNORE], [7, 3]])
    pos = Positions(hidden=hidden, index=torch.tensor([0, 1, 2, 3]), labels=labels,
                    target_index=torch.tensor([[1, 2], [2, 3], [3, 4], [4, 5]]))
    idx = torch.arange(4)
    for targets in ("tokens", "kd"):
        c = TrainConfig(targets=targets)
        full, _ = head_losses(heads, lm_head, pos, idx, c)
        head, label_map = shortlist_head(lm_head, labels, v)  # every token: the same loss
        same, _ = head_losses(heads, head, pos, idx, c, label_map)
        torch.testing.assert_close(same, full)
    head, label_map = shortlist_head(lm_head, labels, 2)  # tokens 3 and 5 (7 is rarer)
    assert head.weight.shape == (2, d) and label_map[3] == 0 and label_map[5] == 1 and label_map[7] == IGNORE
    torch.testing.assert_close(head.weight, lm_head.weight[[3, 5]])


def test_eagle_batches_group_similar_lengths():
    """bucketed_order is a permutation whose consecutive groups have similar lengths: less padding
    than random batches (break the sort and the padding test fails)."""
    from medusa_decoding.training import bucketed_order

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 500, (1000,), generator=g)
    order = bucketed_order(lengths, 8, torch.Generator().manual_seed(1))
    assert sorted(order.tolist()) == list(range(1000))
    assert torch.equal(order, bucketed_order(lengths, 8, torch.Generator().manual_seed(1)))  # resumable

    def padding(o):
        groups = lengths[o].split(8)
        return sum(int(x.max()) * len(x) - int(x.sum()) for x in groups) / int(lengths.sum())

    assert padding(order) < 0.1 < 0.4 < padding(torch.randperm(1000, generator=g))
