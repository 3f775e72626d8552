"""Calibration where the model runs: the budget chosen from the drafter's acceptance and this
machine's costs, the cost curve cached per machine fingerprint, acceptance by budget measured
from one run at the largest budget."""

import json

import pytest
import torch

from medusa_decoding import calibrate as cal
from medusa_decoding import costs, drafters, proposers
from medusa_decoding.config import NgramConfig
from medusa_decoding.engine import MedusaModel

from conftest import byte_tokenizer, random_heads, run_cli, save_tiny
from test_drafters import OracleHydra, make, prompts, run

ACCEPT = {2: 1.6, 3: 1.9, 4: 2.1, 6: 2.4, 8: 2.6, 12: 2.8, 16: 2.95, 24: 3.1, 32: 3.2}



def other_load(cores: float):
    """An OtherLoad that reads `cores` of other processes' load, whatever runs."""
    from medusa_decoding.platform import OtherLoad

    class Fixed(OtherLoad):
        def __exit__(self, *exc):
            self.cores = cores

    return Fixed


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The caching tests see a quiet machine whatever else runs; the contention test sets its own."""
    monkeypatch.setattr(costs, "OtherLoad", other_load(0.0))

def test_a_flat_cost_curve_chooses_a_large_tree_and_a_steep_one_a_small_tree():
    draft = dict.fromkeys(ACCEPT, 0.05)
    flat = {1: 1.0, 8: 1.02, 16: 1.04, 32: 1.08, 48: 1.1}  # a 16-row block costs what one row costs (AMX)
    steep = {1: 1.0, 2: 1.3, 4: 2.0, 8: 3.5, 16: 6.0, 32: 11.0, 48: 16.0}  # few-row kernels grow fast
    big, _, table = costs.choose_budget(ACCEPT, flat, draft)
    small, _, _ = costs.choose_budget(ACCEPT, steep, draft)
    assert big == 32 and small == 2
    assert table[0] == {"budget": 1, "chain": 0, "expected_tau": 1.0, "cost": 1.0, "expected_speedup": 1.0}
    # the n-gram chain is verified with every tree: its nodes count in the cost
    with_chain, chain, _ = costs.choose_budget(ACCEPT, {1: 1.0, 10: 1.1, 14: 1.3, 40: 4.0}, draft, chain=8)
    alone, _, _ = costs.choose_budget(ACCEPT, {1: 1.0, 10: 1.1, 14: 1.3, 40: 4.0}, draft, chain=0)
    assert with_chain < alone and chain == 8
    # a costly drafter shrinks the budget too
    dear, _, _ = costs.choose_budget(ACCEPT, flat, {b: 0.1 * b for b in ACCEPT})
    assert dear < big


def test_where_the_chains_gain_is_measured_it_runs_only_where_it_pays_and_plain_is_a_choice():
    draft = dict.fromkeys(ACCEPT, 0.05)
    chained = {1: 1.3} | {b: tau + 0.3 for b, tau in ACCEPT.items()}  # + 0.3 tokens a step beside any tree
    flat = {1: 1.0, 8: 1.02, 16: 1.04, 32: 1.08, 48: 1.1}
    assert costs.choose_budget(ACCEPT, flat, draft, 8, chained)[:2] == (32, 8)  # nearly free: the chain runs
    steep = {1: 1.0, 2: 1.3, 4: 2.0, 8: 3.5, 16: 6.0, 32: 11.0, 48: 16.0}
    assert costs.choose_budget(ACCEPT, steep, draft, 8, chained)[:2] == (2, 0)  # 8 more nodes cost more than 0.3 tokens
    costly = {1: 1.0, 2: 1.9, 9: 4.0, 10: 4.4, 40: 16.0}  # every tree loses: plain decoding
    budget, chain, table = costs.choose_budget(ACCEPT, costly, draft, 8, chained)
    assert (budget, chain) == (1, 0) and {(r["budget"], r["chain"]) for r in table} >= {(1, 0), (1, 8), (2, 0), (2, 8)}
    copying = {1: 5.0} | {b: 5.0 for b in ACCEPT}  # answers that copy their prompt: the chain alone
    assert costs.choose_budget(ACCEPT, costly, draft, 8, copying)[:2] == (1, 8)


def test_compiled_costs_remove_the_same_overhead_at_every_size():
    curve = costs.CostCurve({}, 0.037, {1: 1.0, 4: 44.2 / 37.13, 8: 54.41 / 37.13, 16: 94.43 / 37.13},
                            {"k": {4: 0.2}}, compiled=20.19 / 37.13)  # eager, and the saved graph's t(1), Xeon fp32
    verify, draft = costs.compiled_costs(curve)
    measured = {4: 28.31 / 20.19, 8: 37.63 / 20.19, 16: 74.98 / 20.19}  # the saved graphs, same run
    assert verify[1] == pytest.approx(1.0)
    for n, v in measured.items():
        assert verify[n] == pytest.approx(v, rel=0.05)
    assert draft["k"][4] == pytest.approx(0.2 * 37.13 / 20.19)


def saved_hydra(model, folder, acceptance=ACCEPT):
    make("hydra", model, seed=8).save_pretrained(folder)
    if acceptance is not None:
        (folder / proposers.ACCEPTANCE_NAME).write_text(json.dumps({"expected_tau": acceptance}))
    return MedusaModel(model, byte_tokenizer(), heads=proposers.load(folder, model))


def test_the_cost_curve_is_cached_per_machine_fingerprint(model, tmp_path, monkeypatch):
    m = saved_hydra(model, tmp_path / "d")
    calls = []
    real = costs.measure

    def counting(*args, **kw):
        calls.append(kw.get("verify", True))
        return real(*args, **kw)

    monkeypatch.setattr(costs, "measure", counting)
    m.drafter.set_budget(5)  # no budget a fit chooses (costs.BUDGETS)
    backend = m.backend
    first = costs.fit_to_machine(m, root=tmp_path / "cache", progress=False)
    assert first.source == "measured" and calls == [True] and first.path.is_file() and "measured now" in first.line
    assert m.drafter.budget == 5 and m.backend is backend  # the model is not changed
    m.apply_fit(first)
    assert m.drafter.budget == first.budget
    saved = json.loads(first.path.read_text())
    assert saved["fingerprint"] == costs.fingerprint(m) and set(costs.verify_sizes(0)) <= set(map(int, saved["verify"]))

    again = costs.fit_to_machine(m, root=tmp_path / "cache", progress=False)
    assert again.source == "cached" and len(calls) == 1 and again.budget == first.budget and "cached" in again.line

    # another CPU (or thread count, dtype, verifier ...) is another machine: measured again, its own file
    monkeypatch.setattr(costs, "processor_info", lambda device: ("Another CPU", ["avx2"]))
    other = costs.fit_to_machine(m, root=tmp_path / "cache", progress=False)
    assert other.source == "measured" and len(calls) == 2 and other.path != first.path

    # the same machine with another drafter architecture: only the drafting is measured
    m2 = MedusaModel(model, byte_tokenizer(), heads=proposers.load(tmp_path / "d", model))
    m2.drafter.width = 2
    third = costs.fit_to_machine(m2, root=tmp_path / "cache", progress=False)
    assert third.source == "measured" and calls[-1] is False and third.path == other.path
    assert len(json.loads(other.path.read_text())["draft"]) == 2

    refreshed = costs.fit_to_machine(m, root=tmp_path / "cache", progress=False, refresh=True)
    assert refreshed.source == "measured" and calls[-1] is True


def test_a_rebuilt_block_kernel_is_another_machine(model, tmp_path, monkeypatch):
    m = saved_hydra(model, tmp_path / "d")
    assert costs.fingerprint(m)["kernel"] is None  # stock linears: no kernel in the key
    monkeypatch.setattr(m.backend, "linears", "blocks")
    monkeypatch.setattr(costs.blocks, "source_tag", lambda: "avx2-build")
    before = costs.fingerprint(m)
    monkeypatch.setattr(costs.blocks, "source_tag", lambda: "avx512-build")  # new source, torch or ISA
    after = costs.fingerprint(m)
    assert before["kernel"] == "avx2-build" and after["kernel"] == "avx512-build"
    assert costs.cache_path(before, tmp_path) != costs.cache_path(after, tmp_path)


def test_a_checkpoint_without_acceptance_keeps_its_own_budget(model, tmp_path):
    m = saved_hydra(model, tmp_path / "d", acceptance=None)
    own = m.drafter.budget
    fit = costs.fit_to_machine(m, root=tmp_path / "cache", progress=False)
    assert fit.source == "shipped" and fit.budget is None and m.drafter.budget == own
    assert "no acceptance statistics" in fit.line and not (tmp_path / "cache").exists()


def test_acceptance_by_budget_from_one_run_at_the_largest_budget(model, tmp_path):
    """The largest budget's figure is that run's own mean accepted length; smaller budgets keep
    fewer of its accepted nodes (never more); an oracle drafter gains from a bigger tree."""
    prompt = [10, 20, 30, 40, 50]
    ref, _ = run(model, prompt, None, max_new_tokens=60)
    with torch.no_grad():
        known = model.get_decoder()(input_ids=torch.tensor([prompt + ref])).last_hidden_state[0]
    config = drafters.DrafterConfig(drafter="hydra", hidden_size=64, vocab_size=model.config.vocab_size,
                                    shortlist_size=model.config.vocab_size, num_heads=4, inner_size=32)
    oracle = OracleHydra(config).setup(known, hit=0.5)
    m = MedusaModel(model, byte_tokenizer(), heads=oracle)
    result = cal.acceptance_curve(m, [torch.tensor([prompt])], max_new_tokens=60, budgets=(2, 4, 8, 16))
    tau = result["expected_tau"]
    assert list(tau) == [2, 4, 8, 16]
    assert all(a <= b for a, b in zip(tau.values(), list(tau.values())[1:]))
    assert tau[2] <= 2.0 and tau[16] > tau[2]
    oracle.setup(known, hit=0.5)  # the same random hits again
    _, stats = run(model, prompt, oracle, max_new_tokens=60, budget=16)
    assert tau[16] == pytest.approx(stats.mean_accepted_length)
    cal.save_acceptance(result, tmp_path)
    assert proposers.read_acceptance(tmp_path) == pytest.approx(tau)


def test_medusa_acceptance_follows_the_tree_paths_and_heads_accuracy(model, tmp_path):
    heads = random_heads(model, num_heads=2)
    heads.save_pretrained(tmp_path)
    (tmp_path / "tree.json").write_text(json.dumps({"paths": [[0], [0, 0], [1]], "accuracy": [[0.5, 0.1], [0.6, 0.1]]}))
    m = MedusaModel(model, byte_tokenizer(), heads=proposers.load(tmp_path, model))
    assert m.drafter.tree.paths == ((0,), (1,), (0, 0))  # the tree's order, in which a budget cuts it
    assert m.drafter.acceptance() == pytest.approx({2: 1.5, 3: 1.6, 4: 1.9})  # + 0.5, 0.1, 0.5 * 0.6
    m.drafter.set_budget(3)
    assert m.drafter.tree.paths == ((0,), (1,)) and m.drafter.acceptance() == pytest.approx({2: 1.5, 3: 1.6})


def test_cli_generate_says_which_calibration_is_in_use(tmp_path_factory, tmp_path, capsys, monkeypatch):
    folder, _ = save_tiny(tmp_path_factory, with_heads=False)
    from conftest import tiny_llama

    saved_hydra(tiny_llama(), tmp_path / "d")
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    args = ("generate", "-p", "hello", "--model", folder, "--heads", tmp_path / "d", "-n", "8", "--dtype", "float32")
    code, _, err = run_cli(capsys, monkeypatch, *args)
    assert code == 0 and "calibration: measured now" in err
    code, _, err = run_cli(capsys, monkeypatch, *args)
    assert code == 0 and "calibration: cached" in err
    code, _, err = run_cli(capsys, monkeypatch, *args, "--calibration", "shipped")
    assert code == 0 and "calibration:" not in err
    code, _, err = run_cli(capsys, monkeypatch, *args, "--calibration", "often")
    assert code == 2 and "unknown calibration 'often'" in err


def test_the_recorder_counts_what_each_smaller_tree_would_have_kept():
    """Nodes 1, 2 at depth 1 and 3, 4 under node 1, scored -0.1, -0.5, -0.3, -0.9: the 2-node tree
    keeps node 1, the 3-node tree nodes 1 and 3. Accepting 1 then 3: 1, 2, 2, 2 accepted nodes."""
    from medusa_decoding.proposers import Proposal, Proposer
    from medusa_decoding.tree import tree_from_parents

    class Fixed(Proposer):
        def propose(self, root, budget=None):
            tree = tree_from_parents(torch.tensor([-1, 0, 0, 1, 1]), torch.tensor([0, 1, 1, 2, 2]), 2)
            return Proposal(torch.arange(5), tree, score=torch.tensor([0.0, -0.1, -0.5, -0.3, -0.9]))

    counts = dict.fromkeys((2, 3, 4, 5), 0) | {"steps": 0}
    recorder = cal._Recorder(Fixed(), [2, 3, 4, 5], counts)
    recorder.propose(torch.tensor(0))
    recorder.observe(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 3]))
    recorder.propose(torch.tensor(0))
    recorder.observe(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), torch.tensor([0, 2]))  # rank 2
    assert counts == {2: 1, 3: 2, 4: 3, 5: 3, "steps": 2}


def test_the_recorder_counts_what_an_ngram_chain_beside_each_tree_would_have_added():
    """Context 5 6 7 | 5 6 (the root) then the answer 7 9 5 6 7: the chain looks up the root's last
    n-gram (5 6) and proposes what followed it (7 5 6 ...). Step 1 (root 6): the chain matches 7,
    not 5 (9 came): 1 token, the tree kept 0 or 1; step 2 (root 9): no earlier 9, no chain. The
    chain alone: after 6 it gains 1 (7), after 9 none, after 5 (6 7 5 ...) 2 (6 7), then the end."""
    from medusa_decoding.config import NgramConfig
    from medusa_decoding.proposers import Proposer

    counts = dict.fromkeys((2, 3), 0) | {"steps": 0}
    recorder = cal._Recorder(Proposer(), [2, 3], counts)
    recorder.start(torch.tensor([5, 6, 7, 5]))
    recorder.observe(None, torch.tensor([6]), None)  # the prefill: the root 6
    recorder.rank = torch.tensor([-1, 0, 1])  # a 3-node tree, nodes 1 and 2 under the root
    recorder.observe(None, torch.tensor([7, 9]), torch.tensor([0, 2]))  # node 2 accepted (rank 1), then 9
    recorder.rank = None  # no tree
    recorder.observe(None, torch.tensor([5]), torch.tensor([0]))
    recorder.context += [6, 7]  # what the base emitted afterwards
    assert counts == {2: 0, 3: 1, "steps": 2}
    assert recorder.chain_gain(NgramConfig(length=4)) == {1: 3 / 3, 2: 1 / 2, 3: 0.0}
    assert recorder.chain_gain(NgramConfig(length=4, min_ngram=3)) == {1: 0.0, 2: 0.0, 3: 0.0}  # no 3-gram match


def test_the_chains_gain_counts_the_copy_steps_that_follow_it():
    """An answer that copies its 30-token prompt, a tree that never accepts: beside every tree the
    2-token chain gains 2 a step, and the recorded steps it passes over are not counted again; with copy steps (after 2 accepted chain tokens the 12-token chain
    alone) a step gains more, and the recorded steps they pass over are not counted again. The
    chain alone: 0 after the prompt's last token, then 2, then copy steps of 12 until the end."""
    from medusa_decoding.proposers import Proposer

    prompt = list(range(5, 35))  # 30 distinct tokens
    recorder = cal._Recorder(Proposer(), [2], {2: 0, "steps": 0})
    recorder.context = prompt + prompt
    recorder.steps = [(at, {2: 0}) for at in range(30, 60)]  # one token a step: the tree kept nothing
    beside = recorder.chain_gain(NgramConfig(length=2, copy_run=0))
    copying = recorder.chain_gain(NgramConfig(length=2, copy_run=2, copy_length=12))
    # at 30 no earlier match; at 31 the chain accepts 2, so the recorded steps at 32 and 33 are passed over (the
    # chain went past them), then 34, ..., 58 the same: the chain alone's walk, as the tree never accepts
    assert beside[2] == pytest.approx(2 * 10 / 11)
    # steps at 30 (0), 31 (2), then copies from 34: 12, 12 (to 60): 4 steps, 30 tokens, vs 1 a step without
    assert copying[2] == pytest.approx(30 / 4 - 1)
    assert beside[1] == pytest.approx(2 * 10 / 11)  # 30: 0; 31, 34, ..., 58: 2 each
    assert copying[1] == pytest.approx((0 + 2 + 12 + 12) / 4)


