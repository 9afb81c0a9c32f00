"""The saved model: transformers' safetensors files written one file at a time from the weights
the run holds (Engine.save_pretrained, `shard_plan`), which plain transformers loads; the same
files, index and config as transformers' own `save_pretrained` writes."""

import json

import pytest
import tiny_decoders as td
import torch
from transformers import AutoModelForCausalLM

from xla_train.core import engine as engine_module
from xla_train.core.engine import Engine


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied embeddings; biases, untied
def test_a_model_is_saved_file_by_file_as_transformers_saves_it(family, tmp_path, monkeypatch):
    folder = td.save(family, tmp_path / "model")
    tokenizer = td.tokenizer()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    monkeypatch.setattr(engine_module, "SHARD_SIZE", "100KB")  # several files from a tiny model
    engine = Engine("cpu")
    saved, theirs = [], []

    def to_host(tensors, main_only=False):  # what each file's transfer carried
        saved.append(sum(t.numel() * t.element_size() for t in tensors))
        return [t.detach().cpu() for t in tensors]

    monkeypatch.setattr(engine, "to_host", to_host)
    engine.save_pretrained(model, tokenizer, tmp_path / "ours")
    model.save_pretrained(tmp_path / "theirs", max_shard_size="100KB")
    ours = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    theirs = json.loads((tmp_path / "theirs" / "model.safetensors.index.json").read_text())
    assert ours == theirs and len(set(ours["weight_map"].values())) > 2
    assert max(saved) <= 100_000 + max(p.numel() * 4 for p in model.parameters())  # a file at a time
    assert json.loads((tmp_path / "ours" / "config.json").read_text()) == \
        json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert (tmp_path / "ours" / "generation_config.json").read_text() == \
        (tmp_path / "theirs" / "generation_config.json").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    for (name, mine), (_, original) in zip(loaded.state_dict().items(), model.state_dict().items()):
        assert torch.equal(mine, original), name
    if family == "llama":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied again


def test_weights_transformers_converts_on_saving_are_saved_by_it(tmp_path):
    """A mixture of experts whose experts transformers stacks on loading: `shard_plan` gives way
    to transformers' own save, which splits them again."""
    folder = td.save("mixtral", tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    from xla_train.io.checkpoint_io import whole_state

    assert engine_module.shard_plan(model, whole_state(model)) is None
    Engine("cpu").save_pretrained(model, td.tokenizer(), tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
