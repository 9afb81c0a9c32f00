"""The memory plan: exact bytes from the parameters, an activation estimate, and a run that cannot
fit its device stops before anything compiles (in-process, the tiny BERT)."""

import torch
from transformers import BertConfig, BertForSequenceClassification

from xla_train.commands.cli import main
from xla_train.core.engine import checkpoint_activations
from xla_train.memory import DEVICE_BYTES, activation_estimate, needed, plan


def test_the_plan_counts_every_byte_of_what_trains():
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64))
    total = sum(p.numel() for p in model.parameters())
    memory, counts = plan(model, rows=8, length=64)
    assert counts == {"trainable_params": total, "total_params": total}
    assert memory["param_bytes_total"] == memory["param_bytes_per_device"] == 4 * total
    assert memory["grad_bytes_per_device"] == 4 * total and memory["optimizer_bytes_per_device"] == 8 * total
    for p in model.bert.embeddings.parameters():  # a frozen part has no gradient and no optimizer state
        p.requires_grad_(False)
    frozen = sum(p.numel() for p in model.bert.embeddings.parameters())
    memory, counts = plan(model, rows=8, length=64)
    assert counts["trainable_params"] == total - frozen and memory["grad_bytes_per_device"] == 4 * (total - frozen)
    assert memory["optimizer_bytes_per_device"] == 8 * (total - frozen)
    # Korthikanti et al.: s*b*h*(34 + 5*a*s/h) bytes a layer in 16 bits, twice that in fp32
    assert activation_estimate(model.config, 8, 64, "bf16") == int(2 * 64 * 8 * 32 * (34 + 5 * 2 * 64 / 32))
    assert memory["activation_bytes_estimate"] == 2 * activation_estimate(model.config, 8, 64, "bf16")
    assert needed(memory) == sum(memory[k] for k in ("param_bytes_per_device", "grad_bytes_per_device",
                                                     "optimizer_bytes_per_device", "activation_bytes_estimate"))


def test_checkpointed_blocks_keep_only_their_inputs():
    """Full recomputation (Korthikanti et al., section 5): each layer's fp32 input, 4*s*b*h bytes,
    and one layer's activations while it is recomputed."""
    config = BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2)
    one_layer = activation_estimate(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2),
                                    8, 64, "bf16")
    kept = activation_estimate(config, 8, 64, "bf16", checkpointed=True)
    assert kept == 4 * 4 * 64 * 8 * 32 + one_layer
    assert kept < activation_estimate(config, 8, 64, "bf16") / 2
    assert activation_estimate(config, 8, 64, "fp32", checkpointed=True) == 4 * 4 * 64 * 8 * 32 + 2 * one_layer


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