def test_the_chains_gain_is_the_mean_over_prompts_not_the_median():
    """It comes in bursts, on the prompts whose answers copy: the mean is what a run of them gains."""
    assert cal.chained_tau({4: 2.0}, {1: [0.0, 0.0, 1.5], 4: [0.0, 0.3, 2.7]}) == pytest.approx({1: 1.5, 4: 3.0})


@pytest.mark.parametrize("kind", ["hydra", "eagle"])
def test_acceptance_is_measured_for_drafters_on_fused_features(model, kind):
    drafter = make(kind, model, seed=3, feature_layers=[1, 2])
    m = MedusaModel(model, byte_tokenizer(), heads=drafter)
    result = cal.acceptance_curve(m, [torch.tensor([p]) for p in prompts(2, seed=4)], max_new_tokens=12, budgets=[2, 4])
    assert result["steps"] > 0 and set(result["expected_tau_ngram"]) == {1, 2, 4}


def test_the_fit_runs_the_chain_only_where_it_pays_and_reads_the_compiled_costs(model, tmp_path):
    from medusa_decoding.config import NgramConfig

    m = saved_hydra(model, tmp_path / "d")
    m.ngram = m.ngram_asked = NgramConfig(length=8)
    chained = {1: 1.3} | {b: tau + 0.3 for b, tau in ACCEPT.items()}
    (tmp_path / "d" / proposers.ACCEPTANCE_NAME).write_text(json.dumps(
        {"expected_tau": ACCEPT, "expected_tau_ngram": chained,
         "ngram": proposers.chain_settings(NgramConfig(length=8))}))
    assert m.drafter.acceptance(NgramConfig(length=8)) == pytest.approx(chained)
    assert m.drafter.acceptance(NgramConfig(length=4)) is None  # measured for another chain
    assert m.drafter.acceptance(NgramConfig(length=8, copy_run=0)) is None  # counted with its copy steps
    key = costs.drafter_key(m.drafter)
    flat = costs.CostCurve({"processor": "AMX", "threads": 2, "dtype": "bfloat16", "verifier": "eager"}, 0.05,
                           {n: 1.0 + 0.003 * n for n in range(1, 49)}, {key: dict.fromkeys(ACCEPT, 0.05)})
    fit = costs.fit_budget(m, flat, tmp_path / "c.json", "cached")
    m.apply_fit(fit)
    assert (fit.budget, fit.chain) == (32, 8) and m.ngram is not None and "with the n-gram chain" in fit.line
    # eager: each node costs 4% of a step, after a large fixed overhead; compiled, the overhead is gone
    steep = costs.CostCurve(flat.fingerprint, 0.05, {n: 0.96 + 0.04 * n for n in range(1, 49)},
                            {key: dict.fromkeys(ACCEPT, 0.05)}, compiled=0.3)
    eager = costs.fit_budget(m, steep, tmp_path / "c.json", "cached")
    compiled = costs.fit_budget(m, steep, tmp_path / "c.json", "cached", compiled=True)
    assert eager.budget > compiled.budget and compiled.chain == 0 and m.ngram is not None
    m.apply_fit(compiled)
    assert m.ngram is None and m.drafter.budget == compiled.budget and "compiled" in compiled.line
    m.apply_fit(costs.fit_budget(m, flat, tmp_path / "c.json", "cached"))  # the chain asked for comes back where it pays
    assert m.ngram == NgramConfig(length=8)
    # where no tree pays the drafter rests: plain decoding, or the chain alone where copying pays
    dear = costs.CostCurve(flat.fingerprint, 0.05, {1: 1.0, 2: 2.5, 9: 3.0, 10: 3.1, 14: 3.5, 48: 40.0},
                           {key: dict.fromkeys(ACCEPT, 0.05)})
    fit = costs.fit_budget(m, dear, tmp_path / "c.json", "cached")
    m.apply_fit(fit)
    assert (fit.budget, fit.chain) == (1, 0) and not m.method().speculative and "plain decoding" in fit.line
    plain = m.generate("hello", max_new_tokens=12, use_medusa=False, chat=False)
    assert m.generate("hello", max_new_tokens=12, chat=False).stats.steps == plain.stats.steps
    (tmp_path / "d" / proposers.ACCEPTANCE_NAME).write_text(json.dumps(
        {"expected_tau": ACCEPT, "expected_tau_ngram": {b: 5.0 for b in [1, *ACCEPT]},
         "ngram": proposers.chain_settings(NgramConfig(length=8))}))
    fit = costs.fit_budget(m, dear, tmp_path / "c.json", "cached")
    m.apply_fit(fit)
    assert (fit.budget, fit.chain) == (1, 8) and "chain alone" in fit.line
    method = m.method()
    assert method.drafter is None and method.ngram is not None and method.default_budget == 2


