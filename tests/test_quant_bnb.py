"""--load-in-8bit / --load-in-4bit on the torch-native backends (xla_train/kernels/bnb.py): the base
quantized by bitsandbytes as transformers loads it, peft's bnb LoRA layers on it, on this CPU
(bitsandbytes' CPU backend). Every adapter of every layer of a tiny Llama gets the gradient of a
reference whose base is the dequantized weights in plain nn.Linear (fp32); two short CLI runs on the
tiny BERT (8-bit: the adapter, read back by predict and refused a resume under 4 bits; 4-bit NF4
with nested quantization and --merge-lora: merged onto the fp32 base); the refusals, in this process."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import run_cli

from xla_train.commands.cli import as_flags, main
from xla_train.core.errors import UserError
from xla_train.kernels import bnb
from xla_train.kernels.quant import Quant
from xla_train.models import add_adapters

sys.path.insert(0, str(Path(__file__).parent))
import tiny_decoders  # noqa: E402

INT8, NF4 = Quant(8, "int8"), Quant(4, "nf4", nested=True)
PROJECTIONS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # every Linear of a Llama block


def _adapted(path, loading):
    """The tiny Llama (fp32) with rank-4 adapters on every projection, B drawn at random (peft starts
    it at zero, which would leave A's gradient zero), the same draws for every base."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **loading)
    lora = SimpleNamespace(lora_targets=PROJECTIONS, lora_r=4, lora_alpha=8.0, lora_dropout=0.0)
    torch.manual_seed(1)  # peft draws A
    model = add_adapters(model, lora, "CAUSAL_LM")
    for name, p in sorted(model.named_parameters()):
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def _dequantized(weight):
    """A bitsandbytes weight as the fp32 matrix it stands for (bnb's own dequantization)."""
    import bitsandbytes.functional as F

    if hasattr(weight, "quant_state"):  # Params4bit: NF4/FP4 blocks (and, nested, their absmax quantized too)
        return F.dequantize_4bit(weight.data, weight.quant_state).float()
    return weight.data.float() * (weight.SCB.float().unsqueeze(1) / 127)  # Int8Params: a scale per output row


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_decoders.save("llama", tmp_path_factory.mktemp("llama"), size=64, layers=2)


@pytest.mark.parametrize("quant", [INT8, NF4], ids=["int8", "nf4-nested"])
def test_every_adapter_gets_the_dequantized_references_gradient(quant, tiny_llama):
    quantized = _adapted(tiny_llama, bnb.loading(quant, "cpu", "fp32"))
    bnb.check_quantized(quantized, quant, "tiny llama")
    reference = _adapted(tiny_llama, {})
    layers = dict(reference.named_modules())
    names = bnb.quantized_modules(quantized)
    assert len(names) == 2 * 7  # every projection of both blocks; lm_head kept
    assert type(quantized.base_model.model.lm_head) is torch.nn.Linear
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if name in names:  # the reference's plain nn.Linear gets the weights the base stands for
                layers[name].weight.copy_(_dequantized(module.weight))
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    for model in (quantized, reference):
        model.train()  # bitsandbytes' training path on the CPU (LLM.int8: MatMul8bitFp)
        model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in quantized.named_parameters() if p.requires_grad}
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == expected.keys() and len(grads) == 2 * 7 * 2  # A and B of every adapter
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-5, msg=name)


def test_generation_keeps_the_live_adapter_on_a_quantized_base(tiny_llama):
    """predict's generation merges a plain adapter into its base, never into 4-bit blocks (peft's
    bnb merge would round the adapter into them)."""
    from xla_train.tasks.completion import generation_model

    model = generation_model(_adapted(tiny_llama, bnb.loading(NF4, "cpu", "fp32")))
    assert hasattr(model, "peft_config") and not model.training
    assert not hasattr(generation_model(_adapted(tiny_llama, {})), "peft_config")  # plain LoRA: merged


