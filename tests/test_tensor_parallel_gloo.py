"""--tensor-parallel N on the torch-native backends (`--backend cpu` here, CUDA alike): FSDP2 over a
mesh of fsdp x tensor, each block's projections split over `tensor` by transformers' own plan and
styles (gpu_fallback/strategies.py, Fsdp2._split), the rows over `fsdp` only.

Four real gloo processes: fsdp=2 x tensor=2 against fsdp=4 and against plain torch in one process,
for a Llama (grouped key/value heads), a Qwen2 (biases), a Qwen3 (per-head q/k norms, whose
gradients transformers' style sums over the tensor group) and a Qwen3-MoE (its experts split by the
plan's moe_tp_experts), each worker reading its shards from the safetensors (FSDP2's load); then the command line beside
`--strategy fsdp` on two processes, which sees the same rows a worker."""

import os
import subprocess
import sys

import pytest
import tiny_decoders as td
import torch
from conftest import ROOT, assert_same_weights, resume_midway, run_cli

from xla_train.core.errors import UserError
from xla_train.parallel.mesh import Mesh

SAME = r"""
import functools, sys
import torch
from transformers import AutoModelForCausalLM
from xla_train import Mesh, launch
from xla_train.parallel import sharded_load
from xla_train.core.engine import Engine

STEPS, LR, CLIP = 3, 2e-5, 1.0  # AdamW moves an element of a near-zero gradient by up to lr
ids = torch.randint(3, 120, (8, 16), generator=torch.Generator().manual_seed(0))


def train(case, engine=None):
    # case: a model folder, read into the workers' shards (sharded_load.skeleton, as job.pretrained
    # builds it under FSDP2), or "folder|whole", loaded whole first
    folder, _, how = case.partition("|")
    torch.manual_seed(0)
    # the experts' loop: torch's grouped_mm (transformers' default on the CPU) refuses the tiny
    # widths' strides ("strides should be multiple of 16 bytes")
    experts = {"experts_implementation": "eager"} if "moe" in folder else {}
    load = functools.partial(AutoModelForCausalLM.from_pretrained, folder, dtype=torch.float32, **experts)
    model = sharded_load.skeleton(load, folder) if engine and how != "whole" else None
    model = model or load()
    source = getattr(model, sharded_load.SOURCE, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows, read = ids, None
    if engine:
        model, optimizer = engine.prepare(model, optimizer)
        rows = ids.chunk(engine.strategy.row_shares)[engine.strategy.row_share]
        if source:  # the bytes this worker read, and those of its shards of the checkpoint's tensors
            shards = sum(p.to_local().numel() * source.bytes[n] // p.numel()
                         for n, p in engine.unwrap_model(model).named_parameters() if n in source.bytes)
            read = engine.strategy.gather(torch.tensor([[source.bytes_read, shards]])).tolist()
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=rows, labels=rows).loss  # rows of equal tokens: the mean of the shares' means
        if engine:
            engine.backward(loss)
            engine.optimizer_step(optimizer)
            loss = engine.strategy.gather_batch(loss.detach()[None]).mean()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses, read, source and sum(source.bytes.values())


def worker(cases, out):
    engine = Engine(max_grad_norm=CLIP)
    results = {}
    for case in cases:
        model, losses, read, total = train(case, engine)
        model = engine.unwrap_model(model)
        placements = {name: str(getattr(p, "placements", None)) for name, p in model.named_parameters()}
        weights = {name: engine.strategy.whole(p.detach()).clone() for name, p in model.state_dict().items()}
        results[case] = {"losses": losses, "weights": weights, "placements": placements,
                         "shares": engine.strategy.row_shares, "read": read, "total": total}
    if engine.strategy.is_main:
        torch.save(results, out)


out, tensor, folders = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
if __name__ == "__main__":
    if tensor == 0:
        results = {}
        for folder in folders:
            model, losses, _, _ = train(folder)
            results[folder] = {"losses": losses, "weights": model.state_dict()}
        torch.save(results, out)
    else:
        launch(worker, (folders, out), backend="cpu", num_processes=4, strategy="fsdp", mesh=Mesh(tensor=tensor))
"""


def _save(family, path):
    """A tiny `family` decoder whose heads split over 2: 4 attention heads, 2 key/value heads. One
    vocabulary for every family (Qwen2's rounds 96 up to 128): in one process, a second model of
    another vocabulary failed in the vocabulary-split embedding's backward (torch 2.9's DTensor:
    "EmbeddingBackward0 returned an invalid gradient ... [96, 80] ... [128, 80]"; not followed)."""
    config = td.config(family, 128, size=80)
    config.num_key_value_heads = 2
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


FAMILIES = ("llama", "qwen2", "qwen3", "qwen3moe")