def test_the_compiled_ratio_waits_for_the_saved_graph(model, tmp_path):
    from medusa_decoding.verifiers.compiled import WANTED, CompiledBackend
    from medusa_decoding.verifiers.transformers import EagerBackend

    auto = CompiledBackend(model, graphs=tmp_path, mode="auto")
    assert costs.compiled_ratio(EagerBackend(model), auto, repeats=1) is None  # no graph yet: it ran eager
    assert list((auto.folder / WANTED).glob("*.json"))  # and listed it for `medusa compile`
    before = auto.eager_steps
    assert costs.compiled_ratio(EagerBackend(model), auto, repeats=1) is None and auto.eager_steps == before  # listed


def test_auto_dtype_is_bf16_only_where_the_cpu_has_bf16_in_hardware(monkeypatch):
    from medusa_decoding import models, platform

    cpu = torch.device("cpu")
    monkeypatch.setattr(platform, "cpu_info", lambda: ("AVX2 CPU", ["avx2"]))
    assert models.resolve_dtype("auto", cpu) == torch.float32
    for flags in (["avx2", "avx512f", "avx512_bf16"], ["avx2", "amx_bf16", "amx_int8"]):
        monkeypatch.setattr(platform, "cpu_info", lambda flags=flags: ("bf16 CPU", flags))
        assert models.resolve_dtype("auto", cpu) == torch.bfloat16
    assert models.resolve_dtype("float32", cpu) == torch.float32  # asked for: kept


