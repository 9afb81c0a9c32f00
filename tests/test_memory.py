"""The memory plan: exact bytes from the parameters, what autograd keeps per block and the logits,
a peak within 25% of the one measured on the CPU (torch's profiler, a scaled Llama), gradient
checkpointing switched on where only it makes the run fit, and a run that cannot fit its device
stops before anything compiles (in-process, the tiny BERT)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from tiny_decoders import scaled_llama_step
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

from xla_train.commands.cli import main
from xla_train.core.engine import checkpoint_activations
from xla_train.memory import (
    DEVICE_BYTES,
    GIB,
    MIB,
    activation_estimate,
    checkpointing_needed,
    describe,
    layer_bytes,
    measure_peak,
    plan,
    shape_of,
)
from xla_train.parallel.mesh import Mesh
from xla_train.tasks.base import PassInputs


def planned(model, rows, length, precision="fp32", shards=1, device_bytes=None, **step):
    """memory.plan of `model` (its parameters split over `shards` devices) for a step of `rows` x
    `length` tokens through sdpa (with a dense mask unless told), `step` the rest of its PassInputs."""
    step = PassInputs(**{"attention": "sdpa", **step}, rows=rows, length=length, precision=precision)
    return plan(Mesh(fsdp=shards).resolve(shards, sharded=True), step, shape_of(model), device_bytes)


def test_the_plan_counts_every_byte_of_what_trains():
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64))
    total = sum(p.numel() for p in model.parameters())
    memory = planned(model, rows=8, length=64)
    assert memory.counts() == {"trainable_params": total, "total_params": total}
    assert memory.weights_total == memory.weights == 4 * total
    assert memory.gradients == 4 * total and memory.optimizer == 8 * total
    for p in model.bert.embeddings.parameters():  # a frozen part has no gradient and no optimizer state
        p.requires_grad_(False)
    frozen = sum(p.numel() for p in model.bert.embeddings.parameters())
    memory = planned(model, rows=8, length=64)
    assert memory.trainable_params == total - frozen and memory.gradients == 4 * (total - frozen)
    assert memory.optimizer == 8 * (total - frozen)
    # the peak: parameters + AdamW + the larger of the backward pass's start and its end, not their sum
    start = memory.activations + memory.autocast_copies
    end = memory.gradients + memory.layer
    assert memory.total == memory.metrics()["peak_bytes_estimate"] == 12 * total - 8 * frozen + max(start, end)


def test_what_each_block_keeps_follows_the_attention_path_and_precision():
    """Per token and block: no heads x length term unless the attention is eager; a dense mask's bias
    (length values in the compute dtype) only where one is passed to sdpa; K and V copied to every
    query head only where the path repeats them; 16-bit matmul outputs under bf16."""
    cfg = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    h, inter, heads, s = 256, 1024, 4, 512

    def per_token(**kw):
        return layer_bytes(cfg, 1, s, **kw) / s

    # fp32, sdpa with a mask: norms 2 x 12h, q/k/v/out/o_proj input 5 x 4h, lse, 4 MLP values, the bias
    assert per_token() == 2 * 12 * h + 5 * 4 * h + 4 * heads + 4 * 4 * inter + 4 * s
    assert per_token(dense_mask=False) == 2 * 12 * h + (3 * 4 * h + 2 * 4 * h // 2) + 4 * heads + 4 * 4 * inter
    assert per_token(attention="eager") == 2 * 12 * h + 5 * 4 * h + 4 * heads * s + 4 * 4 * inter
    assert per_token(attention="flash_attention_2") == per_token(dense_mask=False)
    assert per_token(precision="bf16") == 2 * 10 * h + 5 * 2 * h + 4 * heads + 4 * 2 * inter + 2 * s
    kept = activation_estimate(cfg, 8, s, "bf16")
    checkpointed = activation_estimate(cfg, 8, s, "bf16", checkpointed=True)
    final_norm = 8 * s * 10 * h
    assert kept == 4 * layer_bytes(cfg, 8, s, "bf16") + final_norm
    assert checkpointed == 4 * 4 * h * 8 * s + final_norm  # each block's fp32 input
    # Llama 3.2 1B, bf16, sdpa with the packed path's mask, 2,048 tokens: about 64 x hidden bytes a
    # token and block (66 measured on an H200, issue 44)
    llama = LlamaConfig(**LLAMA_1B)
    assert 60 <= layer_bytes(llama, 1, 2048, "bf16") / 2048 / 2048 <= 68


def test_dpo_with_adapters_plans_its_reference_pass():
    """DPO with --lora runs the model a second time in the step, adapters disabled, without
    gradients (tasks/dpo.py): its final hidden states live through the backward pass. The peak
    measured on the CPU grows by what the plan adds for it (within 5%) over the same step with
    the reference precomputed, and the plan of that model under DPO says so."""
    from xla_train.models import add_adapters
    from xla_train.options import TrainOptions
    from xla_train.tasks.dpo import PreferenceObjective

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=30522, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
                      use_cache=False, attn_implementation="sdpa")
    model = add_adapters(LlamaForCausalLM(cfg).train(), TrainOptions(lora=True).section("model"), "CAUSAL_LM")
    rows, length, objective = 2, 256, PreferenceObjective(attention="mask")
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, cfg.vocab_size, (rows, length), generator=g) for _ in range(2))
    segments = torch.ones(rows, length, dtype=torch.long)
    segments[:, length // 2:] = 2
    positions = torch.arange(length // 2).repeat(2).expand(rows, -1)
    precomputed = {"ref_chosen": torch.zeros(rows), "ref_rejected": torch.zeros(rows)}

    def step(reference):
        inputs = {"input_ids": ids, "segments": segments, "position_ids": positions, **reference}
        objective.loss(objective.forward(model, inputs), labels).backward()
        for p in model.parameters():
            p.grad = None

    peaks = {}
    for name, reference in (("precomputed", precomputed), ("adapters", {})):
        step(reference)
        peaks[name] = measure_peak(lambda: step(reference))  # noqa: B023
    path = objective.memory_inputs(model, "cpu", length)
    assert path.reference == "chunked" and path.logits == "chunked"
    memory = planned(model, rows, length, logits="chunked", reference=path.reference)
    assert memory.reference == rows * length * cfg.hidden_size * 4
    assert abs((peaks["adapters"] - peaks["precomputed"]) / memory.reference - 1) <= 0.05, peaks
    without = planned(model, rows, length, logits="chunked")
    assert memory.total == without.total + memory.reference
    assert objective.memory_inputs(model.get_base_model(), "cpu", length).reference is None
    # a head computed whole (LoRA on it, a family that rescales its logits): the whole logits, bf16 here
    whole = planned(model, rows, length, "bf16", logits="whole", reference="whole")
    assert whole.reference == rows * length * cfg.vocab_size * 2


LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, pad_token_id=0)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["kept", "checkpointed"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-logits", "chunked-logits"])
def test_the_plan_predicts_the_peak_measured_on_the_cpu(checkpointed, chunked):
    """torch's profiler counts every byte the CPU allocator hands out during a forward and backward
    pass (after a first one); the parameters and AdamW's state (exact, from their shapes) were there
    before it. The plan is within 25% of the measured peak (within 5% when this was written)."""
    model, memory, step = scaled_llama_step(checkpointed, chunked)
    step()
    measured = memory.weights + memory.optimizer + measure_peak(step)
    assert abs(memory.total / measured - 1) <= 0.25, (memory.total / MIB, measured / MIB)


def test_a_1b_model_at_8192_tokens_on_a_16_gib_chip():
    """Llama 3.2 1B's shape, bf16, one row of 8,192 tokens a device, the packed path's mask, on a
    16 GiB v5e chip: as asked (blocks kept, logits whole) about 45 GiB; on one chip its fp32
    weights, gradients and AdamW state alone are 18.4 GiB, so nothing but adapters fits there; the
    weights sharded over a v5e-8's chips (--strategy fsdp) with checkpointing fit (14.6 GiB; 5.3
    with chunked logits, the causal-LM objective's), and so do --lora, checkpointing and chunked
    logits on one chip."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B))
    chip = 16 * GIB

    def peak(checkpointed, chunked, shards=1):
        return planned(model, 1, 8192, "bf16", shards=shards, device_bytes=chip, checkpointed=checkpointed,
                       logits="chunked" if chunked else "whole").total

    assert 40 * GIB < peak(False, False) < 50 * GIB
    assert peak(True, True) > chip  # weights, gradients and AdamW state: 16 bytes a parameter
    assert peak(False, True, shards=8) > chip  # every block's activations kept: 8,192 tokens' worth each
    assert peak(True, False, shards=8) < chip  # sharded and checkpointed: fits (14.6 GiB) with whole logits,
    assert peak(True, True, shards=8) < 6 * GIB  # and with the objective's chunked logits (5.3 GiB)
    for p in model.parameters():  # --lora: the base frozen (the adapters' own bytes are a rounding error)
        p.requires_grad_(False)
    assert peak(True, False) > chip and peak(True, True) < 10 * GIB


