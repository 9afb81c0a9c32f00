"""`--lora`: peft's LoRA adapters on the tiny BERT (CPU) and on decoder classifiers whose tokenizer
has no padding token (tiny random Llama, Qwen2, Gemma, Mistral and GPT-2, XLA:CPU). Only the
adapters and the head train; the output folder holds the adapter, which `xla-train predict` reads;
`--merge-lora` writes a whole model that plain transformers loads and that scores what the run
reported. Which modules `--lora` adapts by default, on tiny random decoders of each family (in this
process): the attention's projections, never a router, an expert or an MLP."""

import csv
import json

import pytest
import torch
from conftest import run_cli

from xla_train.commands.cli import main


def _decoder(path, family):
    """A 2-layer, 32-wide random decoder classifier with the bundled tokenizer stripped of its
    padding token ([SEP] as end of sequence), as a Llama, Qwen2, Gemma, Mistral or GPT-2 checkpoint
    comes."""
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        GemmaConfig,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    from xla_train.models import bundled_model_path

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    tok.eos_token, tok.pad_token = "[SEP]", None
    eos = tok.convert_tokens_to_ids("[SEP]")
    decoder = dict(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, eos_token_id=eos, bos_token_id=101,
                   max_position_embeddings=512)
    config = {
        "llama": lambda: LlamaConfig(**decoder),
        "qwen2": lambda: Qwen2Config(**decoder),
        "gemma": lambda: GemmaConfig(head_dim=16, **decoder),
        "mistral": lambda: MistralConfig(**decoder),
        "gpt2": lambda: GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=512,
                                   eos_token_id=eos, bos_token_id=101),
    }[family]()
    config.num_labels = 2
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _dev_accuracy(model, data, tmp_path):
    """`xla-train predict` (CPU, in this process) on the dev rows; the share of their labels it
    predicts, and the number of rows written."""
    out = tmp_path / f"{model.name}-dev.tsv"
    assert main(["predict", "--backend", "cpu", "--model", str(model), "--input", str(data / "dev.tsv"),
                 "--output", str(out)]) == 0
    with open(data / "dev.tsv", encoding="utf-8") as f:
        labels = [row[0] for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)][1:]
    with open(out, encoding="utf-8") as f:
        predicted = [row[1] for row in csv.reader(f, delimiter="\t")][1:]
    return sum(p == label for p, label in zip(predicted, labels)) / len(labels), len(predicted)


@pytest.fixture(scope="session")
def lora_runs(mrpc_slice, tiny_model, tmp_path_factory):
    """Six CPU steps of the tiny BERT with LoRA (lr 1e-2, so the head and adapters move), once
    saving the adapter, once merged, once merged with the frozen base held in bf16. The tiny BERT
    is named a bare encoder (BertModel), as the bundled MiniLM's checkpoint is: the head is the run's."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("lora")
    bare = shutil.copytree(tiny_model, out / "bare-encoder")
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))
    runs = {}
    cases = (("adapter", []), ("merged", ["--merge-lora"]), ("bf16", ["--merge-lora", "--precision", "bf16"]))
    for name, extra in cases:
        proc, m = run_cli(["--backend", "cpu", "--lora", *extra, "--model", bare, "--data-dir", mrpc_slice,
                           "--max-steps", 6, "--lr", 1e-2, "--output-dir", out / name], out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (m, out / name, proc.stderr)
    return runs


def test_a_lora_run_prints_no_library_warning(lora_runs):
    """peft reads transformers 5's deprecated is_gradient_checkpointing: its FutureWarning is the
    user's to act on only if it were theirs; the console stays the job's own lines."""
    for name, (_, _, stderr) in lora_runs.items():
        assert "Warning" not in stderr and "WARNING" not in stderr, (name, stderr[-2000:])


def test_lora_trains_only_the_adapters_and_the_head(lora_runs, mrpc_slice, tmp_path):
    m, folder, _ = lora_runs["adapter"]
    assert 0 < m["trainable_params"] <= 0.05 * m["total_params"]
    memory = m["memory"]
    assert memory["grad_bytes_per_device"] == 4 * m["trainable_params"]  # fp32 gradients of what trains, only
    assert memory["optimizer_bytes_per_device"] == 8 * m["trainable_params"]
    files = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json", "tokenizer.json"} <= files
    assert "model.safetensors" not in files and "README.md" not in files  # no whole model, no peft model card
    accuracy, rows = _dev_accuracy(folder, mrpc_slice, tmp_path)
    assert rows == 48 and accuracy == pytest.approx(m["eval"]["accuracy"])


def test_merged_lora_is_a_plain_model_that_scores_what_the_run_reported(lora_runs, mrpc_slice, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    m, folder, _ = lora_runs["merged"]
    files = {p.name for p in folder.iterdir()}
    assert "adapter_config.json" not in files and "model.safetensors" in files
    weights = load_file(str(folder / "model.safetensors"))
    assert not any("lora_" in k or "base_model" in k for k in weights)  # the model's own names
    assert AutoModelForSequenceClassification.from_pretrained(folder).num_labels == 2
    accuracy, rows = _dev_accuracy(folder, mrpc_slice, tmp_path)
    assert rows == 48 and accuracy == pytest.approx(m["eval"]["accuracy"])
    assert m["eval"] == lora_runs["adapter"][0]["eval"]  # the same training, saved two ways


def test_bf16_holds_the_frozen_base_in_half_the_bytes(lora_runs, mrpc_slice, tmp_path):
    """--lora --precision bf16: the frozen weights in bf16, what trains in fp32; the merged model
    is whole, fp32 and scores on the dev rows what the run reported."""
    from safetensors.torch import load_file

    m, folder, _ = lora_runs["bf16"]
    fp32 = lora_runs["merged"][0]
    assert m["trainable_params"] == fp32["trainable_params"] and m["total_params"] == fp32["total_params"]
    _assert_param_bytes(m, bytes_per_frozen=2)
    assert m["memory"]["param_bytes_total"] < 0.53 * fp32["memory"]["param_bytes_total"]
    assert m["memory"]["optimizer_bytes_per_device"] == fp32["memory"]["optimizer_bytes_per_device"]
    assert {w.dtype for w in load_file(str(folder / "model.safetensors")).values()} == {torch.float32}
    accuracy, rows = _dev_accuracy(folder, mrpc_slice, tmp_path)
    # the run scored with its base in bf16, the merged model holds the base's own fp32 weights:
    # a row whose two scores nearly tie may go the other way
    assert rows == 48 and abs(accuracy - m["eval"]["accuracy"]) <= 1 / 48


def _assert_param_bytes(m, bytes_per_frozen):
    """The plan's parameter bytes: the frozen base at `bytes_per_frozen` a weight, what trains in fp32."""
    frozen = m["total_params"] - m["trainable_params"]
    assert m["memory"]["param_bytes_total"] == bytes_per_frozen * frozen + 4 * m["trainable_params"]


