"""The shipped residual Medusa heads, exported, served by vLLM (its CPU build): vLLM's greedy output equals
ours, and its accepted length equals ours at the same chain length.

Runs where `make vllm` made vLLM's environment (or MEDUSA_VLLM_PYTHON names one); skipped with
that reason elsewhere: vLLM compiles the model on load (100-220 s on 2 cores), beyond the suite's
budget. scripts/vllm_check.py is the longer check (more prompts, vLLM's plain decoding too).
"""

import json

import pytest

from medusa_decoding.bench.prompts import BUILTIN, load_suite
from medusa_decoding.bench.vllm_methods import PYTHON_VAR, Worker, available, env_python, speculative_config
from medusa_decoding.config import NgramConfig
from medusa_decoding.engine import MedusaModel
from medusa_decoding.models import RESIDUAL_HEADS, model_folder, shipped_drafter
from medusa_decoding.spec import VLLM_MEDUSA, DecodeSpec

ALIAS = "smollm2-135m-instruct"
PYTHON = env_python()  # the user's, found before the suite points $MEDUSA_CACHE at a fresh folder
WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=f"{WHY} (its check takes minutes)")]


def test_vllm_serves_the_shipped_residual_heads_as_we_decode_them(tmp_path, monkeypatch):
    monkeypatch.setenv(PYTHON_VAR, str(PYTHON))
    heads = shipped_drafter(ALIAS, RESIDUAL_HEADS)
    depth = json.loads((heads / "config.json").read_text())["medusa_num_heads"]
    chain = tmp_path / "chain.json"  # vLLM drafts one top-1 guess per head: the same chain here
    chain.write_text(json.dumps([[0] * d for d in range(1, depth + 1)]))
    model = MedusaModel.from_pretrained(ALIAS, DecodeSpec(drafter=str(heads), tree=str(chain), ngram=None,
                                        compile="off", exact=False, calibration="shipped"),
                                        dtype="float32", device="cpu")
    spec = speculative_config(VLLM_MEDUSA, model, heads, NgramConfig(), tmp_path / "export")
    worker = Worker(model_folder(ALIAS), spec, "float32")
    try:
        ours_steps = ours_tokens = theirs_steps = theirs_tokens = 0
        for prompt in load_suite(BUILTIN)[:3]:
            ids = model.encode([{"role": "user", "content": prompt.turns[0]}])
            plain = model.generate(ids, max_new_tokens=48, use_medusa=False)
            ours = model.generate(ids, max_new_tokens=48)
            theirs = worker.generate(ids[0].tolist(), 48, model.eos_token_ids)
            assert ours.token_ids == plain.token_ids
            assert theirs["tokens"] == plain.token_ids, prompt.id
            ours_steps += len(ours.stats.accepted_lengths)
            ours_tokens += sum(ours.stats.accepted_lengths)
            theirs_steps += theirs["drafts"]
            theirs_tokens += theirs["drafts"] + theirs["accepted"]
        # greedy, the same tokens and the same heads: the same guesses accepted, step for step
        assert theirs_tokens / theirs_steps == pytest.approx(ours_tokens / ours_steps, rel=0.05)
    finally:
        worker.close()