@pytest.mark.parametrize("attention, dense_mask", [("xla_flash", False), ("sdpa", True), ("eager", True)])
def test_a_rows_activations_per_device_halve_under_context_2(attention, dense_mask):
    """--context-parallel 2: each device holds half of every row's tokens, so the plan halves a
    row's activations per device (every block's kept, the blocks' checkpointed inputs, one block's,
    the whole logits), whatever the attention path (a local query still sees every key: eager's
    softmax and a dense mask's bias stay a whole row wide a token), and adds one block's gathered
    keys and values; the parameters are split over the same 8 devices either way."""
    shape = shape_of(LlamaConfig(**LLAMA_1B))
    for checkpointed in (False, True):
        step = PassInputs(attention, dense_mask, "whole", rows=2, length=8192, precision="bf16",
                          checkpointed=checkpointed)
        alone, split = (plan(Mesh(context=n).resolve(8, sharded=True), step, shape) for n in (1, 2))
        assert split.mesh.fsdp == 4 and split.shards == alone.shards == 8
        assert split.activations * 2 == alone.activations and split.layer * 2 == alone.layer
        assert split.logits * 2 == alone.logits and split.total < alone.total
        # one block's attention gathers the other half of each row's keys and values (repeated to
        # the 32 query heads, 64 wide, on each of these paths), in bf16
        assert alone.gathered == 0 and split.gathered == 2 * 2 * (32 * 64) * 2 * 4096
        assert ", gathered keys and values 64.0 MiB (mesh: context 2), peak" in describe(split)


