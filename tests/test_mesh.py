"""parallel/mesh.py: one value for every axis of the device mesh (issue 62), and the two axes it
brought, experts and context, on XLA's SPMD.

In pytest's process: the value's layout, its refusals and the strategies' use of it. In one
process of 4 XLA:CPU devices (a module fixture, as test_tensor_parallel.py's): a tiny Llama and
Qwen3 on packed 256-token rows and a tiny Qwen3-MoE and gpt-oss, each trained under fsdp alone and
under `context`, `expert` and `tensor` beside it; every way must give fsdp alone's losses and
weights within 1e-5 (fp32), compile no more graphs and run no aten op on the CPU."""

import json
import os
import subprocess
import sys

import pytest
import tiny_decoders as td
from conftest import ROOT, run_python

from xla_train.core.errors import UserError
from xla_train.parallel.mesh import Mesh, rows_entry, tokens_entry

FOUR = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XLA_USE_SPMD": "1"}


# --- the value -----------------------------------------------------------------------------------
def test_the_mesh_lays_the_devices_out_once():
    """What the named axes leave goes to fsdp (the parameters split) or data; rows are split over
    data, fsdp and expert; a context x tensor group's devices see the same rows."""
    mesh = Mesh(context=2, tensor=2).resolve(8, sharded=True)
    assert (mesh.data, mesh.fsdp, mesh.expert, mesh.context, mesh.tensor) == (1, 2, 1, 2, 2)
    assert mesh.shape("fsdp") == (("fsdp", 2), ("context", 2), ("tensor", 2))
    assert mesh.rows == 2 and mesh.param_shards == 4 and mesh.devices == 8
    assert [mesh.row_share(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    experts = Mesh(expert=2).resolve(4, sharded=True)
    assert experts.shape("fsdp") == (("fsdp", 2), ("expert", 2)) and experts.rows == 4
    assert Mesh().resolve(4, sharded=False).shape("data") == (("data", 4),)
    assert Mesh().resolve(1, sharded=True).shape("fsdp") == (("fsdp", 1),)  # the strategy's axis is always there


def test_the_specs_name_the_axes_the_mesh_has():
    mesh = Mesh(expert=2, context=2).resolve(8, sharded=True)
    assert mesh.batch_spec(2, tokens=True) == (("fsdp", "expert"), "context")
    assert mesh.batch_spec(3, tokens=False) == (("fsdp", "expert"), None, None)
    assert mesh.param_axes() == ("fsdp", "expert", "context")
    assert mesh.param_axes(but=("expert",)) == ("fsdp", "context")
    assert Mesh().resolve(4, sharded=True).batch_spec(2) == ("fsdp", None)
    # an axis of one device is left out: it splits nothing
    assert Mesh(context=2, tensor=2).resolve(4, sharded=True).batch_spec(2, tokens=True) == (None, "context")
    assert rows_entry(("fsdp", "expert", "tensor")) == ("fsdp", "expert")
    assert rows_entry(("data",)) == "data"
    assert tokens_entry(("fsdp", "expert", "context", "tensor"), but="expert") == ("fsdp", "context")


def test_the_mesh_refuses_in_one_line():
    with pytest.raises(UserError, match=r"^`context_parallel` 2, `tensor_parallel` 2 \(4 devices a group\) does "
                                        r"not divide the 6 devices$"):
        Mesh(context=2, tensor=2).resolve(6, sharded=True)
    with pytest.raises(UserError, match=r"^`expert_parallel` must be a whole number of at least 1, not 0$"):
        Mesh(expert=0)
    with pytest.raises(UserError, match=r"^`pipeline_parallel` 2: not built yet"):
        Mesh(pipeline=2)
    with pytest.raises(UserError, match=r"^`fsdp_parallel` 2: this strategy lays the devices the named axes leave "
                                        r"out over `data`$"):
        Mesh(fsdp=2).resolve(4, sharded=False)


def test_the_new_axes_run_under_fsdp_only():
    from xla_train.core.select import select_roles

    with pytest.raises(UserError, match=r"^`expert_parallel` 2 runs under `strategy` fsdp .* on the xla, cuda and "
                                        r"cpu backends only, not cpu with ddp$"):
        select_roles("cpu", 4, "ddp", Mesh(expert=2))
    with pytest.raises(UserError, match=r"^`context_parallel` 2 runs under `strategy` fsdp .* on the xla, cuda and "
                                        r"cpu backends only, not cpu with ddp$"):
        select_roles("cpu", 4, "ddp", Mesh(context=2))
    assert select_roles("cpu", 4, "fsdp", Mesh(context=2)).planned_data_parallel_size() == 2
    with pytest.raises(UserError, match=r"^`expert_parallel` 2 runs under .* not xla with ddp$"):
        select_roles("xla", None, "ddp", Mesh(expert=2))


def test_experts_split_only_where_there_are_experts_that_n_divides():
    from transformers import GptOssConfig, LlamaConfig, Qwen3MoeConfig

    from xla_train.kernels.experts import expert_refusal

    assert expert_refusal(LlamaConfig(), 2) == "`expert_parallel` 2: LlamaConfig is not a mixture of experts"
    assert expert_refusal(Qwen3MoeConfig(num_experts=6), 4) == (
        "`expert_parallel` 4: Qwen3MoeConfig's 6 experts cannot be split evenly over 4 devices")
    assert expert_refusal(GptOssConfig(num_local_experts=8), 4) is None
    assert expert_refusal(LlamaConfig(), 1) is None


def test_the_options_make_one_mesh():
    from xla_train.options import TrainOptions

    cfg = TrainOptions(strategy="fsdp", tensor_parallel=2, context_parallel=2)
    assert cfg.mesh() == Mesh(tensor=2, context=2)
    assert cfg.mesh().named() == "`context_parallel` 2, `tensor_parallel` 2"


# --- on 4 XLA:CPU devices ------------------------------------------------------------------------
SAME = r"""
import functools, json, sys
import torch, torch_xla
from transformers import AutoConfig
from xla_train import Mesh
from xla_train.core.engine import Engine
from xla_train.tasks.causal_lm import DecoderModel, NextToken

STEPS, LR, ROWS, LENGTH = 2, 2e-5, 4, 256
MESHES = {"fsdp": Mesh(), "cp2": Mesh(context=2), "cp2tp2": Mesh(context=2, tensor=2), "ep2": Mesh(expert=2),
          "ep2tp2": Mesh(expert=2, tensor=2)}
engines = {}


def packed(vocab, seed):
    # rows of 3 or 4 documents each, then padding (segment 0): positions from 0 in each document,
    # a token's label the next token of its document
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (ROWS, LENGTH), generator=g)
    positions, segments = torch.zeros_like(ids), torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r in range(ROWS):
        cuts = [0, *sorted(torch.randint(8, LENGTH - 40, (3,), generator=g).tolist()), LENGTH - 8 * (r + 1)]
        for n, (a, b) in enumerate(zip(cuts, cuts[1:]), 1):
            positions[r, a:b], segments[r, a:b] = torch.arange(b - a), n
            labels[r, a:b - 1] = ids[r, a + 1:b]
    return [{"input_ids": ids[r], "position_ids": positions[r], "segments": segments[r], "labels": labels[r]}
            for r in range(ROWS)]


def train(folder, way, vocab):
    engine = engines.setdefault(way, Engine("xla", strategy="fsdp", mesh=MESHES[way]))
    engine.strategy.check_model(AutoConfig.from_pretrained(folder))  # the CLI's check: it splits
    torch.manual_seed(0)
    model = DecoderModel().load(folder, 7, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = [row for step in range(STEPS) for row in packed(vocab, step)]
    loader = torch.utils.data.DataLoader(rows, batch_size=ROWS)
    before = engine.accelerator.compile_stats()
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    objective, losses, spec = NextToken(), [], None
    for batch in loader:
        spec = spec or torch_xla._XLAC._get_xla_sharding_spec(batch["input_ids"])
        labels = batch.pop("labels")
        loss = objective.loss(objective.forward(model, batch), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
        torch_xla.sync()
    plain = engine.unwrap_model(model)
    state = plain.state_dict()
    values = engine.strategy.read([*losses, *state.values()])
    after = engine.accelerator.compile_stats()
    experts = [n for n in state if "experts" in n and n.endswith(("gate_up_proj", "down_proj"))]
    return {"losses": [v.item() for v in values[:STEPS]], "state": dict(zip(state, values[STEPS:])),
            "input_spec": spec, "expert_spec": experts and torch_xla._XLAC._get_xla_sharding_spec(state[experts[0]]),
            "compiles": after["compiles"] - before["compiles"],
            "fallbacks": after["aten_fallbacks"] - before["aten_fallbacks"]}


report = {}
for case in sys.argv[1:]:
    folder, vocab, ways = case.split("|")
    runs = {way: train(folder, way, int(vocab)) for way in ways.split(",")}
    first = runs["fsdp"]
    furthest = lambda state: max((state[k] - first["state"][k]).abs().max().item() for k in state)
    report[folder] = {way: {"losses": r["losses"], "fsdp_losses": first["losses"], "from_fsdp": furthest(r["state"]),
                            "input_spec": r["input_spec"], "expert_spec": r["expert_spec"],
                            "compiles": r["compiles"], "fsdp_compiles": first["compiles"], "fallbacks": r["fallbacks"]}
                      for way, r in runs.items()}

# the loaders' sharding where the spec names every dimension and the mesh has more axes: as mark_sharding's
import numpy as np
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
from xla_train.parallel.xla_strategies import _sharding_spec

report["layouts"] = []
for shape, names, spec in [((1, 2, 2), ("fsdp", "expert", "context"), ("expert", "context")),
                           ((1, 2, 2), ("fsdp", "context", "tensor"), ("fsdp", "context"))]:
    mesh, t = xs.Mesh(np.arange(4), shape, names), torch.arange(4 * 512).reshape(4, 512)
    (sent,) = xm.send_cpu_data_to_device([t], torch_xla.device(), _sharding_spec(mesh, spec))
    marked = t.to(torch_xla.device())
    xs.mark_sharding(marked, mesh, spec)
    layout = torch_xla._XLAC._get_xla_sharding_spec
    report["layouts"].append([layout(sent), layout(marked), torch.equal(sent.cpu(), t)])
print(json.dumps(report))
"""

CASES = {"llama": ("llama", "fsdp,cp2,cp2tp2"), "qwen3": ("qwen3", "fsdp,cp2"),
         "qwen3moe": ("qwen3moe", "fsdp,ep2,ep2tp2"), "gptoss": ("gptoss", "fsdp,ep2")}


@pytest.fixture(scope="module")
def ways(tmp_path_factory):
    """The script above in one process of 4 XLA:CPU devices, every family and way of CASES."""
    from transformers import AutoConfig

    folder = tmp_path_factory.mktemp("mesh")
    args, names = [], {}
    for family, (name, ways_) in CASES.items():
        path = td.save(name, folder / family)
        vocab = min(AutoConfig.from_pretrained(path).vocab_size, 120)
        args.append(f"{path}|{vocab}|{ways_}")
        names[family] = str(path)
    proc = run_python(["-c", SAME, *args], {**os.environ, **FOUR}, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**{family: out[path] for family, path in names.items()}, "layouts": out["layouts"]}


@pytest.mark.parametrize("family,way", [(f, w) for f, (_, ws) in CASES.items() for w in ws.split(",")[1:]])
def test_every_axis_trains_as_fsdp_alone(ways, family, way):
    """Two AdamW steps: the same losses and weights as fsdp over the 4 devices (fp32, 1e-5), no
    more compilations, no aten op on the CPU."""
    run = ways[family][way]
    assert run["losses"] == pytest.approx(run["fsdp_losses"], abs=1e-5), run
    assert run["from_fsdp"] < 1e-5, run
    assert run["compiles"] <= run["fsdp_compiles"], run
    assert run["fallbacks"] == 0, run


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_context_splits_each_rows_tokens(ways, family):
    """Under fsdp 2 x context 2 a batch's rows go over fsdp and each row's 256 tokens over context:
    each device holds 2 rows x 128 tokens; fsdp alone splits the rows only."""
    assert ways[family]["cp2"]["input_spec"].startswith("{devices=[2,2]"), ways[family]["cp2"]
    assert ways[family]["fsdp"]["input_spec"].startswith("{devices=[4,1]"), ways[family]["fsdp"]


def test_the_loaders_lay_a_fully_named_spec_as_mark_sharding_does(ways):
    """torch_xla 2.9's ShardingSpec fails on a spec naming every dimension over a mesh with more
    axes; the loaders' (xla_strategies._sharding_spec) gives mark_sharding's layout and the data."""
    for sent, marked, same in ways["layouts"]:
        assert sent == marked and same, (sent, marked)


@pytest.mark.parametrize("family", ["qwen3moe", "gptoss"])
def test_experts_are_split_by_expert(ways, family):
    """Under fsdp 2 x expert 2 each device holds half the experts: the stacked weights' first
    dimension split over `expert` (and their largest other one over fsdp)."""
    spec = ways[family]["ep2"]["expert_spec"]
    assert spec.startswith("{devices=[2,"), spec


# --- the command line under both new axes --------------------------------------------------------
STEPS = 8


def _cli(task, model):
    """A bf16 causal-LM run of the CLI on 4 devices, fsdp 1 x expert 2 x context 2: a tiny
    Qwen3-MoE on the synthetic task, a checkpoint every 4 steps."""
    return ["--backend", "xla", "--strategy", "fsdp", "--expert-parallel", 2, "--context-parallel", 2,
            "--precision", "bf16", "--max-steps", STEPS, "--batch-size", 2, "--log-every", 2, "--save-every", 4,
            "--problem", "causal-lm", "--model", model, "--train-file", task["train"], "--validation-file",
            task["validation"], "--max-length", 64]


def test_a_run_under_experts_and_context_resumes_exactly(reverse_task, tmp_path):
    """Resumed from its step-4 checkpoint (each device's shards of the experts split by expert, of
    every parameter over expert x context) under the same mesh: the losses after it, the
    evaluation and the final weights are the uninterrupted run's, bit for bit, with no graph more;
    the rows are split over the expert axis only (world size 2) and the saved model loads in plain
    transformers."""
    from conftest import assert_same_weights, resume_midway, run_cli
    from transformers import AutoModelForCausalLM

    model = td.save("qwen3moe", tmp_path / "moe", chat=True, letters=True)
    whole_proc, whole = run_cli([*_cli(reverse_task, model), "--output-dir", tmp_path / "whole"], tmp_path, env=FOUR)
    assert whole_proc.returncode == 0, whole_proc.stderr[-3000:]
    assert whole["world_size"] == 2 and whole["train_samples"] == STEPS * 4
    assert whole["xla"]["aten_fallbacks"] == 0
    resumed = resume_midway(_cli(reverse_task, model), tmp_path / "whole", tmp_path / "run", tmp_path, env=FOUR)
    after = [h for h in resumed["train_loss"] if h[0] > 4]
    assert after and after == [h for h in whole["train_loss"] if h[0] > 4]
    assert resumed["eval"] == whole["eval"]
    assert_same_weights(tmp_path / "run", tmp_path / "whole", atol=0)
    assert resumed["xla"]["compiles"] <= whole["xla"]["compiles"], (resumed["xla"], whole["xla"])
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "whole")).__name__ == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_dpo_pairs_and_grpo_rollouts_take_the_context_axis(kind, reverse_task, tmp_path):
    """Three steps of DPO (a pair's two rows) and of GRPO (rollouts sampled in the step, scored,
    trained on) under fsdp 2 x context 2 on 4 XLA:CPU devices, beside fsdp 4 on the same global
    batch: the same losses (the rollouts are the same: one program samples every row), the same
    number of graphs, no aten fallback."""
    from conftest import run_cli
    from test_dpo import pairs
    from test_grpo import REWARD, prompts

    if kind == "dpo":
        train = td.write_jsonl(tmp_path / "pairs.jsonl", pairs(64, 1))
        args, rows = ["--problem", "dpo", "--max-length", 32, "--buckets", 32], 2
    else:
        train = td.write_jsonl(tmp_path / "prompts.jsonl", prompts(64, 1))
        args, rows = ["--problem", "grpo", "--reward", REWARD, "--num-generations", 8, "--max-completion-length", 8,
                      "--max-length", 16], 8
    runs = {}
    for way, extra in (("fsdp", ["--batch-size", rows]), ("cp2", ["--batch-size", 2 * rows, "--context-parallel", 2])):
        proc, runs[way] = run_cli(["--backend", "xla", "--strategy", "fsdp", "--model", reverse_task["model"],
                                   "--train-file", train, "--max-steps", 3, "--log-every", 1, "--lr", 1e-3,
                                   "--no-data-cache", *args, *extra, "--output-dir", tmp_path / way], tmp_path,
                                  env=FOUR)
        assert proc.returncode == 0, proc.stderr[-3000:]
    fsdp, split = runs["fsdp"], runs["cp2"]
    assert split["world_size"] == 2 and fsdp["world_size"] == 4
    losses = [loss for _, loss, _ in split["train_loss"]], [loss for _, loss, _ in fsdp["train_loss"]]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5), losses
    assert split["xla"]["compiles"] == fsdp["xla"]["compiles"] and split["xla"]["aten_fallbacks"] == 0