def test_cli_calibrate_a_drafter_saves_its_acceptance_and_fits_this_machine(tmp_path_factory, tmp_path, capsys,
                                                                           monkeypatch):
    from conftest import tiny_llama

    folder, _ = save_tiny(tmp_path_factory, with_heads=False)
    saved_hydra(tiny_llama(), tmp_path / "d", acceptance=None)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "count from 7"}\n{"prompt": "abc abc"}\n')
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(capsys, monkeypatch, "calibrate", "--heads", tmp_path / "d", "--model", folder, "--prompts",
                             prompts, "--limit", "2", "--max-new-tokens", "12", "--out", tmp_path / "o",
                             "--dtype", "float32")
    assert code == 0, err
    accepted = json.loads((tmp_path / "o" / proposers.ACCEPTANCE_NAME).read_text())
    assert accepted["prompts"] == 2 and set(map(int, accepted["expected_tau"])) == set(costs.BUDGETS)
    assert set(map(int, accepted["expected_tau_ngram"])) == {1, *costs.BUDGETS}
    assert accepted["ngram"]["length"] == NgramConfig.length  # the chain generate runs by default
    assert all(accepted["expected_tau_ngram"][str(b)] >= tau for b, tau in accepted["expected_tau"].items())
    assert not (tmp_path / "d" / proposers.ACCEPTANCE_NAME).exists()  # --out: the source is left alone
    assert "<- chosen" in out and "calibration: measured now" in err
    # generate with the calibrated copy reads its acceptance and the cached costs
    code, _, err = run_cli(capsys, monkeypatch, "generate", "-p", "hi", "--model", folder, "--heads", tmp_path / "o",
                           "-n", "4", "--dtype", "float32")
    assert code == 0 and "calibration: cached" in err


