"""--problem causal-lm end to end: a tiny random Llama learns the synthetic task (reversing a short
list) on the CPU; XLA:CPU keeps the classification figures packed and bucket-padded; LoRA with
FSDPv2 on 4 XLA:CPU devices (gradient checkpointing, bf16) saves an adapter that reads back;
--merge-lora saves a whole causal LM; SIGTERM and --resume give the uninterrupted run's model."""

import json

import pytest
import torch
from conftest import assert_same_weights, reverse_args, run_cli, stop_and_resume

FOUR = {"CPU_NUM_DEVICES": "4"}


def test_the_tiny_decoder_learns_the_task(learned_run):
    """The completion is a function of the prompt, so its loss can fall to 0 only where the loss
    covers the completion alone: prompt letters are random, and a loss counting them could not
    go below their share x ln 8 (about 0.7 here). 0.1 is reached after about 250 steps."""
    m, _ = learned_run
    assert m["problem"] == "causal-lm" and m["main_metric"] == "loss"
    assert m["eval"]["loss"] < 0.1
    assert m["eval"]["perplexity"] == pytest.approx(torch.tensor(m["eval"]["loss"]).exp().item())
    assert m["eval"]["n"] == 64 and m["best"]["metric"] == "loss"  # every validation document once; lower is better
    assert [s for s, _ in m["evaluations"]] == [100, 200, 300, m["steps"]]
    losses = [r["loss"] for _, r in m["evaluations"]]
    assert losses == sorted(losses, reverse=True)


def test_throughput_counts_trained_and_padded_tokens(learned_run):
    m, out = learned_run
    tokens = m["tokens"]
    assert tokens["padded"] == m["train_samples"] * 64  # packed rows are --max-length long
    assert tokens["trained"] < tokens["real"] <= tokens["padded"]  # prompts are not trained, padding is not real
    assert tokens["padding_share"] == pytest.approx(1 - tokens["real"] / tokens["padded"], abs=1e-4)
    assert tokens["padding_share"] < 0.15  # packing fills the rows
    assert tokens["per_s"] > 0 and tokens["trained_per_s"] > 0
    assert tokens["mfu"] is None and tokens["peak_flops"] is None  # a CPU's peak is not known: left out
    # the objective computes the head and loss in chunks (8 x 64 tokens: one chunk), fp32
    assert m["memory"]["chunked_logits"] and m["memory"]["attention"] == "sdpa"
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    # one chunk's fp32 logits and their gradient, and the head's weight gradient (fp32)
    assert m["memory"]["logit_bytes"] == 8 * (8 * 64) * 17 + 17 * hidden * 4


def test_the_output_folder_holds_the_causal_lm_and_the_chat_template(learned_run):
    from transformers import AutoTokenizer

    from xla_train.tasks import CausalLM, from_folder

    _, out = learned_run
    task = from_folder(out)
    assert isinstance(task, CausalLM) and task.form == "prompt/completion" and task.max_length == 64
    assert type(task.model.load_trained(out)).__name__ == "LlamaForCausalLM"
    assert AutoTokenizer.from_pretrained(out).chat_template  # a chat model's folder serves chat prompts
    report = (out / "report" / "report.md").read_text()
    assert "| dev perplexity |" in report and "| trained tokens (in the loss) / per s |" in report