# The workers' loop, shared by the two axes' scripts below: each tail gives STEPS, LR, ROWS, `rows`
# and the meshes. Every run records what either test reads (the row length, the experts held).
GLOO_WORKER = r"""
import sys
import torch
from xla_train import Mesh, launch
from xla_train.core.engine import Engine
from xla_train.core.roles import optimizer_params
from xla_train.tasks.causal_lm import DecoderModel, NextToken


def worker(cases, out):
    engine = Engine()
    results = {}
    for case in cases:
        folder, vocab = case.split("|")
        torch.manual_seed(0)
        model = DecoderModel().load(folder, 7, 0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        data = [row for step in range(STEPS) for row in rows(int(vocab), step)]
        loader = torch.utils.data.DataLoader(data, batch_size=ROWS // engine.strategy.row_shares)
        model, optimizer, loader = engine.prepare(model, optimizer, loader)
        objective, losses, norms, length = NextToken(), [], [], None
        for batch in loader:
            length = batch["input_ids"].shape[1]
            labels = batch.pop("labels")
            loss = objective.loss(objective.forward(model, batch), labels)
            engine.backward(loss)
            norms.append(engine.strategy.grad_norm(optimizer_params(optimizer)).item())  # AdamW hides a scale
            engine.optimizer_step(optimizer)
            optimizer.zero_grad()
            losses.append(engine.strategy.gather_batch(loss.detach()[None]).mean().item())
        inner = engine.unwrap_model(model)
        held = sorted({m.num_experts for name, m in inner.named_modules() if name.endswith("mlp.experts")})
        state = inner.state_dict()
        placed = {k: str(getattr(v, "placements", None)) for k, v in state.items() if "experts.gate_up_proj" in k}
        results[folder] = {"losses": losses, "norms": norms, "length": length, "held": held, "placed": placed,
                           "state": {k: engine.strategy.whole(v.detach()).clone() for k, v in state.items()}}
    if engine.strategy.is_main:
        torch.save(results, out)


def run(meshes):
    folder, cases = sys.argv[1], sys.argv[2:]
    for name, mesh in meshes:
        launch(worker, (cases, f"{folder}/{name}.pt"), backend="cpu", num_processes=4, strategy="fsdp", mesh=mesh)
"""

