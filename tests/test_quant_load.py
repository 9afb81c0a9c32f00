"""A LoRA base quantized while it loads on XLA (xla_train.kernels.quant_load): what `load_base` gives
on the xla backend (from_pretrained with the package's quantization_config, each projection
quantized as it is read) is, tensor for tensor, the model loaded whole and then quantized
(`quantize_base`): tiny decoders with their checkpoints' flags (Llama: tied embeddings and grouped
keys and values; Qwen2: attention biases; Gemma: multi-query), a checkpoint missing a projection's
weight and one missing its bias, and the bundled MiniLM with its new classifier head. In this
process: each load takes a fraction of a second. (Peak memory: benchmarks/bench_quant_load.py.)"""

import shutil

import pytest
import torch

from xla_train.core.errors import UserError
from xla_train.kernels.quant import Quant

QUANTS = (Quant(8, "int8"), Quant(4, "nf4"), Quant(4, "nf4", nested=True))
FAMILIES = ("llama", "qwen2", "gemma")
# checkpoints with a tensor left out (transformers initialises it from the seed, as the whole load does):
# a projection's weight (Llama), a projection's bias (Qwen2's, read after its weight would have been)
LEFT_OUT = {"llama-no-weight": ("llama", "model.layers.1.mlp.down_proj.weight"),
            "qwen2-no-bias": ("qwen2", "model.layers.0.self_attn.k_proj.bias")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import tiny_decoders as td
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("quant_load")
    saved = {family: td.save(family, folder / family) for family in FAMILIES}
    for name, (family, key) in LEFT_OUT.items():
        shutil.copytree(saved[family], folder / name)
        tensors = load_file(saved[family] / "model.safetensors")
        del tensors[key]
        save_file(tensors, folder / name / "model.safetensors", metadata={"format": "pt"})
        saved[name] = folder / name
    return saved


def both(load, quant):
    """(the model `load()` gives, quantized after it loads whole; the model load_base gives on XLA),
    each with the global generator's state right after its load (LoRA's initialisation draws next)."""
    from xla_train.kernels.quant_xla import quantize_base
    from xla_train.models import load_base

    whole = load()
    drawn = torch.random.get_rng_state()
    quantize_base(whole, quant)
    loaded = load_base(load, quant, "xla", "fp32", "tiny")
    return whole, drawn, loaded, torch.random.get_rng_state()


def assert_same(whole, drawn, loaded, drawn_after):
    from xla_train.kernels.quant_xla import QuantLinear

    assert [(n, type(m), m.training) for n, m in whole.named_modules()] == \
        [(n, type(m), m.training) for n, m in loaded.named_modules()]
    assert not any(m.training for m in loaded.modules())  # in eval mode, as from_pretrained leaves a model
    assert any(isinstance(m, QuantLinear) for m in loaded.modules())
    for tensors in (lambda m: m.named_parameters(remove_duplicate=False),
                    lambda m: m.named_buffers(remove_duplicate=False)):  # with the non-persistent ones (inv_freq)
        want, got = dict(tensors(whole)), dict(tensors(loaded))
        assert want.keys() == got.keys()
        for k, w in want.items():
            g = got[k]
            assert (g.dtype, g.device, g.requires_grad) == (w.dtype, w.device, w.requires_grad), k
            assert torch.equal(g, w), k
    # the same ties (a tied tensor is listed once), the same config, no quantizer left on the model
    assert [n for n, _ in whole.named_parameters()] == [n for n, _ in loaded.named_parameters()]
    assert not hasattr(loaded, "hf_quantizer") and loaded.config.to_dict() == whole.config.to_dict()
    assert torch.equal(drawn, drawn_after)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: f"{q.kind}{'-nested' if q.nested else ''}")
@pytest.mark.parametrize("name", [*FAMILIES, *LEFT_OUT])
def test_a_decoder_quantized_while_it_loads_is_the_one_quantized_after(checkpoints, name, quant):
    from xla_train.tasks.causal_lm import DecoderModel

    whole, drawn, loaded, drawn_after = both(lambda **loading: DecoderModel().load(str(checkpoints[name]), 7,
                                                                                   **loading), quant)
    if name.startswith("llama"):
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied, in full precision
    assert_same(whole, drawn, loaded, drawn_after)


def test_the_bundled_bert_and_its_new_head(capsys):
    from xla_train.models import bundled_model_path
    from xla_train.tasks.sequence import SequenceModel

    whole, drawn, loaded, drawn_after = both(lambda **loading: SequenceModel(num_labels=2).load(
        bundled_model_path(), 3, **loading), Quant(4, "nf4", nested=True))
    assert_same(whole, drawn, loaded, drawn_after)  # the classifier drawn from --seed alike
    assert "36 linear projections of the base held in nf4" in capsys.readouterr().out  # 6 layers x 6


def test_nothing_to_quantize_and_fp4_are_one_line(tmp_path):
    import tiny_decoders as td
    from transformers import AutoModelForCausalLM

    from xla_train.models import load_base, load_pretrained

    folder = str(td.save("gpt2", tmp_path / "gpt2"))

    def load(**loading):
        return load_pretrained(AutoModelForCausalLM, folder, **loading)

    with pytest.raises(UserError, match=r"^`load_in_4bit`: gpt2 has no linear projections"):
        load_base(load, Quant(4, "nf4"), "xla", "fp32", "gpt2")  # GPT-2's projections are Conv1D
    with pytest.raises(UserError, match="fp4 runs on the cuda and cpu backends"):
        load_base(load, Quant(4, "fp4"), "xla", "fp32", "gpt2")


def test_each_projection_is_quantized_while_the_others_are_unread(checkpoints, monkeypatch):
    """What keeps the memory down (benchmarks/bench_quant_load.py measures it): when a projection's
    weight is quantized, every projection not quantized yet is still unread (on the meta device),
    and each one is quantized there, none left to the end."""
    from xla_train.kernels import quant_load
    from xla_train.kernels.quant_xla import projections
    from xla_train.models import load_base
    from xla_train.tasks.causal_lm import DecoderModel

    unread, convert = [], quant_load._QuantizeOnLoad.convert

    def watched(self, input_dict, model=None, **kwargs):
        unread.append(sum(not linear.weight.is_meta for *_, linear in projections(model)))
        return convert(self, input_dict, model=model, **kwargs)

    monkeypatch.setattr(quant_load._QuantizeOnLoad, "convert", watched)
    model = load_base(lambda **loading: DecoderModel().load(str(checkpoints["llama"]), 7, **loading),
                      Quant(8, "int8"), "xla", "fp32", "tiny")
    assert unread == [0] * 14 and not projections(model)  # 7 projections x 2 blocks, all read as quantized