def test_a_bf16_checkpoint_trains_in_fp32(tiny_model, tmp_path):
    """transformers loads a checkpoint in its own dtype; the job's weights (and AdamW's updates)
    are fp32 whatever it holds."""
    from transformers import AutoModelForSequenceClassification

    from xla_train.tasks import Classification

    AutoModelForSequenceClassification.from_pretrained(tiny_model, dtype=torch.bfloat16).save_pretrained(tmp_path)
    model = Classification("custom", ["a", "b"]).model.load(str(tmp_path), 0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("family,extra", [("llama", []), ("qwen2", ["--precision", "bf16"]), ("gemma", []),
                                          ("mistral", []), ("gpt2", [])],
                         ids=["llama", "qwen2-bf16", "gemma", "mistral", "gpt2"])
def test_decoder_lora_on_xla_keeps_one_graph_per_step(family, extra, mrpc_slice, tmp_path):
    """Padding with the end-of-sequence token, last-token pooling, LoRA dropout (and Qwen2's
    frozen base held in bf16): no host sync, no fallback, one graph execution per step and per
    evaluation batch."""
    model = _decoder(tmp_path / family, family)
    proc, m = run_cli(["--backend", "xla", "--lora", *extra, "--model", model, "--data-dir", mrpc_slice,
                       "--max-steps", 20, "--log-every", 10, "--buckets", "128", "--output-dir", tmp_path / "out"],
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "padding with its end-of-sequence token '[SEP]'" in proc.stdout
    xla = m["xla"]
    assert xla["aten_fallbacks"] == 0 and xla["host_syncs_per_step"] <= 0.1, xla
    assert xla["executions"] <= 20 + 48 // 8 + 2, xla
    assert 0 < m["trainable_params"] <= 0.05 * m["total_params"]
    _assert_param_bytes(m, bytes_per_frozen=2 if extra else 4)
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["r"] == 8
    _, rows = _dev_accuracy(tmp_path / "out", mrpc_slice, tmp_path)
    assert rows == 48


def test_lora_options_need_lora(capsys):
    assert main(["train", "--merge-lora", "--max-steps", "1"]) == 2
    assert capsys.readouterr().err == "xla-train: error: --merge-lora needs --lora\n"
    assert main(["train", "--lora", "--lora-dropout", "1", "--max-steps", "1"]) == 2
    assert "--lora-dropout must be in [0, 1), not 1.0" in capsys.readouterr().err


# --lora's default targets (models.default_lora_targets): peft's own where its table names some for
# the model type, else the attention's projections found by name; never a router, an expert or an MLP
QUERY_VALUE = {"q_proj", "v_proj"}  # peft's table: llama, qwen2, qwen3, gemma3_text, mixtral
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}  # not in peft's table: found by name
DEFAULT_TARGETS = {"llama": QUERY_VALUE, "qwen2": QUERY_VALUE, "qwen3": QUERY_VALUE, "gemma3": QUERY_VALUE,
                   "mixtral": QUERY_VALUE, "smollm3": ATTENTION, "olmo2": ATTENTION, "granite": ATTENTION,
                   "qwen3moe": ATTENTION, "gptoss": ATTENTION, "phi4mini": {"qkv_proj", "o_proj"}}


def _causal_lm(family):
    """`family`'s tiny random decoder (tests/tiny_decoders.py) over a 40-token vocabulary."""
    import tiny_decoders as td
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(td.config(family, 40, bos=1, eos=2))


def _with_lora(model, targets=None, task_type="CAUSAL_LM"):
    """The package's LoRA as a run adds it (`--lora [--lora-targets targets]`)."""
    from xla_train.models import add_adapters
    from xla_train.options import TrainOptions

    return add_adapters(model, TrainOptions(lora=True, lora_targets=targets).section("model"), task_type)


def _adapted(model):
    """{name: module} of the modules that got adapters."""
    return {name: module for name, module in model.named_modules() if hasattr(module, "lora_A") and module.lora_A}


@pytest.mark.parametrize("family", sorted(DEFAULT_TARGETS))
def test_lora_adapts_the_attention_projections_only_by_default(family):
    """Families peft's table lacks (SmolLM3, Phi-4-mini, OLMo-2, Granite, gpt-oss, Qwen3-MoE) or
    whose entry peft's conversion of stacked experts empties (Mixtral) get adapters on their
    attention projections; no router, expert or MLP module is adapted, and a training step puts
    gradients on the adapters only."""
    model = _with_lora(_causal_lm(family))
    adapted = _adapted(model)
    assert {name.rsplit(".", 1)[-1] for name in adapted} == DEFAULT_TARGETS[family]
    for name in adapted:
        assert "Attention" in type(model.get_submodule(name.rsplit(".", 1)[0])).__name__, name
    assert not model.peft_config["default"].target_parameters  # no 3-D expert weight adapted
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    assert not [n for n in trainable if any(w in n for w in ("mlp", "expert", "router", ".gate."))]
    ids = torch.randint(3, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trainable
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".lora_B." in n)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft's own call, unquieted
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_lora_default_targets_are_peft_own_where_peft_has_them(family):
    """For a family in peft's table the adapters are those peft's own default (target_modules
    None) gives: nothing changed for the families that worked before."""
    from peft import LoraConfig, get_peft_model

    ours = _with_lora(_causal_lm(family))
    peft_own = get_peft_model(_causal_lm(family), LoraConfig(task_type="CAUSAL_LM", target_modules=None))
    assert set(ours.peft_config["default"].target_modules) == set(peft_own.peft_config["default"].target_modules)
    assert _adapted(ours).keys() == _adapted(peft_own).keys()


@pytest.mark.parametrize("family,targets,expected", [
    ("llama", "q_proj", {"q_proj"}), ("smollm3", "q_proj", {"q_proj"}),
    ("mixtral", "q_proj,o_proj", {"q_proj", "o_proj"}), ("qwen3moe", "q_proj", {"q_proj"}),
    ("phi4mini", "gate_up_proj", {"gate_up_proj"})])
def test_lora_targets_override_the_default(family, targets, expected):
    """--lora-targets names what is adapted, whatever the default would be (an MLP's too)."""
    model = _with_lora(_causal_lm(family), targets)
    assert {name.rsplit(".", 1)[-1] for name in _adapted(model)} == expected


def test_lora_without_default_targets_is_one_line_naming_the_model_type():
    """A model type peft's table lacks and whose attention has no projection of the usual names
    (DistilBERT's q_lin, k_lin...): one line asking for --lora-targets; naming them works."""
    from transformers import AutoModelForSequenceClassification, DistilBertConfig

    from xla_train.core.errors import UserError

    config = DistilBertConfig(vocab_size=40, dim=32, hidden_dim=64, n_layers=1, n_heads=2)
    with pytest.raises(UserError) as e:
        _with_lora(AutoModelForSequenceClassification.from_config(config), task_type="SEQ_CLS")
    assert "'distilbert'" in str(e.value) and "--lora-targets" in str(e.value) and "\n" not in str(e.value)
    model = _with_lora(AutoModelForSequenceClassification.from_config(config), "q_lin,v_lin", "SEQ_CLS")
    assert {name.rsplit(".", 1)[-1] for name in _adapted(model)} == {"q_lin", "v_lin"}