# --- context on 4 gloo workers (FSDP2) -----------------------------------------------------------
# Both meshes in one subprocess, each a launch of 4 workers: fsdp 4, then fsdp 2 x context 2, whose
# context peers each hold 128 of every row's 256 tokens (kernels.context). Every row has the same
# trained tokens: data parallelism averages each worker's mean, which equals the token-weighted
# mean over the batch only then.
GLOO = GLOO_WORKER + r"""
STEPS, LR, ROWS, LENGTH = 2, 2e-5, 4, 256


def rows(vocab, seed):
    # test_mesh's rows (3 or 4 documents, then padding), every row ending 8 tokens short
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (ROWS, LENGTH), generator=g)
    positions, segments = torch.zeros_like(ids), torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r in range(ROWS):
        cuts = [0, *sorted(torch.randint(8, LENGTH - 40, (3,), generator=g).tolist()), LENGTH - 8]
        for n, (a, b) in enumerate(zip(cuts, cuts[1:]), 1):
            positions[r, a:b], segments[r, a:b] = torch.arange(b - a), n
            labels[r, a:b - 1] = ids[r, a + 1:b]
    return [{"input_ids": ids[r], "position_ids": positions[r], "segments": segments[r], "labels": labels[r]}
            for r in range(ROWS)]


if __name__ == "__main__":
    run((("fsdp", Mesh()), ("cp2", Mesh(context=2))))
"""