def test_the_plan_on_paper_counts_the_steps_other_passes():
    """plan_on_paper goes through the kinds' own description of the step: DPO with --lora runs the
    reference (adapters disabled) in the step, whose final hidden states live through the backward
    pass; GRPO with --beta and no adapters holds a frozen copy of the weights, its rows are a
    completion longer and its rollouts hold a key/value cache. Neither was counted before."""
    import dataclasses

    from xla_train.memory import plan_on_paper
    from xla_train.options import TrainOptions

    config = LlamaConfig(**{**LLAMA_1B, "num_hidden_layers": 2})
    sft = TrainOptions(problem="causal-lm", lora=True, precision="bf16", max_length=1024, batch_size=2,
                       strategy="fsdp", gradient_checkpointing=True)
    causal, dpo = (plan_on_paper(dataclasses.replace(sft, problem=p), config, 8, 16 * GIB)
                   for p in ("causal-lm", "dpo"))
    assert causal.reference == 0 and dpo.step.reference == "chunked"
    assert dpo.reference == 2 * 1024 * config.hidden_size * 2  # 2 rows of 1,024 tokens, bf16 hidden states
    assert dpo.total == causal.total + dpo.reference
    grpo = plan_on_paper(dataclasses.replace(sft, problem="grpo", lora=False, own={"beta": 0.04}), config, 8,
                         16 * GIB)
    assert grpo.step.length == 1024 + 256 and grpo.cache > 0  # TRL's default max_completion_length
    assert grpo.reference_weights == grpo.weights > 0


def test_checkpointing_is_switched_on_only_where_it_makes_the_run_fit():
    cfg = LlamaConfig(**{**LLAMA_1B, "num_hidden_layers": 2, "vocab_size": 1000})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)

    def plans(device):
        return [planned(model, 8, 2048, "bf16", device_bytes=device, checkpointed=c, logits="whole")
                for c in (False, True)]

    kept, ckpt = plans(None)
    between = (kept.total + ckpt.total) // 2
    assert ckpt.total < kept.total
    switch, line = checkpointing_needed(*plans(between))
    assert switch and line.startswith(f"memory plan: {kept.total / GIB:.2f} GiB per device with every block's "
                                      f"activations kept, more than the device's {between / GIB:.2f} GiB; ")
    assert line.endswith("with gradient checkpointing, which is switched on (--gradient-checkpointing)")
    assert checkpointing_needed(*plans(kept.total + 1)) == (False, None)  # fits as it is
    assert checkpointing_needed(*plans(ckpt.total - 1)) == (False, None)  # fits in neither: check_fits stops it
    assert checkpointing_needed(*plans(None)) == (False, None)  # the device's size unknown


