"""Path-aware drafters (hydra heads, the eagle feature drafter): drafted trees are trees, the
drafter's cached tree drafting equals a plain recompute, training's unrolled passes are what a
tree node sees at inference, and greedy output stays token-identical to plain decoding (fp32)."""

import json

import pytest
import torch

from medusa_decoding import drafters
from medusa_decoding.config import GenerationConfig, MedusaError, NgramConfig, SamplingConfig, TrainConfig
from medusa_decoding.engine import GenerationStats
from medusa_decoding import proposers
from medusa_decoding.drafters import EagleLayer, HydraHeads, grow_tree
from medusa_decoding.engine import MedusaModel
from medusa_decoding.proposers.eagle import ttt_mask
from medusa_decoding.train import train
from medusa_decoding.tree import build_tree, tree_from_parents

from conftest import EOS, decode, byte_tokenizer, save_tiny, tiny_llama
from test_train import counting_data
from test_train import cfg as train_cfg

KINDS = ("hydra", "eagle")


def randomize(module, seed=0, scale=0.5):
    """Random (not zero) weights everywhere but the norms: guesses are noise, mostly wrong."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    return module.eval()


def make(kind, model, seed=0, scale=0.5, **kw):
    kw.setdefault("shortlist_size", model.config.vocab_size)
    return randomize(drafters.for_base(kind, model, **kw), seed, scale)


def run(model, prompt, drafter, ngram=None, max_new_tokens=40, budget=None):
    stats, out = GenerationStats(), []
    for chunk in decode(model, torch.tensor([prompt]), drafter, build_tree([]), GenerationConfig(max_new_tokens=max_new_tokens),
                        SamplingConfig(), {EOS}, stats, ngram=ngram, draft_budget=budget):
        out += chunk
    return out, stats


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# trees -------------------------------------------------------------------------------------------

def test_grow_tree_keeps_the_best_nodes_and_they_form_a_tree():
    g = torch.Generator().manual_seed(0)
    vocab, width, depth, budget = 7, 3, 4, 10
    first = torch.log_softmax(torch.randn(vocab, generator=g), -1)
    calls = []

    def expand(frontier, tokens, parents):
        out = torch.log_softmax(torch.randn(len(frontier), vocab, generator=g), -1)
        calls.append((frontier.clone(), out))
        return out

    tokens, parent, dep, score = grow_tree(first, expand, width, depth, budget)
    assert len(tokens) == budget and parent[0] == -1 and dep[0] == 0
    for i in range(1, budget):
        p = int(parent[i])
        assert 0 <= p < i and dep[i] == dep[p] + 1 and score[i] <= score[p] + 1e-6
    # brute force: every candidate grow_tree generated, scored by its branch's log-probs
    top = first.topk(width)
    cand = [(float(s), 1) for s in top.values]
    scores = {i + 1: float(s) for i, s in enumerate(top.values)}
    n = 1 + width
    for d, (frontier, out) in enumerate(calls, start=2):
        vals = out.topk(width, dim=-1).values
        for r, node in enumerate(frontier.tolist()):
            for v in vals[r].tolist():
                scores[n] = scores[node] + v
                cand.append((scores[n], d))
                n += 1
    best = sorted(cand, key=lambda c: (-c[0] + 1e-4 * c[1]))[: budget - 1]
    assert sorted(score[1:].tolist()) == pytest.approx(sorted(c[0] for c in best), abs=1e-5)


def test_grow_tree_drafts_only_what_the_budget_can_keep():
    """The pruned drafting keeps the nodes EAGLE-2's full rule keeps (at each depth the W best
    nodes expanded by their W best children, then the budget - 1 best of all), expanding fewer."""
    vocab, width, depth = 11, 4, 4

    def log_probs(branch):  # the children of a branch: a function of its tokens alone
        g = torch.Generator().manual_seed(hash(tuple(branch)) % 2**31)
        return torch.log_softmax(3 * torch.randn(vocab, generator=g), -1)

    def branch(i, tokens, parents):
        out = []
        while i > 0:
            out.append(int(tokens[i]))
            i = int(parents[i])
        return tuple(out[::-1])

    for budget in (2, 3, 4, 6, 10, 40):
        expanded = []

        def expand(frontier, tokens, parents):
            expanded.append(len(frontier))
            return torch.stack([log_probs(branch(i, tokens, parents)) for i in frontier.tolist()])

        d = min(depth, budget - 1)
        tokens, parent, _, score = grow_tree(log_probs(()), expand, width, d, budget)
        got = {branch(i, tokens, parent): float(score[i]) for i in range(1, len(tokens))}
        level = [((t,), s) for s, t in zip(*[x.tolist() for x in log_probs(()).topk(width)])]
        every = list(level)
        for _ in range(2, d + 1):
            level = [(b + (t,), s + c) for b, s in sorted(level, key=lambda x: -x[1])[:width]
                     for c, t in zip(*[x.tolist() for x in log_probs(b).topk(width)])]
            every += level
        want = sorted(every, key=lambda x: -x[1] + 1e-4 * len(x[0]))[: budget - 1]
        assert got.keys() == {b for b, _ in want}
        assert all(got[b] == pytest.approx(s, abs=1e-5) for b, s in want)
        assert sum(expanded) <= width * (d - 1)
    assert expanded == [4, 4, 4]  # budget 40 reaches every frontier node
    expanded.clear()
    grow_tree(log_probs(()), expand, width, 3, 4)
    assert expanded == [2, 1]


def test_tree_from_parents_masks_exactly_the_ancestors():
    parent = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6])
    depth = torch.tensor([0, 1, 1, 2, 2, 2, 3, 4])
    for ngram in (0, 3):
        tree = tree_from_parents(parent, depth, 4, ngram)
        n = tree.num_nodes
        assert n == 8 + ngram
        for i in range(n):
            anc, j = {i}, i
            while tree.parent[j] >= 0:
                j = int(tree.parent[j])
                anc.add(j)
            assert set(tree.mask[i].nonzero()[:, 0].tolist()) == anc
        leaves = {i for i in range(n) if i not in tree.parent.tolist()}
        assert {int(r[r >= 0][-1]) for r in tree.retrieve} == leaves


# exactness ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ngram", [None, NgramConfig(length=5)])
def test_random_drafters_give_plain_output(model, kind, ngram):
    drafter = make(kind, model, seed=1)
    for prompt in prompts(5, seed=2):
        ref, _ = run(model, prompt, None)
        out, stats = run(model, prompt, drafter, ngram)
        assert out == ref
        assert stats.steps < len(out)  # the tree carried more than the root at least sometimes


class OracleHydra(HydraHeads):
    """Hydra heads that often guess right: head k returns the base's true feature k+1 steps on
    (found from a known plain run), so long branches are accepted and rejected at every depth."""

    def setup(self, hidden, hit=0.75, seed=0):
        self.known, self.hit, self.g = hidden, hit, torch.Generator().manual_seed(seed)
        return self

    def head(self, k, hidden, path_embeds, context):
        t = (self.known[None] - hidden[:, None]).norm(dim=-1).argmin(-1)  # [W]
        true = self.known[(t + k + 1).clamp(max=len(self.known) - 1)]
        miss = torch.rand(len(t), generator=self.g) > self.hit
        return torch.where(miss[:, None], torch.randn(true.shape, generator=self.g) * true.std(), true)


class OracleEagle(EagleLayer):
    """An eagle drafter that predicts the true feature after each position, often."""

    def setup(self, hidden, hit=0.75, seed=0):
        self.known, self.hit, self.g = hidden, hit, torch.Generator().manual_seed(seed)
        return self

    def forward(self, features, embeds, position_ids, mask, cache=None):
        true = self.known[(position_ids + 1).clamp(max=len(self.known) - 1)]  # [B, T, D]
        miss = torch.rand(position_ids.shape, generator=self.g) > self.hit
        return torch.where(miss[..., None], torch.randn(true.shape, generator=self.g) * true.std(), true)


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_drafters_accept_long_branches_and_stay_exact(model, kind):
    prompt = [10, 20, 30, 40, 50]
    ref, _ = run(model, prompt, None, max_new_tokens=60)
    with torch.no_grad():
        known = model.get_decoder()(input_ids=torch.tensor([prompt + ref])).last_hidden_state[0]
    config = drafters.DrafterConfig(drafter=kind, hidden_size=64, vocab_size=model.config.vocab_size,
                                    shortlist_size=model.config.vocab_size, num_heads=4, inner_size=32)
    oracle = (OracleHydra(config) if kind == "hydra" else OracleEagle(config, model)).setup(known)
    out, stats = run(model, prompt, oracle, max_new_tokens=60)
    assert out == ref
    assert stats.mean_accepted_length > 2.0, stats.accepted_lengths
    assert len(set(stats.accepted_lengths)) > 2  # accepted and rejected at several depths


def test_eagle_tree_drafting_equals_a_plain_recompute(model):
    """Each drafted node's score, computed with the drafter's cache and the tree mask, equals
    the sum of log-probs from re-running the drafter causally on prefix + branch, no cache (the
    same net: in fp32 on CPU drafting runs on a Q8_0 copy of the weights, draft_linears)."""
    drafter = make("eagle", model, seed=3, scale=1.0)
    prompt = torch.tensor(prompts(1, seed=4)[0] + [5, 6, 7])
    with torch.no_grad():
        feats = model.get_decoder()(input_ids=prompt[None]).last_hidden_state[0]  # [T, D]
        spec = proposers.wrap(drafter, model, budget=12)
        spec.width, spec.depth = 3, 3
        session = spec.proposer()
        root = torch.tensor(99)
        session.observe(feats, torch.cat([prompt[1:], root[None]]), None)
        session.propose(root)  # a first tree, then a committed step of 2 made-up positions
        extra_f, extra_t = torch.randn(2, feats.shape[1]), torch.tensor([42, 43])
        session.observe(extra_f, extra_t, torch.tensor([0, 1]))
        draft = session.propose(torch.tensor(43))
        f_all = torch.cat([feats, extra_f])
        t_all = torch.cat([prompt[1:], root[None], extra_t])
        short = drafter.shortlist(model)

        def last_output(f, t):
            pos = torch.arange(len(t))[None]
            return spec.net(f[None], model.get_input_embeddings()(t)[None], pos, None)[0, -1]

        for i in range(1, len(draft.tokens)):
            branch, j = [], i
            while j > 0:
                branch.append(j)
                j = int(draft.tree.parent[j])
            f, t, total = f_all, t_all, 0.0
            for node in reversed(branch):
                g = last_output(f, t)
                total += float(short.log_probs(g)[draft.tokens[node]])
                f, t = torch.cat([f, g[None]]), torch.cat([t, draft.tokens[node, None]])
            assert total == pytest.approx(float(draft.score[i]), abs=1e-4)


@pytest.mark.parametrize("layers", [None, [1, 2]], ids=["hydra", "hydra-fused"])
def test_hydra_heads_draft_what_training_scores(model, layers):
    """The proposer's depth-1 and depth-2 log-probs equal what the training forward gives for the same
    base features and branch: the heads read h_t (or the fused layers) and the branch alike in both."""
    net = make("hydra", model, seed=11, feature_layers=layers)
    spec = proposers.wrap(net, model, budget=8)
    width = len(layers or [0])
    features = torch.randn(3, width * model.config.hidden_size)  # [A, k D] a step's verified positions
    proposer = spec.proposer()
    proposer.observe(features, torch.tensor([5, 6, 7]), None)
    root, child = torch.tensor(7), 3  # the second node: the shortlist's token 3 under the root
    first, expand = proposer._expander(root)
    second = expand(torch.tensor([1]), torch.tensor([0, child]), torch.tensor([-1, 0]))[0]
    embed = model.get_input_embeddings()
    path = embed(torch.stack([root, spec.short.vocab[child], root]))[None]  # [1, K=3 used of 4, D]
    path = torch.cat([path, path[:, :1]], dim=1)  # [1, 4, D]: head k reads the first k + 1
    with torch.no_grad():  # spec.net: the module drafting runs (its linears on lean weights, drafters.draft_linears)
        want = spec.short.log_probs(spec.net(features[-1:], path))  # [K, 1, V']
    torch.testing.assert_close(first, want[0, 0])
    torch.testing.assert_close(second, want[1, 0])


@pytest.mark.parametrize("passes,layers", [(3, None), (7, [1, 2])], ids=["eagle1-3-passes", "eagle3-fused-7-passes"])
def test_training_passes_see_what_tree_nodes_see(model, passes, layers):
    """Unrolled pass a at position t (training) == a depth-(a+1) node at inference: the drafter
    re-run causally on the true prefix up to t-a, then its own predicted features. With fused
    features (EAGLE-3), the true prefix is fused from several base layers; deeper nodes read the
    drafter's own outputs."""
    drafter = make("eagle", model, seed=5, scale=1.0, feature_layers=layers)
    t_len = 12
    ids = torch.tensor(prompts(1, seed=6)[0][:3] + list(range(60, 60 + t_len)))[:t_len + 1]
    with torch.no_grad():
        out = model.get_decoder()(input_ids=ids[None], output_hidden_states=True)
        base = torch.cat([out.hidden_states[i][0] for i in layers], -1) if layers else out.last_hidden_state[0]
        f = drafter.from_base(base[:t_len])  # f_t, the drafter's input at verified positions
        tok = ids[1 : t_len + 1]  # x_{t+1}
        emb = model.get_input_embeddings()(tok)
        cache, x, outs = drafter.new_cache(), f[None], []
        pos = torch.arange(t_len)[None]
        for a in range(passes):
            out = drafter(x, emb[None], pos, ttt_mask(t_len, a, torch.float32), cache)
            outs.append(out[0])
            x = torch.cat([x.new_zeros(1, 1, f.shape[1]), out[:, :-1]], dim=1)
        for a in range(passes):
            for t in range(a, t_len):
                feats = f[: t - a + 1]
                for step in range(a):  # the chain of predicted features
                    n = len(feats)
                    g = drafter(feats[None], emb[None, :n], torch.arange(n)[None], None)[0, -1]
                    feats = torch.cat([feats, g[None]])
                n = len(feats)
                ref = drafter(feats[None], emb[None, :n], torch.arange(n)[None], None)[0, -1]
                torch.testing.assert_close(outs[a][t], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_drafters_draft_from_the_verifiers_fused_features_and_stay_exact(model, kind):
    """A random drafter on fused layers 1 and 2 (EAGLE-3; hydra --fused) decodes token-identically to
    plain, and the features its rows observe are the base's hidden states of those layers at those
    positions."""
    drafter = make(kind, model, seed=8, feature_layers=[1, 2])
    seen = []
    spec = proposers.wrap(drafter, model, budget=8)
    assert spec.feature_layers == (1, 2)
    for prompt in prompts(4, seed=9):
        ref, _ = run(model, prompt, None)
        out, stats = run(model, prompt, drafter)
        assert out == ref and stats.steps < len(out)
    prompt = prompts(1, seed=10)[0]
    from medusa_decoding.engine import Decoder, Method, Request
    from medusa_decoding.verifiers.transformers import EagerBackend, TransformersVerifier

    class Spy(type(spec.proposer())):
        def observe(self, hidden, next_tokens, nodes):
            seen.append(hidden.clone())
            super().observe(hidden, next_tokens, nodes)

    spec.proposer = lambda: Spy(spec)
    method = Method(spec)
    decoder = Decoder(TransformersVerifier(EagerBackend(model), feature_layers=method.feature_layers), method, {EOS})
    first = decoder.add(Request(torch.tensor(prompt), GenerationConfig(max_new_tokens=20)))
    tokens = list(first.tokens)
    while True:
        (o,) = decoder.step()
        tokens += o.tokens
        if o.finished:
            break
    with torch.no_grad():
        hs = model.get_decoder()(input_ids=torch.tensor([prompt + tokens]), output_hidden_states=True).hidden_states
    full = torch.cat([hs[1][0], hs[2][0]], -1)  # [T, 2 D]
    got = torch.cat(seen)  # every verified position once, in order
    assert got.shape[1] == 2 * model.config.hidden_size
    torch.testing.assert_close(got, full[: got.shape[0]], atol=1e-4, rtol=1e-4)
    with pytest.raises(MedusaError, match="the drafter reads"):
        Decoder(TransformersVerifier(EagerBackend(model)), method, {EOS})


# checkpoints, engine, training ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_round_trip_engine_and_misfit(model, kind, tmp_path):
    drafter = make(kind, model, seed=7)
    drafter.vocab.copy_(torch.randperm(model.config.vocab_size))
    drafter.save_pretrained(tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["drafter"] == kind
    loaded = drafters.from_pretrained(tmp_path / "d", model)
    for (k, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    m = MedusaModel(model, byte_tokenizer(), heads=loaded)
    plain = m.generate("hello there", max_new_tokens=30, use_medusa=False, chat=False)
    spec = m.generate("hello there", max_new_tokens=30, chat=False)
    assert spec.token_ids == plain.token_ids
    with pytest.raises(MedusaError, match="drafts its own tree"):
        MedusaModel(model, byte_tokenizer(), heads=loaded, tree=[[0]])
    other = tiny_llama(vocab=320)
    with pytest.raises(MedusaError, match="vocab_size=300.*vocab_size=320"):
        drafters.from_pretrained(tmp_path / "d", other)


def test_unknown_drafter_kind_is_refused():
    with pytest.raises(MedusaError, match="unknown drafter"):
        drafters.DrafterConfig(drafter="medusa2")
    with pytest.raises(MedusaError, match="unknown drafter 'lookahead'"):  # before anything loads
        train(TrainConfig(drafter="lookahead", model="/no/such/model", data="/no/such/data", out="/no/such/out"))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory, with_heads=False)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_training_learns_and_the_checkpoint_drafts(base_dir, tmp_path, kind):
    data = counting_data(tmp_path / "d.jsonl", n=60)
    metrics = train(train_cfg(base_dir, data, tmp_path / "run", drafter=kind, epochs=3, train_vocab=64,
                              inner_size=64, unroll=2, batch_size=256 if kind == "eagle" else 64, lr=5e-3),
                    progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.7 * log[0]["loss"]
    assert metrics["drafter"] == kind and len(metrics["eval"]["top1"]) == (2 if kind == "eagle" else 4)
    m = MedusaModel.from_pretrained(str(base_dir), heads=tmp_path / "run", compile="off", dtype="float32",
                                    device="cpu")
    assert m.heads.kind == kind and m.heads.vocab.numel() == 64
    plain = m.generate("count from 7", max_new_tokens=40, use_medusa=False)
    spec = m.generate("count from 7", max_new_tokens=40)
    assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("kind", ("medusa",) + KINDS)
def test_warm_start_continues_from_the_checkpoint(base_dir, tmp_path, kind):
    """--init: the run starts from the checkpoint's weights and keeps its shape and shortlist,
    even when the new data's most frequent tokens differ; a checkpoint of another kind is refused."""
    from safetensors.torch import load_file

    shape = dict(drafter=kind, train_vocab=64, inner_size=64, unroll=2, batch_size=256 if kind == "eagle" else 64)
    train(train_cfg(base_dir, counting_data(tmp_path / "a.jsonl", n=60), tmp_path / "a", epochs=1, **shape),
          progress=False)
    other = tmp_path / "b.jsonl"  # letters, not digits: another shortlist if it were chosen afresh
    other.write_text("".join(json.dumps({"id": f"l{i}", "conversations": [
        {"from": "human", "value": "spell"}, {"from": "gpt", "value": " ".join("klmnopqrstuvwxyz"[i % 7:] * 2)}]}) + "\n"
        for i in range(60)))
    warm = shape | dict(num_heads=2, inner_size=32, train_vocab=16, lr=1e-12, warmup_steps=1)  # shape comes from --init
    train(train_cfg(base_dir, other, tmp_path / "b", epochs=0.2, init=str(tmp_path / "a"), **warm), progress=False)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), atol=1e-5), name
    if kind != "medusa":
        assert torch.equal(a["vocab"], b["vocab"])
    with pytest.raises(MedusaError, match=f"holds a {kind} drafter"):
        train(train_cfg(base_dir, other, tmp_path / "c", drafter="hydra" if kind == "medusa" else "medusa",
                        init=str(tmp_path / "a")), progress=False)
    with pytest.raises(MedusaError, match="no such checkpoint"):
        train(train_cfg(base_dir, other, tmp_path / "d", drafter=kind, init=str(tmp_path / "nowhere")), progress=False)


def test_drafter_calibration_measures_the_grid_and_saves_the_best(model, tmp_path):
    from medusa_decoding import calibrate as cal

    drafter = make("hydra", model, seed=8)
    drafter.save_pretrained(tmp_path / "d")
    m = MedusaModel(model, byte_tokenizer(), heads=drafters.from_pretrained(tmp_path / "d", model))
    grid = ((2, 2, 4), (3, 2, 6))
    result = cal.fit_drafter(m, [torch.tensor([p]) for p in prompts(3, seed=9)], max_new_tokens=12, grid=grid)
    assert [(r["depth"], r["width"], r["budget"]) for r in result["grid"]] == list(grid)
    assert result["best"]["median_speedup"] == max(r["median_speedup"] for r in result["grid"])
    assert (m.heads.config.draft_depth, m.heads.config.draft_budget) == (4, 16)  # restored
    cal.save_drafter_fit(result, tmp_path / "d")
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (saved["draft_depth"], saved["draft_width"], saved["draft_budget"]) == tuple(
        result["best"][k] for k in ("depth", "width", "budget"))
    assert drafters.from_pretrained(tmp_path / "d", model).config.draft_budget == result["best"]["budget"]


@pytest.mark.parametrize("kind", KINDS)
def test_drafters_stop_at_the_context_end_and_sample_reproducibly(kind):
    small = tiny_llama(max_positions=48)
    drafter = make(kind, small, seed=10)
    prompt = prompts(1, seed=11)[0][:20]
    ref, _ = run(small, prompt, None, max_new_tokens=100)
    out, _ = run(small, prompt, drafter, NgramConfig(length=4), max_new_tokens=100)
    assert out == ref and len(prompt) + len(out) <= 48
    m = MedusaModel(small, byte_tokenizer(), heads=drafter)
    a = m.generate(torch.tensor([prompt]), max_new_tokens=30, temperature=0.8, seed=3)
    b = m.generate(torch.tensor([prompt]), max_new_tokens=30, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_cli_picks_the_drafter_from_the_checkpoint(capsys, monkeypatch, base_dir, tmp_path):
    from conftest import run_cli as medusa

    model = tiny_llama()
    make("eagle", model, seed=12).save_pretrained(tmp_path / "eagle")
    common = ["--model", base_dir, "--no-chat", "-n", "12", "--dtype", "float32", "--device", "cpu"]
    code, out, err = medusa(capsys, monkeypatch, "generate", "-p", "hello", "--heads", tmp_path / "eagle",
                            "--tree-budget", "6", *common)
    assert code == 0 and err.splitlines()[-1].startswith(f"[eagle (drafted 6-node tree) + {NgramConfig.length}-token n-gram branch] 12 tokens")
    code, plain, _ = medusa(capsys, monkeypatch, "generate", "-p", "hello", "--no-medusa", *common)
    assert code == 0 and plain == out
    code, _, err = medusa(capsys, monkeypatch, "generate", "-p", "hello", "--heads", tmp_path / "eagle",
                          "--tree", "dynamic", *common)
    assert code == 0
    from medusa_decoding import server as server_module

    served = []
    monkeypatch.setattr(server_module, "serve", lambda model, **kw: served.append(model))
    code, _, err = medusa(capsys, monkeypatch, "serve", "--model", base_dir, "--heads", tmp_path / "eagle")
    assert code == 0 and served[0].drafter.kind == "eagle"  # the server runs every method
    code, _, err = medusa(capsys, monkeypatch, "bench", "--model", base_dir, "--methods", "plain,eagle",
                          "--prompts", tmp_path / "none.jsonl")
    assert code == 2 and err.startswith("error:")


# compiled drafting ---------------------------------------------------------------------------------

def test_hydra_drafting_on_a_saved_graph_drafts_the_eager_trees_and_stays_exact(tmp_path, monkeypatch):
    """A compiled backend drafts hydra's trees on a saved graph (HydraDraft, one per width, depth and
    budget): the graph's tree is the eager drafting's, with the weights of the drafter that runs it,
    decoding gives plain decoding's tokens, and a graph that does not compile leaves drafting eager."""
    from medusa_decoding.models import use_fast_attention
    from medusa_decoding.proposers.hydra import expander
    from medusa_decoding.verifiers import compiled
    from medusa_decoding.verifiers.compiled import CompiledBackend
    from medusa_decoding.verifiers.transformers import EagerBackend

    base = tiny_llama(max_positions=512)
    use_fast_attention(base)
    weights = make("hydra", base, seed=11, feature_layers=[1, 2])
    backend = CompiledBackend(base, graphs=tmp_path)
    model = MedusaModel(base, byte_tokenizer(), heads=weights, tree_budget=5, backend=backend)
    spec = model.drafter
    graphs = backend.drafting(spec)
    assert graphs is not None and backend.drafting(spec) is graphs and EagerBackend(base).drafting(spec) is None
    g = torch.Generator().manual_seed(3)
    d = base.config.hidden_size
    for _ in range(4):
        features, root = torch.randn(2 * d, generator=g), torch.randint(0, 256, (1,), generator=g)
        with torch.inference_mode():
            got = graphs.run((spec.width, 4, 5), (features, root))
            first, expand = expander(spec.net, spec.embed, spec.short, features, root)
            want = grow_tree(first, expand, spec.width, 4, 5)
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))
        torch.testing.assert_close(got[3], want[3])
    assert len(list(tmp_path.rglob("draft-hydra-*-4-4-5.pt2"))) == 1
    # another drafter of the same shape (retrained, say) loads that graph and drafts with its own weights
    other = proposers.wrap(make("hydra", base, seed=21, feature_layers=[1, 2]), base, budget=5)
    loaded, again = backend.loaded, backend.drafting(other)
    features, root = torch.randn(2 * d, generator=g), torch.randint(0, 256, (1,), generator=g)
    with torch.inference_mode():
        got = again.run((other.width, 4, 5), (features, root))
        want = grow_tree(*expander(other.net, other.embed, other.short, features, root), other.width, 4, 5)
        mine = graphs.run((spec.width, 4, 5), (features, root))
    assert backend.loaded == loaded + 1 and all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))
    assert not torch.equal(got[3], mine[3])
    plain = MedusaModel(base, byte_tokenizer(), backend=EagerBackend(base))
    for prompt in prompts(3, seed=12):
        ids = torch.tensor([prompt])
        runs = graphs.runs
        out = model.generate(ids, max_new_tokens=24, ignore_eos=True)
        assert out.token_ids == plain.generate(ids, max_new_tokens=24, ignore_eos=True).token_ids
        assert graphs.runs - runs == out.stats.steps

    def no_compiler(args, path, fn=None):
        calls.append(path)
        raise RuntimeError("no C++ compiler")

    calls = []
    monkeypatch.setattr(compiled, "build_graph", no_compiler)
    with torch.inference_mode():
        assert graphs.run((spec.width, 2, 3), (features, root)) is None and graphs.failed == {(spec.width, 2, 3)}
        assert graphs.run((spec.width, 2, 3), (features, root)) is None and len(calls) == 1


