"""Tied embeddings (Llama 3.2, Qwen2.5's small models, Gemma, GPT-2: the output projection is the
input embedding): one tensor on every device, written once in checkpoints and saved models, tied
again on load, and resumed exactly."""

import os
import subprocess
import sys

import pytest
import tiny_decoders as td
import torch
from conftest import ROOT, assert_same_weights, reverse_args, run_cli, stop_and_resume

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def tied_task(tmp_path_factory):
    """A tiny Llama whose lm_head is its embedding, with the synthetic task's files."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tied")
    tok = td.letters_tokenizer(chat=True)
    torch.manual_seed(0)
    config = td.config("llama", len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(folder / "llama")
    tok.save_pretrained(folder / "llama")
    return {"model": folder / "llama", "train": td.write_jsonl(folder / "train.jsonl", td.reverse_rows(200, 1)),
            "validation": td.write_jsonl(folder / "validation.jsonl", td.reverse_rows(16, 2))}


def test_untied_keeps_each_tensor_under_its_first_key():
    import torch

    from xla_train.core.ties import untied

    shared, other = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(2))
    assert list(untied({"embed": shared, "norm": other, "head": shared})) == ["embed", "norm"]


def test_a_checkpoint_written_before_ties_were_kept_loads_its_trained_name(tied_task, capsys):
    """An XLA run before the fix saved both names apart, the embedding trained and the head as it
    started: loading both into the one tensor would let the stale head win. The first name's
    values are loaded, and one line says so."""
    from transformers import AutoModelForCausalLM

    from xla_train.core.hf import quiet_transformers
    from xla_train.run.checkpoint import Resume

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(tied_task["model"])
    old = {k: v.clone() for k, v in model.state_dict().items()}
    old[EMBED] += 1  # trained
    resume = Resume.__new__(Resume)
    resume.url, resume.state = "OLD", {"config": {"model": "m"}}
    resume.load_model(model, old)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, old[EMBED])
    assert capsys.readouterr().out.strip() == (
        f"checkpoint OLD holds {HEAD} apart from the tensor tied to it (written before tied weights were kept "
        "one): the first name's trained values are loaded")


def _tied_in_file(folder):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from xla_train.core.hf import quiet_transformers

    keys = set(load_file(str(folder / "model.safetensors")))
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(folder)
    return keys, model.lm_head.weight is model.model.embed_tokens.weight


def test_checkpoints_the_final_model_and_resume_keep_the_tie(tied_task, tmp_path):
    """On the CPU: checkpoints (safetensors refuses two names for one storage) and the final
    model hold the tensor once and load tied; a run stopped by SIGTERM and resumed ends where the
    uninterrupted one does."""
    from safetensors.torch import load_file

    args = ["--backend", "cpu", *reverse_args(tied_task, "--max-steps", 40, "--save-every", 4, "--log-every", 1)]
    proc, whole = run_cli([*args, "--output-dir", tmp_path / "whole"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys, tied = _tied_in_file(tmp_path / "whole")
    assert EMBED in keys and HEAD not in keys and tied, sorted(keys)
    latest = sorted((tmp_path / "whole" / "checkpoints").glob("step-*"))[-1]
    checkpoint = set(load_file(str(latest / "model.safetensors")))
    assert EMBED in checkpoint and HEAD not in checkpoint  # the resume below ties it again
    _, stopped_at, resumed = stop_and_resume(args, tmp_path / "part", tmp_path)
    assert resumed["first_step"] == stopped_at < whole["steps"] == resumed["steps"]
    torch.testing.assert_close(resumed["train_loss"], whole["train_loss"], atol=1e-6, rtol=0)
    assert_same_weights(tmp_path / "part", tmp_path / "whole", atol=1e-6)


@pytest.mark.parametrize("backend", [pytest.param("xla", marks=pytest.mark.xla), "cpu"])
def test_sharded_checkpoints_keep_the_tie(backend, tied_task, tmp_path):
    """--strategy fsdp: FSDPv2 over 4 XLA:CPU devices (each host writes its shards) or FSDP2 over
    two gloo workers: the shards hold the tied tensor once, a resumed run reads them back into
    the tied model, and its final model is tied."""
    env = {"CPU_NUM_DEVICES": "4"} if backend == "xla" else None
    args = ["--backend", backend, "--strategy", "fsdp", *(["--num-processes", 2] if backend == "cpu" else []),
            *reverse_args(tied_task, "--save-every", 2, "--log-every", 1), "--output-dir", tmp_path / "run"]
    proc, _ = run_cli([*args, "--max-steps", 4], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, resumed = run_cli([*args, "--max-steps", 6, "--resume"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed["first_step"] == 4 and resumed["steps"] == 6
    keys, tied = _tied_in_file(tmp_path / "run")
    assert EMBED in keys and HEAD not in keys and tied, sorted(keys)


XLA_STEP = """
import sys, torch
from transformers import AutoModelForCausalLM
from xla_train.core.engine import Engine

engine = Engine("xla")
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
n = len(list(model.parameters()))
model, optimizer = engine.prepare(model, optimizer)
assert model.lm_head.weight is model.model.embed_tokens.weight, "untied by the move"
assert len(optimizer.param_groups[0]["params"]) == n == len(list(model.parameters()))
ids = torch.tensor([[1, 9, 4, 5, 10, 5, 4, 2]], device=engine.device)
engine.backward(model(input_ids=ids, labels=ids).loss)
engine.optimizer_step(optimizer)
head, embed = engine.to_host([model.lm_head.weight, model.model.embed_tokens.weight])
assert model.lm_head.weight is model.model.embed_tokens.weight and torch.equal(head, embed)
print("tied after a step")
"""


@pytest.mark.xla
def test_xla_keeps_the_tie_through_the_move_and_a_step(tied_task):
    """torch_xla's move gives every module a new Parameter (Module._apply), which untied the two:
    the head went untrained (the optimizer was re-pointed at the embedding only) and they drifted
    apart. Engine.prepare ties them again."""
    proc = subprocess.run([sys.executable, "-c", XLA_STEP, str(tied_task["model"])], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0 and "tied after a step" in proc.stdout, proc.stderr[-3000:]