def test_trackers_get_the_loss_and_perplexity(learned_run):
    from mlflow import MlflowClient

    m, out = learned_run
    client = MlflowClient(tracking_uri=f"sqlite:///{out.parent / 'tracking.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("xla-train").experiment_id])
    history = client.get_metric_history(run.info.run_id, "eval/perplexity")
    assert [h.step for h in history] == [s for s, _ in m["evaluations"]]
    assert run.data.metrics["final/loss"] == pytest.approx(m["eval"]["loss"])
    assert 0 < m["goodput"]["ratio"] <= 1


def test_eval_samples_show_the_model_learn(learned_run, reverse_task):
    """--eval-samples 4: at every evaluation the first 4 validation prompts' greedy completions go to
    OUTPUT_DIR/samples/step-K.jsonl, TensorBoard's text tab and MLflow; the learned model's last
    ones are the references."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m, out = learned_run
    steps = [s for s, _ in m["evaluations"]]
    assert sorted(int(p.stem[5:]) for p in (out / "samples").glob("step-*.jsonl")) == steps
    first = json.loads((reverse_task["validation"]).read_text().splitlines()[0])
    last = [json.loads(line) for line in (out / "samples" / f"step-{steps[-1]}.jsonl").read_text().splitlines()]
    assert len(last) == 4 and last[0]["prompt"] == first["prompt"] and last[0]["reference"] == first["completion"]
    assert sum(s["completion"].strip() == s["reference"].strip() for s in last) >= 3, last
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    text = events.Tensors("eval/samples/text_summary")
    assert [e.step for e in text] == steps and first["prompt"] in text[-1].tensor_proto.string_val[0].decode()
    client = MlflowClient(tracking_uri=f"sqlite:///{out.parent / 'tracking.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("xla-train").experiment_id])
    assert [a.path for a in client.list_artifacts(run.info.run_id, "samples")] == sorted(
        f"samples/step-{s}.jsonl" for s in steps)


def test_sigterm_then_resume_equals_the_uninterrupted_run(reverse_task, learned_run, tmp_path):
    whole, whole_out = learned_run
    args = ["--backend", "cpu", *reverse_args(reverse_task, "--eval-every", 100, "--save-every", 4)]
    _, stopped_at, resumed = stop_and_resume(args, tmp_path / "run", tmp_path)
    assert resumed["first_step"] == stopped_at < whole["steps"] == resumed["steps"]
    assert_same_weights(tmp_path / "run", whole_out, atol=1e-6)
    torch.testing.assert_close(resumed["train_loss"], whole["train_loss"], atol=1e-6, rtol=0)
    assert resumed["eval"] == pytest.approx(whole["eval"], abs=1e-6)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "buckets"])
def test_xla_keeps_the_graph_figures(packing, reverse_task, tmp_path):
    """800 documents, 2 epochs on one XLA:CPU device: at most 3 compilations (the step, the
    evaluation, the first log point's read), none after the first epoch, no aten fallback, one
    loss read per log point, one execution per step and per evaluation batch."""
    args = reverse_args({**reverse_task, "train": _head(reverse_task["train"], 800, tmp_path)}, "--epochs", 2)
    if not packing:
        args += ["--no-packing", "--buckets", "16,32"]
    proc, m = run_cli(["--backend", "xla", *args], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    xla = m["xla"]
    assert xla["compiles"] <= 3 and xla["compiles_after_first_epoch"] == 0, xla
    assert xla["aten_fallbacks"] == 0 and xla["host_syncs_per_step"] <= 0.1, xla
    eval_batches = 2 * -(-(13 if packing else 64) // 8)  # 64 documents packed into 13 rows, or one each
    assert xla["executions"] == m["steps"] + eval_batches, xla
    assert m["eval"]["n"] == 64
    assert (m["buckets"] is None) == packing and m["tokens"]["padding_share"] < (0.15 if packing else 0.5)


def test_lora_with_fsdp_on_four_xla_devices(reverse_task, tmp_path):
    """peft's CAUSAL_LM adapters under FSDPv2 (3-D logits sharded by rows), with gradient
    checkpointing and bf16: the adapter is saved and reads back as a causal LM."""
    args = reverse_args(reverse_task, "--max-steps", 12, "--batch-size", 2, "--log-every", 4, "--lora",
                        "--strategy", "fsdp", "--gradient-checkpointing", "--precision", "bf16", "--eval-samples", 3)
    proc, m = run_cli(["--backend", "xla", *args, "--output-dir", tmp_path / "run"], tmp_path, env=FOUR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["world_size"] == 4 and m["steps"] == 12 and m["replicas_identical"]
    assert m["trainable_params"] < 0.2 * m["total_params"]
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss, _ in m["train_loss"])
    config = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM"
    from xla_train.tasks import from_folder

    # the adapter on its base, as predict reads it
    model = from_folder(tmp_path / "run").model.load_trained(tmp_path / "run")
    assert type(model).__name__ == "PeftModelForCausalLM"
    assert type(model.get_base_model()).__name__ == "LlamaForCausalLM"
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step-12.jsonl").read_text().splitlines()]
    # generated with the adapter, sharded
    assert [sorted(s) for s in samples] == [["completion", "prompt", "reference"]] * 3


def test_merge_lora_saves_a_whole_causal_lm(reverse_task, tmp_path):
    proc, m = run_cli(["--backend", "cpu", *reverse_args(reverse_task, "--max-steps", 6, "--lora", "--merge-lora"),
                       "--output-dir", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "model.safetensors").exists() and not (tmp_path / "run" / "adapter_config.json").exists()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def _head(path, n, tmp_path):
    out = tmp_path / f"head-{n}.jsonl"
    out.write_text("".join(path.read_text().splitlines(keepends=True)[:n]))
    return out
