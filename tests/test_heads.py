import pytest
import torch

from medusa_decoding.config import MedusaError
from medusa_decoding.heads import MedusaHeads

from conftest import random_heads, tiny_llama


def test_fresh_heads_predict_like_the_base(model):
    heads = MedusaHeads.for_base(model, num_heads=3, num_layers=2)
    hidden = torch.randn(2, 5, 64)
    logits = heads(hidden, model.get_output_embeddings())
    assert logits.shape == (3, 2, 5, model.config.vocab_size)
    base = model.get_output_embeddings()(hidden)
    for k in range(3):  # W zero-initialised: every block is the identity
        torch.testing.assert_close(logits[k], base)


def test_every_block_has_its_own_weights(model):
    heads = MedusaHeads.for_base(model, num_heads=3, num_layers=2)
    params = [p.data_ptr() for p in heads.parameters()]
    assert len(params) == len(set(params)) == 3 * 2 * 2  # weight + bias per block
    heads.blocks[0][0].linear.weight.data.fill_(1.0)
    assert heads.blocks[1][0].linear.weight.abs().sum() == 0
    assert heads.blocks[0][1].linear.weight.abs().sum() == 0


@pytest.mark.parametrize("shared", [True, False])
def test_save_load_round_trip(model, tmp_path, shared):
    heads = random_heads(model, num_heads=2) if shared else MedusaHeads.for_base(model, 2, shared_lm_head=False)
    if not shared:
        torch.testing.assert_close(heads.lm_heads[1].weight, model.lm_head.weight)
        with torch.no_grad():
            heads.lm_heads[1].weight.add_(1.0)
    heads.save_pretrained(tmp_path)
    loaded = MedusaHeads.from_pretrained(tmp_path)
    assert loaded.config == heads.config
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(loaded(hidden, model.lm_head), heads(hidden, model.lm_head))
    names = set(__import__("safetensors.torch", fromlist=["load_file"]).load_file(tmp_path / "model.safetensors"))
    assert any(n.startswith("lm_heads") for n in names) != shared


def test_heads_that_do_not_fit_are_refused(model, tmp_path):
    other = tiny_llama(vocab=320)
    heads = MedusaHeads.for_base(other)
    with pytest.raises(MedusaError, match="vocab_size=320.*vocab_size=300"):
        heads.check_fits(model)


def test_missing_or_mismatched_checkpoint(model, tmp_path):
    with pytest.raises(MedusaError, match="no Medusa heads"):
        MedusaHeads.from_pretrained(tmp_path)
    heads = MedusaHeads.for_base(model, num_heads=2)
    heads.save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace('"medusa_num_heads": 2', '"medusa_num_heads": 3')
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(MedusaError, match="do not match"):
        MedusaHeads.from_pretrained(tmp_path)


def test_save_in_bfloat16_halves_the_file(model, tmp_path):
    heads = random_heads(model, num_heads=2)
    heads.save_pretrained(tmp_path / "fp32")
    heads.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    small, big = (tmp_path / "bf16" / "model.safetensors").stat().st_size, (tmp_path / "fp32" / "model.safetensors").stat().st_size
    assert small < 0.6 * big
    loaded = MedusaHeads.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(loaded(hidden, model.lm_head), heads(hidden, model.lm_head), atol=0.05, rtol=0.05)
