"""A drafter is one file: toy kinds defined here plug in through the registry, with no change to
the package, and run through generate, batched decoding, a checkpoint folder and `train`."""

import json

import torch
from torch import nn

from medusa_decoding import proposers
from medusa_decoding.config import GenerationConfig
from medusa_decoding.engine import MedusaModel, Request
from medusa_decoding.proposers import Drafter, DrafterSpec, Proposal, Proposer
from medusa_decoding.training import IGNORE, Trainer, load_positions
from medusa_decoding.tree import build_tree

from conftest import byte_tokenizer, save_tiny, tiny_llama


class ToyWeights(nn.Module):
    """No weights at all: the toy guesses that the last token repeats."""

    kind = "toy-repeat"


class ToyDrafter(Drafter):
    kind = "toy-repeat"

    def __init__(self, weights, base_model, tree=None, budget=None):
        self.length = (budget or 4) - 1
        self.tree = build_tree([(0,) * d for d in range(1, self.length + 1)])  # a chain

    def proposer(self):
        return ToyProposer(self)

    def tree_sizes(self):
        return {self.length + 1}


class ToyProposer(Proposer):
    def __init__(self, drafter):
        self.drafter = drafter
        self.depth_limit = drafter.length
        self.seen = 0  # positions observed: the proposer sees every verified position once

    def propose(self, root, budget=None):
        if budget == 1:
            return None
        tokens = root.reshape(1).repeat(self.drafter.length + 1)
        return Proposal(tokens, self.drafter.tree)

    def observe(self, hidden, next_tokens, nodes):
        self.seen += len(next_tokens)


proposers.register("toy-repeat", DrafterSpec(load=lambda folder, base: ToyWeights(), wrap=ToyDrafter))


def test_a_toy_proposer_plugs_in_through_the_registry(tmp_path_factory):
    base, tok = tiny_llama(), byte_tokenizer()
    prompt = torch.tensor([[5, 6, 7, 7, 7, 7, 8, 9]])
    want = MedusaModel(base, tok).generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
    toy = MedusaModel(base, tok, heads=ToyWeights())
    assert toy.drafter.kind == "toy-repeat" and toy.tree_sizes() == [1, 4]
    out = toy.generate(prompt, max_new_tokens=30, ignore_eos=True)
    assert out.token_ids == want and out.stats.steps <= 29
    got = toy.decoder(2).run([Request(prompt[0], GenerationConfig(max_new_tokens=30, ignore_eos=True), id=i)
                              for i in range(2)])
    assert got == {0: want, 1: want}
    # a checkpoint naming the kind loads through the registry, like the built-in ones
    folder, _ = save_tiny(tmp_path_factory, with_heads=False)
    ckpt = tmp_path_factory.mktemp("toy")
    (ckpt / "config.json").write_text(json.dumps({"drafter": "toy-repeat"}))
    loaded = MedusaModel.from_pretrained(str(folder), heads=ckpt, compile="off", dtype="float32", device="cpu")
    assert isinstance(loaded.drafter, ToyDrafter)
    assert loaded.generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids == want


class ToyBigram(nn.Module):
    """A trainable toy kind: one linear layer from h_t to the token after next (t + 2), a
    one-head Medusa in a few lines; saved as config.json + weights.pt."""

    kind = "toy-bigram"

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.hidden, self.vocab_size = hidden, vocab
        self.proj = nn.Linear(hidden, vocab)

    def forward(self, h):  # [B, D] -> [B, V]
        return self.proj(h)

    def save_pretrained(self, folder):
        (folder / "config.json").write_text(json.dumps({"drafter": self.kind, "hidden": self.hidden,
                                                       "vocab": self.vocab_size}))
        torch.save(self.state_dict(), folder / "weights.pt")

    @classmethod
    def load(cls, folder, base):
        config = json.loads((folder / "config.json").read_text())
        weights = cls(config["hidden"], config["vocab"])
        weights.load_state_dict(torch.load(folder / "weights.pt"))
        return weights.to(base.dtype).eval()


class BigramDrafter(Drafter):
    """Proposes one node: its guess of the token after the root, from the last verified state."""

    kind = "toy-bigram"

    def __init__(self, weights, base_model, tree=None, budget=None):
        self.weights, self.tree = weights, build_tree([(0,)])

    def proposer(self):
        return BigramProposer(self)

    def tree_sizes(self):
        return {2}


class BigramProposer(Proposer):
    depth_limit = 1

    def __init__(self, drafter):
        self.drafter, self.last = drafter, None

    def propose(self, root, budget=None):
        if budget == 1 or self.last is None:
            return None
        guess = self.drafter.weights(self.last[None]).argmax(-1)  # [1]
        return Proposal(torch.cat([root.reshape(1), guess]), self.drafter.tree)

    def observe(self, hidden, next_tokens, nodes):
        self.last = hidden[-1]  # h of the last verified position: its head guesses the token after the next root


class BigramTrainer(Trainer):
    """How the toy trains: cross-entropy of h_t -> token t + 2 over the recorded positions."""

    def new_weights(self, base, layers):
        cfg = base.config
        return ToyBigram(cfg.hidden_size, cfg.vocab_size)

    def load(self, shards, limit):
        return load_positions(shards, 1, limit)

    def label_tokens(self, pos):
        return pos.labels[pos.labels != IGNORE]

    def loss(self, weights, pos, idx):
        labels = pos.labels[idx, 0]
        valid = labels != IGNORE
        logits = weights(pos.hidden[pos.index[idx]].float())[valid]
        top1 = (logits.argmax(-1) == labels[valid]).float().mean()
        return torch.nn.functional.cross_entropy(logits, labels[valid]), top1[None].detach()

    def evaluate(self, weights, shards, limit, lm_head, embed):
        pos = load_positions(shards, 1, limit)
        _, top1 = self.loss(weights, pos, torch.arange(len(pos)))
        return {"top1": top1.tolist(), "top5": top1.tolist(), "positions": [len(pos)]}


proposers.register("toy-bigram", DrafterSpec(load=ToyBigram.load, wrap=BigramDrafter, trainer=BigramTrainer))


def test_a_toy_kind_trains_and_drafts_from_this_file_alone(tmp_path_factory, tmp_path):
    """Adding a kind for training and inference is one file: `medusa train --drafter toy-bigram`
    trains it through the package's loop, and the checkpoint decodes losslessly."""
    from test_train import counting_data

    from medusa_decoding.config import TrainConfig
    from medusa_decoding.train import train

    folder, _ = save_tiny(tmp_path_factory, with_heads=False)
    data = counting_data(tmp_path / "d.jsonl", n=40)
    metrics = train(TrainConfig(model=str(folder), data=str(data), out=str(tmp_path / "run"), drafter="toy-bigram",
                                dtype="float32", device="cpu", mixed_precision="no", batch_size=64, warmup_steps=2,
                                lr=1e-2, epochs=3, eval_conversations=8, save_every=1000, log_every=5),
                    progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert metrics["drafter"] == "toy-bigram" and log[-1]["loss"] < 0.8 * log[0]["loss"]
    assert metrics["eval"]["top1"][0] > 0.3  # counting: the token after next is learnable
    model = MedusaModel.from_pretrained(str(folder), heads=tmp_path / "run", ngram=None, compile="off",
                                        dtype="float32", device="cpu")
    assert isinstance(model.drafter, BigramDrafter)
    prompt = "count from 7"
    plain = model.generate(prompt, max_new_tokens=24, use_medusa=False)
    out = model.generate(prompt, max_new_tokens=24)
    assert out.token_ids == plain.token_ids and out.stats.steps < len(out.token_ids)