@pytest.fixture(scope="session")
def gloo_runs(tmp_path_factory):
    """For each family: plain torch in one process (tensor 0), fsdp=4 (tensor 1) and fsdp=2 x
    tensor=2 on four gloo processes, one launch of the workers training the families in turn,
    each read into the workers' shards; at tensor 2 the Llama loaded whole too ("whole").
    Returns {family: {tensor: result}}."""
    folder = tmp_path_factory.mktemp("tp_gloo")
    script = folder / "same.py"
    script.write_text(SAME)
    models = [str(_save(family, folder / family)) for family in FAMILIES]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results: dict[str, dict[int | str, dict]] = {family: {} for family in FAMILIES}
    for tensor in (0, 1, 2):
        out = folder / f"tensor-{tensor}.pt"
        whole = [models[0] + "|whole"] if tensor == 2 else []
        proc = subprocess.run([sys.executable, script, out, str(tensor), *models, *whole], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        saved = torch.load(out)
        for family, model in zip(FAMILIES, models):
            results[family][tensor] = saved[model]
    results[FAMILIES[0]]["whole"] = saved[models[0] + "|whole"]
    return results


@pytest.mark.torch_native  # make test-torch runs it on the newest torch too (its DTensor moves fastest)
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_by_tensor_on_gloo_trains_as_fsdp_and_as_one_process(gloo_runs, family):
    """Three AdamW steps with clipping at lr 2e-5: losses and every parameter within 1e-5 of
    fsdp=4 and of plain torch, the projections split over both axes, the norms over fsdp only."""
    one, fsdp, split = (gloo_runs[family][t] for t in (0, 1, 2))
    assert split["shares"] == 2 and fsdp["shares"] == 4
    for other in (one, fsdp):
        assert max(abs(a - b) for a, b in zip(split["losses"], other["losses"])) < 1e-5
        assert split["weights"].keys() == other["weights"].keys()
        for name, w in other["weights"].items():
            torch.testing.assert_close(split["weights"][name], w, atol=1e-5, rtol=0, msg=name)
    assert split["losses"][0] != split["losses"][-1]  # it trained
    placements = split["placements"]
    layer = "model.layers.0."
    assert placements[layer + "self_attn.q_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements[layer + "self_attn.o_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements[layer + "input_layernorm.weight"] == "(Shard(dim=0),)"
    if family == "qwen2":
        assert placements[layer + "self_attn.q_proj.bias"].endswith("Shard(dim=0))")
    if family == "qwen3moe":  # the plan's moe_tp_experts: each expert's MLP split as a dense one
        assert placements[layer + "mlp.experts.gate_up_proj"] == "(Shard(dim=0), _StridedShard(dim=1, sf=2))"
        assert placements[layer + "mlp.experts.down_proj"] == "(Shard(dim=0), Shard(dim=2))"


def test_each_worker_reads_its_shards_only_and_trains_as_if_loaded_whole(gloo_runs):
    """FSDP2's load from the shards (job.pretrained builds the model without its weights, each
    worker fills its shards from their slices of the safetensors: Fsdp2._fill): every worker reads
    exactly its shards' bytes, under fsdp=4 and under fsdp=2 x tensor=2 (a quarter of each split
    tensor, the norms' halves on both workers of a tensor group), never the whole checkpoint; and
    the Llama (tied head) trains bit for bit as when loaded whole and then split."""
    for family in FAMILIES:
        for tensor in (1, 2):
            run = gloo_runs[family][tensor]
            if family == "qwen3moe":  # its experts are stacked from the files' per-expert tensors: loaded whole
                assert run["read"] is None
                continue
            assert [read for read, _ in run["read"]] == [shards for _, shards in run["read"]], (family, tensor)
            assert max(read for read, _ in run["read"]) < run["total"] / 2, (family, tensor, run["read"])
    sharded, whole = gloo_runs["llama"][2], gloo_runs["llama"]["whole"]
    assert whole["read"] is None and sharded["losses"] == whole["losses"]
    for name, w in whole["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], w, atol=0, rtol=0, msg=name)


def test_the_torch_native_split_refuses_what_it_cannot_split():
    """In one line each, before anything loads: key/value heads or experts' width the tensor group
    does not divide (transformers' styles split them; XLA keeps them whole), LoRA, workers that the
    tensor group does not divide, and an Engine of one process asked to split."""
    from transformers import LlamaConfig

    from xla_train.core.select import select_roles

    roles = select_roles("cpu", 4, "fsdp", Mesh(tensor=2))
    strategy = roles.strategy
    assert strategy.planned_data_parallel_size(roles.launcher) == 2
    one_kv = LlamaConfig(num_attention_heads=4, num_key_value_heads=1, intermediate_size=256)
    with pytest.raises(UserError, match=r"^`tensor_parallel` 2: LlamaConfig's key/value heads \(1\) cannot be split "
                                        "evenly over 2 devices$"):
        strategy.check_model(one_kv)
    with pytest.raises(UserError, match="with `lora` runs on the xla backend only so far"):
        strategy.check_model(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=256),
                             lora=True)
    from transformers import Qwen3MoeConfig

    moe = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=240,
                         moe_intermediate_size=33)  # transformers' moe_tp_experts splits the experts' width
    with pytest.raises(UserError, match=r"experts' MLP width \(33\) cannot be split evenly over 2 devices$"):
        strategy.check_model(moe)
    from xla_train.parallel import tensor_parallel as tp

    assert tp.refusal(moe, 2) is None  # XLA splits the experts by FSDPv2's rule, not the plan's
    with pytest.raises(UserError, match="needs as many workers or more: start them with launch"):
        strategy.wrap_model(torch.nn.Linear(2, 2))  # an Engine in a script, one process, no launch
    odd = select_roles("cpu", 3, "fsdp", Mesh(tensor=2))
    with pytest.raises(UserError, match=r"^`tensor_parallel` 2 does not divide the 3 workers "
                                        r"\(`num_processes`\)$"):
        odd.planned_data_parallel_size()


GLOO_STEPS = 8


def _cli(task, model, *extra):
    """A bf16 causal-LM run of the CLI on gloo workers under FSDP2, a worker's batch 2 rows, a
    checkpoint every 4 steps."""
    return ["--backend", "cpu", "--strategy", "fsdp", "--precision", "bf16", "--max-steps", GLOO_STEPS,
            "--batch-size", 2, "--log-every", 2, "--eval-samples", 2, "--save-every", 4, "--problem", "causal-lm",
            "--model", model, "--train-file", task["train"], "--validation-file", task["validation"],
            "--max-length", 64, *extra]


SPLIT = ("--num-processes", 4, "--tensor-parallel", 2)


@pytest.fixture(scope="module")
def qwen2_task(reverse_task, tmp_path_factory):
    """The synthetic task (conftest.reverse_task) on a tiny Qwen2 whose heads and MLP split over 2."""
    return td.save("qwen2", tmp_path_factory.mktemp("qwen2") / "model", chat=True, letters=True, size=80)


@pytest.fixture(scope="module")
def split_run(reverse_task, qwen2_task, tmp_path_factory):
    """The CLI's run at fsdp 2 x tensor 2 on 4 gloo workers, uninterrupted: (metrics, output folder)."""
    out = tmp_path_factory.mktemp("split")
    proc, m = run_cli([*_cli(reverse_task, qwen2_task, *SPLIT), "--output-dir", out / "run"], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return m, out / "run"


def test_a_bf16_run_of_the_cli_on_gloo_under_fsdp_by_tensor(split_run, reverse_task, qwen2_task, tmp_path):
    """What a user of a GPU box runs first, on gloo: full fine-tuning in bf16 with --tensor-parallel 2
    on 4 workers, beside --strategy fsdp on 2, whose workers see the same rows (a tensor group's
    two workers share a row of the mesh's). Losses and evaluation agree within bf16's rounding;
    the evaluation counts each row once; every worker writes its own shards; the saved model
    loads in plain transformers."""
    from transformers import AutoModelForCausalLM

    split, out = split_run
    proc, fsdp = run_cli([*_cli(reverse_task, qwen2_task, "--num-processes", 2), "--output-dir", tmp_path / "run"],
                         tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert split["world_size"] == fsdp["world_size"] == 2
    assert split["train_samples"] == fsdp["train_samples"] == GLOO_STEPS * 4
    assert split["eval"]["n"] == fsdp["eval"]["n"] == 64  # reverse_task's validation rows, each once
    torch.testing.assert_close([loss for _, loss, _ in split["train_loss"]],
                               [loss for _, loss, _ in fsdp["train_loss"]], atol=5e-3, rtol=0)
    assert abs(split["eval"]["loss"] - fsdp["eval"]["loss"]) < 5e-3
    hosts = sorted(p.name for p in (out / "checkpoints" / f"step-{GLOO_STEPS:08d}" / "shards").iterdir())
    assert hosts == [f"host-{rank}" for rank in range(4)]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_a_gloo_run_under_fsdp_by_tensor_resumes_exactly_from_its_checkpoint(split_run, reverse_task, qwen2_task,
                                                                        tmp_path):
    """Resumed from its step-4 checkpoint (each worker's 2-D shards of the weights and AdamW's
    moments) under the same mesh: the losses, the evaluation and the final weights are the
    uninterrupted run's, bit for bit."""
    whole, whole_dir = split_run
    resumed = resume_midway(_cli(reverse_task, qwen2_task, *SPLIT), whole_dir, tmp_path / "run", tmp_path)
    torch.testing.assert_close(resumed["train_loss"], whole["train_loss"], atol=0, rtol=0)
    assert resumed["eval"] == whole["eval"]
    assert_same_weights(tmp_path / "run", whole_dir, atol=0)