def test_the_background_builder_builds_hydra_drafting_and_the_next_run_drafts_on_it(tmp_path_factory, tmp_path):
    """Compile mode auto: drafting runs eager while the background builder (the verify step's) builds
    its graph from the drafter's folder; then the run drafts on the saved graph, the same tokens."""
    import os

    from medusa_decoding.verifiers.compiled import CompiledBackend

    folder, _ = save_tiny(tmp_path_factory, max_positions=512, with_heads=False)
    base = tiny_llama(max_positions=512)
    make("hydra", base, seed=13).save_pretrained(tmp_path / "hydra")
    os.environ["MEDUSA_CACHE"], before = str(tmp_path / "cache"), os.environ["MEDUSA_CACHE"]
    try:
        model = MedusaModel.from_pretrained(str(folder), heads=tmp_path / "hydra", tree_budget=4, ngram=None, dtype="float32",
                                            device="cpu", compile="auto")
        backend = model.backend
        assert isinstance(backend, CompiledBackend) and backend.mode.value == "auto"
        backend.background = True  # a server's choice: a child process builds what is listed
        backend.builder_idle_s = 0.0  # the builder exits once the list is done
        ids = torch.tensor([prompts(1, seed=14)[0]])
        want = model.generate(ids, max_new_tokens=16, use_medusa=False, ignore_eos=True).token_ids
        first = model.generate(ids, max_new_tokens=16, ignore_eos=True)
        graphs = backend.drafting(model.drafter)
        assert first.token_ids == want and graphs.runs == 0 and backend.builder is not None
        assert backend.builder.wait(timeout=600) == 0, (backend.folder / "builder.log").read_text()[-2000:]
        assert len(list(backend.folder.glob("draft-hydra-*.pt2"))) == 1
        backend.missing = dict.fromkeys(backend.missing, 0.0)  # as if RECHECK_S had passed
        backend.load_s = 0.0  # loading is free: a saved graph is loaded at once
        again = model.generate(ids, max_new_tokens=16, ignore_eos=True)
        assert again.token_ids == want and graphs.runs == again.stats.steps > 0
    finally:
        os.environ["MEDUSA_CACHE"] = before