def _on_gloo(folder, script, families, ways):
    """`script` (its launches of 4 gloo workers, one a mesh of `ways`) run once on tiny models of
    `families` in `folder`: {family: {way: the worker's results}}."""
    import torch
    from transformers import AutoConfig

    (folder / "gloo.py").write_text(script)
    paths = {family: td.save(family, folder / family) for family in families}
    cases = [f"{p}|{min(AutoConfig.from_pretrained(p).vocab_size, 120)}" for p in paths.values()]
    proc = subprocess.run([sys.executable, folder / "gloo.py", folder, *cases], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = {way: torch.load(folder / f"{way}.pt") for way in ways}
    return {family: {way: runs[way][str(p)] for way in runs} for family, p in paths.items()}


@pytest.fixture(scope="module")
def gloo_context(tmp_path_factory):
    """The script above: {family: {"fsdp": result, "cp2": result}}."""
    return _on_gloo(tmp_path_factory.mktemp("mesh_gloo"), GLOO, ("llama", "qwen3"), ("fsdp", "cp2"))


@pytest.mark.torch_native  # make test-torch runs it on the newest torch too (_flatten, DTensor)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_context_on_gloo_trains_as_fsdp_alone(gloo_context, family):
    """Two AdamW steps on packed 256-token rows: fsdp 2 x context 2 (each worker 128 tokens of each
    row, attention over the whole row's gathered keys and values, the loss summed over the context
    group, FSDP2 over fsdp x context) gives fsdp 4's losses and weights within 1e-5 (fp32), and
    its gradients' norm (which AdamW's update does not show) within 1e-5 of it."""
    fsdp, split = gloo_context[family]["fsdp"], gloo_context[family]["cp2"]
    assert (fsdp["length"], split["length"]) == (256, 128)
    assert split["losses"] == pytest.approx(fsdp["losses"], abs=1e-5), (split["losses"], fsdp["losses"])
    assert fsdp["losses"][0] != fsdp["losses"][1]
    assert split["norms"] == pytest.approx(fsdp["norms"], rel=1e-5), (split["norms"], fsdp["norms"])
    furthest = max((split["state"][k] - w).abs().max().item() for k, w in fsdp["state"].items())
    assert furthest < 1e-5, furthest


def test_context_peers_take_their_slice_of_every_row():
    """kernels.context.Context.split_rows: the second of 2 workers keeps tokens 4..7 of every token
    column of a causal LM's document rows (they carry segments), rows without positions get their
    global ones, other tensors are left whole; a batch without segments (a classifier's rows,
    prompts to generate from) goes whole to every worker; a length 2 does not divide is refused
    in one line."""
    import torch

    from xla_train.kernels.context import Context

    ids = torch.arange(16).reshape(2, 8)
    rows = {"input_ids": ids, "labels": ids + 1, "segments": torch.ones_like(ids), "valid": torch.ones(2)}
    part = Context(None, 2, 1).split_rows(rows)
    assert part["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert part["labels"].tolist() == [[5, 6, 7, 8], [13, 14, 15, 16]]
    assert part["position_ids"].tolist() == [[4, 5, 6, 7]] * 2 and part["valid"].shape == (2,)
    classifier = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.ones(2)}
    assert Context(None, 2, 1).split_rows(classifier) is classifier
    with pytest.raises(UserError, match=r"^`context_parallel` 2 does not divide the rows' length 7: "):
        Context(None, 2, 0).split_rows({"input_ids": ids[:, :7], "segments": ids[:, :7]})


# --- experts on 4 gloo workers (FSDP2) -----------------------------------------------------------
# Both meshes in one subprocess, each a launch of 4 workers: fsdp 4, then fsdp 2 x expert 2, whose
# expert peers (different rows) each hold 2 of the 4 experts and send each (token, expert) pair to
# its expert's worker and back (transformers' expert plan and all-to-all token dispatch).
GLOO_EXPERTS = GLOO_WORKER + r"""
STEPS, LR, ROWS, LENGTH = 2, 1e-3, 4, 64


def rows(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (ROWS, LENGTH), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((ROWS, 1), -100)], 1)
    positions, segments = torch.arange(LENGTH).expand(ROWS, LENGTH), torch.ones_like(ids)
    return [{"input_ids": ids[r], "position_ids": positions[r], "segments": segments[r], "labels": labels[r]}
            for r in range(ROWS)]


if __name__ == "__main__":
    run((("fsdp", Mesh()), ("ep2", Mesh(expert=2))))
"""


@pytest.fixture(scope="module")
def gloo_experts(tmp_path_factory):
    """The script above: {family: {"fsdp": result, "ep2": result}}."""
    return _on_gloo(tmp_path_factory.mktemp("mesh_gloo_experts"), GLOO_EXPERTS, ("qwen3moe", "gptoss"), ("fsdp", "ep2"))


@pytest.mark.torch_native  # make test-torch runs it on the newest torch too (DTensor, all-to-all)
@pytest.mark.parametrize("family", ["qwen3moe", "gptoss"])
def test_experts_on_gloo_train_as_fsdp_alone(gloo_experts, family):
    """Two AdamW steps: fsdp 2 x expert 2 (each worker 2 of the 4 experts, split by expert over
    `expert` and sharded by FSDP2 over `fsdp`; the rest over both) gives fsdp 4's losses and
    weights within 1e-5 (fp32), and its gradients' norm within 1e-5: an expert's gradient, summed
    over the rows its group sent it, is divided by the 4 workers' rows as the rest's is."""
    fsdp, split = gloo_experts[family]["fsdp"], gloo_experts[family]["ep2"]
    assert (fsdp["held"], split["held"]) == ([4], [2])
    assert set(split["placed"].values()) == {"(_StridedShard(dim=0, sf=2), Shard(dim=0))"}
    assert split["losses"] == pytest.approx(fsdp["losses"], abs=1e-5), (split["losses"], fsdp["losses"])
    assert fsdp["losses"][0] != fsdp["losses"][1]
    assert split["norms"] == pytest.approx(fsdp["norms"], rel=1e-5), (split["norms"], fsdp["norms"])
    furthest = max((split["state"][k] - w).abs().max().item() for k, w in fsdp["state"].items())
    assert furthest < 1e-5, furthest


def test_experts_on_fsdp2_refuse_in_one_line():
    """What FSDP2's expert axis does not take, before anything loads: a dense model, experts N does
    not divide, a family without transformers' expert plan, LoRA and the other new axes beside it."""
    from transformers import JetMoeConfig, LlamaConfig, Qwen3MoeConfig

    from xla_train.core.select import select_roles

    strategy = select_roles("cpu", 4, "fsdp", Mesh(expert=2)).strategy
    for config, lora, line in [
            (LlamaConfig(), False, "LlamaConfig is not a mixture of experts"),
            (Qwen3MoeConfig(num_experts=3), False, "Qwen3MoeConfig's 3 experts cannot be split evenly over 2"),
            (JetMoeConfig(num_local_experts=4), False, "JetMoeConfig has no expert-parallel plan in transformers"),
            (Qwen3MoeConfig(num_experts=4), True, "with `lora` runs on the xla backend only so far")]:
        with pytest.raises(UserError, match=r"^`expert_parallel` 2:? " + line.replace("`", ".")):
            strategy.check_model(config, lora)
    strategy.check_model(Qwen3MoeConfig(num_experts=4))
    with pytest.raises(UserError, match=r"^`expert_parallel` 2 with `context_parallel` runs on the xla backend"):
        select_roles("cpu", 4, "fsdp", Mesh(expert=2, context=2)).strategy.check_model(Qwen3MoeConfig(num_experts=4))