# exact mode where it is (nearly) free -----------------------------------------------------------

def test_exact_mode_is_preferred_where_it_costs_at_most_ten_percent():
    assert costs.prefer_exact(100.0, 91.0) and costs.prefer_exact(100.0, 120.0)
    assert not costs.prefer_exact(100.0, 89.0)


def seeded_curves(m, root, exact_step_s: float, exact_slope: float = 0.01) -> None:
    """Cache this machine's curves for m in both attention modes (fast: t(1) = 10 ms), so that
    choosing reads them and measures nothing."""
    from medusa_decoding.models import use_fast_attention

    chain = m.ngram.length if m.ngram else 0
    sizes = costs.verify_sizes(chain)
    for exact, step, slope in ((False, 0.010, 0.01), (True, exact_step_s, exact_slope)):
        use_fast_attention(m.base, exact=exact)
        fp = costs.fingerprint(m)
        curve = costs.CostCurve(fp, step, {n: 1 + slope * (n - 1) for n in sizes},
                                {costs.drafter_key(m.drafter): dict.fromkeys(costs.BUDGETS, 0.05)})
        costs.save_curve(curve, costs.cache_path(fp, root))
    use_fast_attention(m.base, exact=False)


@pytest.mark.parametrize("exact_step_s, chosen", [(0.0105, True), (0.013, False)])
def test_bf16_turns_exact_mode_on_only_where_this_machine_measured_it_nearly_free(tmp_path, monkeypatch,
                                                                                 exact_step_s, chosen):
    from conftest import tiny_llama

    base = tiny_llama(seed=3).to(torch.bfloat16)
    m = saved_hydra(base, tmp_path / "d")
    seeded_curves(m, tmp_path / "cache" / "calibration", exact_step_s)
    monkeypatch.setattr(costs, "measure", lambda *a, **k: pytest.fail("the cached curves were not used"))
    before = base.config._attn_implementation
    fit = costs.fit_exactness(m, root=tmp_path / "cache" / "calibration", progress=False)
    assert fit.exact is chosen and fit.cost == pytest.approx(1 - 0.010 / exact_step_s, abs=1e-6)
    assert base.config._attn_implementation == before  # measured in both modes, then put back
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    assert m.fit_exactness(progress=False).exact is chosen  # the model's own fit applies it
    assert base.config._attn_implementation == ("medusa_exact" if chosen else "medusa")
    assert len(fit.lines) == 2 and fit.lines[0].startswith("calibration: cached")
    assert fit.lines[1].startswith("exact mode: on" if chosen else "exact mode: off")
    # the budget is the one fitted in the chosen mode: here exact mode's steeper curve fits 8 nodes
    # (x1.86 of its t(1), 8 ms) where the fast one fits 16 (x2.46 of 10 ms): 232 vs 246 expected tokens/s
    seeded_curves(m, tmp_path / "steep", 0.008, exact_slope=0.05)
    steep = costs.fit_exactness(m, root=tmp_path / "steep", progress=False)
    assert steep.exact and steep.fit.budget == 8 and "budget 8" in steep.lines[0]
    # and at 9.5 ms exact mode loses (195 expected tokens/s): the fast mode's 16 nodes, fitted first, are set back
    seeded_curves(m, tmp_path / "dear", 0.0095, exact_slope=0.05)
    dear = costs.fit_exactness(m, root=tmp_path / "dear", progress=False)
    assert not dear.exact and dear.fit.budget == 16 and "budget 16" in dear.lines[0]


