"""A drafter is one file: a toy proposer defined here plugs in through the registry, with no
change to the package, and runs through generate, batched decoding and a checkpoint folder."""

import json

import torch
from torch import nn

from medusa_decoding import proposers
from medusa_decoding.config import GenerationConfig
from medusa_decoding.engine import MedusaModel, Request
from medusa_decoding.proposers import Drafter, DrafterSpec, Proposal, Proposer
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