def test_spawned_workers_get_bitsandbytes_parameters_of_their_kind(tiny_llama):
    """The job pickled to spawned workers (CUDA's; the CPU's where forking is unsafe) keeps
    Params4bit's quant_state and Int8Params' scales on parameters of their own kind, whose .to()
    moves them to the GPU (torch would rebuild plain Parameters)."""
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import bitsandbytes
    import torch.multiprocessing  # noqa: F401  torch's tensor reducers, as spawn pickles with them
    from transformers import AutoModelForCausalLM

    for quant, kind in ((INT8, bitsandbytes.nn.Int8Params), (NF4, bitsandbytes.nn.Params4bit)):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                     **bnb.loading(quant, "cpu", "fp32"))
        buf = io.BytesIO()
        ForkingPickler(buf).dump(model)
        copy = pickle.loads(buf.getvalue())
        layer, copied = model.model.layers[1].mlp.down_proj, copy.model.layers[1].mlp.down_proj
        assert type(copied.weight) is kind and torch.equal(copied.weight.data, layer.weight.data)
        if quant.bits == 4:
            assert copied.weight.module is copied and copied.weight.quant_state.nested
        else:
            assert torch.equal(copied.weight.SCB, layer.weight.SCB)
        ids = torch.arange(8)[None]
        torch.testing.assert_close(copy(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


# --- one CLI run per quantization (tiny BERT, 4 steps), shared ------------------------------------
@pytest.fixture(scope="module")
def bnb_runs(mrpc_slice, tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("bnb")
    runs = {}
    for name, extra in (("int8", ["--load-in-8bit"]),
                        ("nf4", ["--load-in-4bit", "--use-bnb-nested-quant", "--merge-lora"])):
        proc, m = run_cli(["--backend", "cpu", "--lora", *extra, "--model", tiny_model, "--data-dir", mrpc_slice,
                           "--max-steps", 4, "--lr", 1e-2, "--output-dir", out / name], out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (m, out / name, proc.stderr)
    return runs


@pytest.mark.slow
@pytest.mark.torch_native
def test_an_8bit_adapter_is_peft_own_and_predict_reads_it(bnb_runs, tiny_model, mrpc_slice, tmp_path):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    m, folder, stderr = bnb_runs["int8"]
    assert "MatMul8bitLt" not in stderr and "Traceback" not in stderr
    plain = AutoModelForSequenceClassification.from_pretrained(tiny_model, dtype=torch.float32)
    lora = SimpleNamespace(lora_targets=None, lora_r=8, lora_alpha=16.0, lora_dropout=0.05)
    plain = add_adapters(plain, lora, "SEQ_CLS")
    assert set(load_file(folder / "adapter_model.safetensors")) == set(get_peft_model_state_dict(plain))
    out = tmp_path / "pred.tsv"
    assert main(["predict", "--backend", "cpu", "--model", str(folder), "--input", str(mrpc_slice / "dev.tsv"),
                 "--output", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 1 + 48


@pytest.mark.slow
@pytest.mark.torch_native
def test_a_resume_under_another_quantization_is_one_line(bnb_runs, tiny_model, mrpc_slice, capsys):
    _, folder, _ = bnb_runs["int8"]
    assert main(["train", "--backend", "cpu", "--lora", "--load-in-4bit", "--model", str(tiny_model), "--data-dir",
                 str(mrpc_slice), "--max-steps", "4", "--output-dir", str(folder), "--resume"]) == 2
    assert capsys.readouterr().err == (f"xla-train: error: the run in {folder} was made with --load-in-8bit True; "
                                       "this run has --load-in-8bit False: resume with the same value, or start "
                                       "over with --overwrite\n")
    assert (folder / "adapter_model.safetensors").is_file()  # the run folder kept


@pytest.mark.slow
@pytest.mark.torch_native
def test_merge_lora_merges_onto_the_full_precision_base(bnb_runs, tiny_model):
    """The merged weights are the fp32 checkpoint's plus B @ A * alpha / r from the final
    checkpoint's adapters: never the 4-bit rounding of the base."""
    from safetensors.torch import load_file

    _, folder, _ = bnb_runs["nf4"]
    merged, base = load_file(folder / "model.safetensors"), load_file(Path(tiny_model) / "model.safetensors")
    adapters = load_file(sorted((folder / "checkpoints").glob("step-*"))[-1] / "model.safetensors")
    checked = 0
    for key, a in adapters.items():
        if ".lora_A." not in key:
            continue
        b = adapters[key.replace("lora_A", "lora_B")]
        weight = key.split("base_model.model.")[1].split(".lora_A")[0] + ".weight"
        torch.testing.assert_close(merged[weight], base[weight] + b @ a * (16 / 8), rtol=0, atol=1e-6)
        checked += 1
    assert checked == 4  # query and value of both layers


# --- refusals, in this process ---------------------------------------------------------------------
def test_backends_and_strategies_that_cannot_hold_a_bitsandbytes_base():
    """The lines as the command line shows them (cli.as_flags: the library names `load_in_4bit`)."""
    assert as_flags(bnb.refusal(NF4, "tpu", False)) == ("--load-in-4bit runs on the xla, cuda and cpu backends; "
                                                 "TorchTPU (--backend tpu) has no bitsandbytes")
    assert as_flags(bnb.refusal(INT8, "cpu", True)) == ("--load-in-8bit on the cpu backend runs under --strategy ddp: "
                                                   "FSDP2 (--strategy fsdp) shards plain tensors and would drop "
                                                   "bitsandbytes' scales")
    assert bnb.refusal(NF4, "cuda", False) is None and bnb.refusal(INT8, "cpu", False) is None
    assert bnb.refusal(INT8, "xla", True) is None  # the xla backend's quantized linear is its own
    from xla_train.core.select import select_roles

    with pytest.raises(UserError, match="runs under `strategy` ddp"):
        bnb.check_roles(NF4, select_roles("cpu", 2, "fsdp"))
    bnb.check_roles(None, select_roles("cpu", 2, "fsdp"))  # no quantization: nothing to refuse


def test_missing_bitsandbytes_names_the_extra():
    with pytest.raises(UserError) as e:
        bnb.require("no_such_bitsandbytes_module")
    assert as_flags(str(e.value)) == ("--load-in-8bit and --load-in-4bit on the cuda and cpu backends need "
                            "no_such_bitsandbytes_module, which is not installed: pip install 'xla-train[quant]'")


def test_a_model_with_nothing_quantized_is_one_line(tiny_llama):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)  # no bitsandbytes layer
    with pytest.raises(UserError) as e:
        bnb.check_quantized(plain, INT8, "m")
    assert as_flags(str(e.value)) == ("--load-in-8bit: model m has no linear projection to quantize outside its head "
                            "(classifier, score, lm_head); train it without --load-in-8bit")


# --- DPO's reference and GRPO's rollouts on the quantized base (issue 63, item 2) ----------------
@pytest.mark.parametrize("quant", [INT8, NF4], ids=["int8", "nf4-nested"])
def test_dpos_reference_is_the_quantized_base_without_the_adapter(quant, tmp_path):
    """DPO's reference pass (peft's disable_adapter on the policy) gives the log-probabilities of
    the quantized base alone, loaded again the same way without peft (within 1e-5), never the fp32
    base's; the policy (adapters on, not zero) differs from it. In training mode, as the step runs it."""
    import tiny_decoders as td
    from test_dpo import _batch, _load, _logps, pairs
    from transformers import AutoModelForCausalLM

    model = td.save("llama", tmp_path / "llama", letters=True)
    task, tokenizer, data, _ = _load(td.write_jsonl(tmp_path / "p.jsonl", pairs(8, 5)), model)
    batch = _batch(data["train"], task.rows.collator(tokenizer))
    policy = _adapted(model, bnb.loading(quant, "cpu", "fp32")).train()
    for module in policy.modules():
        if hasattr(module, "lora_dropout"):
            assert not isinstance(module.lora_dropout["default"], torch.nn.Dropout)  # _adapted: dropout 0
    with torch.no_grad():
        out, policy_logps = _logps(task.objective, policy, batch)
        reference = torch.stack(task.objective.reference_logps(out, batch["labels"]), 1)
        bare = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **bnb.loading(quant, "cpu", "fp32"))
        _, expected = _logps(task.objective, bare.train(), batch)
        _, full = _logps(task.objective, AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), batch)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=0)
    assert (reference - full).abs().max() > 1e-4  # the rounded base, not the checkpoint's fp32 one
    assert (policy_logps - expected).abs().max() > 1e-2


@pytest.fixture(scope="module")
def preference_runs(tmp_path_factory):
    """DPO and GRPO (beta > 0: a reference) with --lora --load-in-4bit on the CPU, in this process,
    logging every step, the adapters without dropout (GRPO's sampler runs in eval mode: with
    dropout its log-probabilities could not match the update's). A tiny Llama over the task's words."""
    import tiny_decoders as td
    from test_dpo import pairs
    from test_grpo import REWARD, prompts

    out = tmp_path_factory.mktemp("preference")
    model = td.save("llama", out / "llama", chat=True, letters=True)
    common = ["--backend", "cpu", "--model", model, "--lora", "--load-in-4bit", "--lora-dropout", 0, "--log-every", 1,
              "--no-data-cache"]
    args = {"dpo": ["--problem", "dpo", "--train-file", td.write_jsonl(out / "pairs.jsonl", pairs(64, 1)),
                    "--validation-file", td.write_jsonl(out / "pairs-dev.jsonl", pairs(8, 2)), "--max-length", 32,
                    "--buckets", 32, "--batch-size", 16, "--lr", 3e-3, "--max-steps", 3],
            "grpo": ["--problem", "grpo", "--train-file", td.write_jsonl(out / "prompts.jsonl", prompts(64, 1)),
                     "--validation-file", td.write_jsonl(out / "prompts-dev.jsonl", prompts(4, 2)), "--reward",
                     REWARD, "--num-generations", 8, "--batch-size", 16, "--max-completion-length", 8,
                     "--max-length", 16, "--beta", 0.04, "--lr", 1e-2, "--max-steps", 3]}
    runs = {}
    for name, extra in args.items():
        proc, m = run_cli([*common, *extra, "--output-dir", out / name], out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (m, out / name, proc.stdout)
    return runs


@pytest.mark.slow
@pytest.mark.torch_native
@pytest.mark.parametrize("problem", ["dpo", "grpo"])
def test_dpo_and_grpo_train_the_adapter_of_a_4bit_base_and_merge_nothing(problem, preference_runs):
    """Only the adapters train (the base's 4-bit weights have no gradient and no optimizer state:
    the trained count is the saved adapter's, and training changed it from peft's zero B); the
    folder is the adapter over a base recorded as 4-bit, nothing merged."""
    from safetensors.torch import load_file

    m, folder, _ = preference_runs[problem]
    adapter = load_file(folder / "adapter_model.safetensors")
    assert m["trainable_params"] == sum(t.numel() for t in adapter.values()) < m["total_params"] / 10
    assert all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)  # trained from zero
    assert not (folder / "model.safetensors").exists()  # an adapter, not a merged model
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["load_in_4bit"]


@pytest.mark.slow
@pytest.mark.torch_native
def test_dpos_reference_and_grpos_kl_are_the_quantized_base(preference_runs):
    """At the first step the adapters are zero, so the policy is its base: DPO's rewards (policy
    against reference) and GRPO's KL are exactly 0 only if the reference is the same quantized base
    with the adapter switched off; once the adapters train they move away."""
    dpo, grpo = ([metrics for _, metrics in preference_runs[p][0]["train_metrics"]] for p in ("dpo", "grpo"))
    assert dpo[0]["rewards/chosen"] == 0 and dpo[0]["rewards/rejected"] == 0, dpo[0]
    assert any(d["rewards/chosen"] != 0 for d in dpo[1:]), dpo
    assert grpo[0]["kl"] == 0 and grpo[-1]["kl"] > 0, grpo


@pytest.mark.slow
@pytest.mark.torch_native
def test_grpos_rollouts_come_from_the_quantized_model_with_its_live_adapter(preference_runs):
    """The sampler's log-probability of each drawn token is the update's own (the quantized base
    with the adapter as it trains, bitsandbytes' inference path against its training path) at every
    step, after the adapter moved too: a merged or stale copy would differ by far more."""
    grpo = [metrics for _, metrics in preference_runs["grpo"][0]["train_metrics"]]
    assert len(grpo) == 3
    assert all(g["sampling/sampling_logp_difference/max"] < 1e-4 for g in grpo), grpo