def test_float32_keeps_its_attention_and_says_nothing_of_exact_mode(model, tmp_path):
    m = saved_hydra(model, tmp_path / "d")
    before = model.config._attn_implementation
    fit = costs.fit_exactness(m, root=tmp_path / "cache", progress=False)
    assert fit.exact is False and fit.cost is None and model.config._attn_implementation == before
    assert len(fit.lines) == 1 and fit.lines[0].startswith("calibration: measured now")


def test_cli_bf16_generate_chooses_exact_mode_unless_told(tmp_path_factory, tmp_path, capsys, monkeypatch):
    folder, _ = save_tiny(tmp_path_factory, with_heads=False)
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    args = ("generate", "-p", "hello", "--model", folder, "--no-medusa", "-n", "4", "--dtype", "bfloat16")
    code, _, err = run_cli(capsys, monkeypatch, *args)
    assert code == 0 and "exact mode: o" in err  # on or off: what this machine measured
    for flag in ("--exact", "--no-exact"):
        code, _, err = run_cli(capsys, monkeypatch, *args, flag)
        assert code == 0 and "exact mode:" not in err


def test_both_modes_are_measured_in_one_interleaved_run_then_read_from_the_cache(tmp_path, monkeypatch):
    from conftest import tiny_llama

    base = tiny_llama(seed=4).to(torch.bfloat16)
    m = saved_hydra(base, tmp_path / "d")
    order, calls = [], []
    real = costs.measure

    def counting(*args, setups=(), **kw):
        calls.append(len(setups))
        spied = [lambda s=s, k=k: (order.append(k), s())[1] for k, s in enumerate(setups)]
        return real(*args, setups=spied, **kw)

    monkeypatch.setattr(costs, "measure", counting)
    first = costs.fit_exactness(m, root=tmp_path / "cache", progress=False)
    assert calls == [2] and order == [0, 1] * (costs.REPEATS + 1)  # fast, exact, fast, exact ... each round
    assert first.lines[0].startswith("calibration: measured now") and first.cost is not None
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2  # one curve per mode
    again = costs.fit_exactness(m, root=tmp_path / "cache", progress=False)
    assert calls == [2] and again.exact == first.exact and again.cost == pytest.approx(first.cost)
    assert again.lines[0].startswith("calibration: cached")
    # plain decoding: one-token steps of both modes, nothing to fit
    plain = costs.fit_exactness(MedusaModel(base, byte_tokenizer()), fit=False, root=tmp_path / "plain",
                                progress=False, use_medusa=False)
    assert calls == [2, 2] and len(plain.lines) == 1 and plain.lines[0].startswith("exact mode: o")