def _bert_and_grads(checkpointed=False, checkpoint=None):
    """A tiny BERT's gradients for one batch, its blocks checkpointed (with `checkpoint`, or
    transformers' own torch.utils.checkpoint) or not."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64,
                                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if checkpointed:
        checkpoint_activations(model, checkpoint)
    model.train()
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=torch.tensor([0, 1, 1, 0])).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_gradient_checkpointing_gives_the_same_gradients():
    """transformers' own checkpoint (CUDA, CPU) and the backend's function (XLA: torch_xla's, which
    takes positional arguments only): each block calls it once, and the gradients are the plain
    model's."""
    calls = []

    def recording(function, *args, **kwargs):
        calls.append(kwargs)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)

    plain = _bert_and_grads()
    for checkpointed in (_bert_and_grads(True), _bert_and_grads(True, recording)):
        assert plain.keys() == checkpointed.keys()
        for name in plain:
            torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)
    assert calls == [{}, {}]  # two blocks, no keyword arguments (torch_xla's checkpoint refuses them)


def test_a_run_that_cannot_fit_stops_before_compiling(mrpc_slice, tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(DEVICE_BYTES, "200000")  # 0.2 MB: the tiny BERT's AdamW state alone is more
    code = main(["train", "--backend", "cpu", "--model", str(tiny_model), "--data-dir", str(mrpc_slice),
                 "--max-steps", "2", "--buckets", "64,128", "--output-dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.startswith("xla-train: error: the memory plan needs ") and err.count("\n") == 1
    assert ("more than the device's 0.00 GiB: try a smaller --batch-size (now 8), --max-length (batches of up to "
            "128 tokens), --gradient-checkpointing, --strategy fsdp (the model sharded over the devices) or --lora "
            "(gradients and AdamW state for adapters only)\n") in err
    assert "memory plan per device:" in out and "device 0.0 GiB" in out
    assert not (tmp_path / "out" / "checkpoints").exists()  # nothing trained, nothing saved


def test_a_device_size_that_is_no_number_is_one_line(mrpc_slice, tiny_model, monkeypatch, capsys):
    monkeypatch.setenv(DEVICE_BYTES, "lots")
    assert main(["train", "--backend", "cpu", "--model", str(tiny_model), "--data-dir", str(mrpc_slice),
                 "--max-steps", "1"]) == 2
    assert capsys.readouterr().err == f"xla-train: error: {DEVICE_BYTES} must be a number of bytes, not 'lots'\n"


def test_every_run_reports_its_memory(tiny_bucketed_run):
    metrics, _ = tiny_bucketed_run  # XLA:CPU, one replica: the device cannot say its size
    memory = metrics["memory"]
    assert memory["param_bytes_total"] == memory["param_bytes_per_device"] == 4 * metrics["total_params"]
    assert metrics["trainable_params"] == metrics["total_params"] > 0
    assert memory["device_bytes"] is None and memory["peak_bytes"] is None and memory["activation_bytes_estimate"] > 0


# The shipped TPU recipes (recipes/*-tpu.yaml) planned on the chip each is meant for: one v5e
# host, 8 chips of 16 GiB (the smallest Cloud TPU host). Their models' published configs:
# Qwen2.5-0.5B-Instruct's and Qwen3-0.6B's in tests/tiny_decoders.py (the tool recipes' SFT output
# keeps Qwen3-0.6B's), Qwen2.5-7B-Instruct's here (config.json).
QWEN_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 32768,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_dropout": 0.0}
V5E_CHIP, V5E_CHIPS = 16 * 2**30, 8


def recipe_plan(name, chips=V5E_CHIPS, chip_bytes=V5E_CHIP):
    """The memory plan of recipes/NAME on one of `chips` TPU chips of `chip_bytes` (a v5e-8 host by
    default): memory.plan_on_paper of the recipe's model from its published config."""
    from tiny_decoders import ZOO
    from transformers import AutoConfig

    from xla_train.memory import plan_on_paper
    from xla_train.options import TrainOptions, read_recipe

    cfg = TrainOptions(**read_recipe(str(Path(__file__).resolve().parents[1] / "recipes" / name)))
    published = {"Qwen/Qwen2.5-0.5B-Instruct": ZOO["qwen2"]["config"], "Qwen/Qwen2.5-7B-Instruct": QWEN_7B,
                 "Qwen/Qwen3-0.6B": ZOO["qwen3"]["config"], "gs://BUCKET/qwen3-tool-sft": ZOO["qwen3"]["config"],
                 **json.loads((ROOT / "benchmarks" / "published_configs.json").read_text())}
    config = {k: v for k, v in published[cfg.model].items() if not k.endswith("token_id")}
    return cfg, plan_on_paper(cfg, AutoConfig.for_model(**config), chips, chip_bytes)


@pytest.mark.parametrize("name", ["qwen2.5-0.5b-lora-tpu.yaml", "qwen2.5-7b-fsdp-tpu.yaml",
                                  "qwen2.5-0.5b-grpo-tpu.yaml", "qwen3-0.6b-tool-sft-tpu.yaml",
                                  "qwen3-0.6b-tool-grpo-tpu.yaml"])
def test_the_tpu_recipes_fit_a_v5e_chip(name):
    cfg, memory = recipe_plan(name)
    assert memory.weights_total > (4e9 if "7b" in name else 4e8)  # the real model's size, not a tiny one
    assert memory.total <= V5E_CHIP, f"{name}: {memory.total / 2**30:.1f} GiB"


@pytest.mark.parametrize("name, chips, kind", [("llama-3.1-70b-fsdp-v5p64.yaml", 32, "TPU v5p"),
                                               ("llama-3.1-70b-fsdp-v6e64.yaml", 64, "TPU v6 lite"),
                                               ("llama-3.1-8b-lora-v5e8.yaml", 8, "TPU v5 lite"),
                                               ("long-context-sft.yaml", 8, "TPU v6 lite")])
def test_the_pod_recipes_fit_their_chips(name, chips, kind):
    """docs/sharding.md's pods (benchmarks/plan_pods.py): Llama 3.1 70B fully fine-tuned fits a
    v5p-64's and a v6e-64's chips under FSDPv2; the 8B with LoRA a v5e-8's, and without LoRA not
    (its fp32 weights, gradients and AdamW state alone are about 120 GiB of the host's 128); the
    8B fully fine-tuned on 32k-token rows a v6e-8's, split fsdp 4 x context 2
    (benchmarks/plan_long_context.py)."""
    from xla_train.core.xla import TPU_HBM

    cfg, memory = recipe_plan(name, chips, TPU_HBM[kind])
    assert memory.weights_total > (2.5e11 if "70b" in name else 1.5e10)  # the real model's size
    assert memory.total <= TPU_HBM[kind], f"{name}: {memory.total / 2**30:.1f} GiB"
    if cfg.lora:
        import dataclasses

        from transformers import AutoConfig

        from xla_train.memory import plan_on_paper

        published = json.loads((ROOT / "benchmarks" / "published_configs.json").read_text())[cfg.model]
        full = plan_on_paper(dataclasses.replace(cfg, lora=False), AutoConfig.for_model(**published), chips,
                             TPU_HBM[kind])
        state = full.weights + full.gradients + full.optimizer
        assert 110 * 2**30 < state * chips < 128 * 2**30 < full.total * chips


def test_a_tpus_memory_is_known_by_its_kind_under_every_strategy():
    """SPMD's virtual device cannot be asked for its memory (spmd, fsdp): each TPU device's HBM by
    its kind, so the plan checks a fit before compiling as under ddp."""
    from xla_train.core.xla import TPU_TYPE_KIND, device_hbm

    gib = 2**30
    assert {t: device_hbm(TPU_TYPE_KIND[t]) // gib for t in ("v4", "v5litepod", "v5p", "v6e", "tpu7x")} == {
        "v4": 32, "v5litepod": 16, "v5p": 95, "v6e": 32, "tpu7x": 192}
    assert device_hbm(None) is None and device_hbm("cpu") is None