def test_exact_mode_is_checked_row_invariant_on_this_machine_before_it_is_chosen(tmp_path, monkeypatch):
    """The check itself: it passes in exact mode and catches the fast kernel (whose rounding
    follows the number of query rows); a machine where it fails keeps exact mode off, however cheap."""
    from conftest import tiny_llama
    from medusa_decoding.models import use_fast_attention
    from medusa_decoding.verifiers.transformers import EagerBackend

    sizes = [1, 2, 4, 8, 14, 22]
    for exact in (True, False):
        base = tiny_llama(max_positions=512, seed=1).to(torch.bfloat16)
        use_fast_attention(base, exact=exact)
        torch.manual_seed(0)
        found = costs.varies_at(EagerBackend(base), sizes)
        # where the fast kernel's rounding first shows depends on the CPU (2 nodes on one EPYC, 14 on another)
        assert found is None if exact else found.endswith((" nodes", " rows")), found
    base = tiny_llama(seed=3).to(torch.bfloat16)
    m = saved_hydra(base, tmp_path / "d")
    seeded_curves(m, tmp_path / "cache", 0.009)  # exact mode cheaper than fast: it would be chosen
    monkeypatch.setattr(costs, "varies_at", lambda backend, sizes: "6 nodes")
    fit = costs.fit_exactness(m, root=tmp_path / "cache", progress=False)
    assert not fit.exact and base.config._attn_implementation == "medusa"  # as it was
    assert "a step of 6 nodes even in exact mode" in fit.lines[-1]
    # what the check found is cached with the exact-mode curve: it is not run again
    monkeypatch.setattr(costs, "varies_at", lambda backend, sizes: pytest.fail("checked again"))
    assert not costs.fit_exactness(m, root=tmp_path / "cache", progress=False).exact


def test_a_measurement_taken_while_other_processes_ran_is_not_cached(model, tmp_path, monkeypatch):
    """Other processes' CPU use is watched while the machine is measured: above CONTENDED_CORES the
    curve is used for this run, said to be contended, and not cached (the next run measures again)."""
    import subprocess
    import sys
    import time

    from medusa_decoding.platform import OtherLoad, busy_cpu_s

    if busy_cpu_s() is None:
        pytest.skip("no /proc/stat here: other processes' load cannot be read")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 2: pass"])
    with OtherLoad() as busy:
        time.sleep(1.0)
    spin.wait()
    assert busy.cores > 0.5  # a busy child counts, this process's own time does not

    m = saved_hydra(model, tmp_path / "d")
    monkeypatch.setattr(costs, "OtherLoad", other_load(1.0))
    first = costs.fit_to_machine(m, root=tmp_path / "cache", progress=False)
    assert first.source == "contended" and "not cached" in first.line and not first.path.exists()
    monkeypatch.setattr(costs, "OtherLoad", other_load(0.0))  # the next run measures again, and caches
    again = costs.fit_to_machine(m, root=tmp_path / "cache", progress=False)
    assert again.source == "measured" and again.path.is_file()
