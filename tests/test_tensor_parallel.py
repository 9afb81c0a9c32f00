"""--tensor-parallel N under `--backend xla --strategy fsdp`: a mesh of fsdp x tensor, each block's
projections split over `tensor` by the model's own tensor-parallel plan (transformers'
base_model_tp_plan; xla_train/parallel/tensor_parallel.py), every parameter over `fsdp` too, the rows
over `fsdp` only.

On 4 XLA:CPU devices in one process: fsdp=2 x tensor=2 against fsdp=4 and against plain torch on
the CPU, for a tiny Llama (key/value heads that do not split: kept whole) from its shards and from
a whole load, and a Qwen2 (biases, its key/value heads split); then CLI runs in bf16 beside fsdp
alone, and one stopped by SIGTERM and resumed. In pytest's process: the plan's layouts, the
refusals, the memory plan."""

import json
import os
import subprocess
import sys

import pytest
import tiny_decoders as td
import torch
from conftest import ROOT, assert_same_weights, resume_midway, run_cli

from xla_train.core.errors import UserError
from xla_train.parallel import tensor_parallel as tp
from xla_train.parallel.mesh import Mesh

FOUR = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "TOKENIZERS_PARALLELISM": "false"}

SAME = r"""
import functools, json, sys
import torch, torch_xla
from transformers import AutoConfig
from xla_train import Mesh
from xla_train.parallel import sharded_load
from xla_train.core.engine import Engine
from xla_train.tasks.causal_lm import DecoderModel

STEPS, LR = 3, 2e-5  # AdamW moves an element of a near-zero gradient by up to lr: 1e-4 gave 1.2e-5
ids = torch.randint(3, 200, (8, 16), generator=torch.Generator().manual_seed(0))
engines = {n: Engine("xla", strategy="fsdp", mesh=Mesh(tensor=n)) for n in (1, 2)}


def train(model, engine=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    device = "cpu"
    if engine:
        model, optimizer = engine.prepare(model, optimizer)
        device = engine.device
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
        if engine:
            torch_xla.sync()  # a graph a step, as the trainer runs them
    return model, losses


results = {}
for case in sys.argv[1:]:
    folder, ways = case.split("|")
    load = functools.partial(DecoderModel().load, folder, 7, 0)
    engines[2].strategy.check_model(AutoConfig.from_pretrained(folder))  # the CLI's check: it splits
    out = {}
    for way in ways.split(","):  # tp1 (fsdp=4), tp2 (fsdp=2 x tensor=2), from shards or whole
        n, load_way = int(way[2]), way.split("-")[1]
        engine = engines[n]
        before = engine.accelerator.compile_stats()
        model, losses = train(sharded_load.skeleton(load, folder) if load_way == "sharded" else load(), engine)
        plain = engine.unwrap_model(model)
        state = plain.state_dict(keep_vars=True)
        values = engine.strategy.read([*losses, *state.values()])
        after = engine.accelerator.compile_stats()
        if way == "tp2-sharded":
            attention = plain.model.layers[0].self_attn  # q (Phi-4-mini's fused qkv), read again once another
            first_q = getattr(attention, "q_proj", None) or attention.qkv_proj  # model is prepared
            first_q = first_q.weight
        out[way] = {"losses": [v.item() for v in values[:STEPS]], "state": dict(zip(state, values[STEPS:])),
                    "specs": {k: torch_xla._XLAC._get_xla_sharding_spec(v) for k, v in state.items()},
                    "compiles": after["compiles"] - before["compiles"],
                    "fallbacks": after["aten_fallbacks"] - before["aten_fallbacks"]}
    results[case] = out
    out["first_q_spec"] = engines[2].strategy.param_spec(first_q)  # the plan's, after later models were prepared

# plain torch on the CPU last: a CPU backward pass before the XLA runtime starts leaves autograd's
# device queues without the XLA device
report = {}
for case, out in results.items():
    folder = case.split("|")[0]
    cpu, cpu_losses = train(DecoderModel().load(folder, 7, 0))
    cpu_state = {k: v.detach() for k, v in cpu.state_dict().items()}
    first_q_spec = out.pop("first_q_spec")
    first = next(iter(out.values()))

    def furthest(state, other):
        return max((state[k] - other[k]).abs().max().item() for k in cpu_state)

    report[folder] = {way: {"losses": r["losses"], "cpu_losses": [v.item() for v in cpu_losses],
                            "from_cpu": furthest(r["state"], cpu_state),
                            "from_first": furthest(r["state"], first["state"]),
                            "specs": r["specs"], "compiles": r["compiles"], "fallbacks": r["fallbacks"]}
                      for way, r in out.items()}
    report[folder]["first_q_spec"] = first_q_spec
from xla_train.kernels.attention import _spmd_layout

report["pallas_spec"] = _spmd_layout()[0]  # what the Pallas call is given, under the last mesh (tensor 2)
print(json.dumps(report))
"""


def _qwen2(path):
    """td's tiny Qwen2 80 wide: its MLP 5.4 times the width (432), which 2 divides (64 wide: 345)."""
    return td.save("qwen2", path, size=80)


@pytest.fixture(scope="module")
def two_d(tmp_path_factory):
    """The script above in one process of 4 XLA:CPU devices: Llama from shards at tensor 1 and 2
    and whole at 2; Qwen2 from shards at 2."""
    folder = tmp_path_factory.mktemp("tp")
    cases = {"llama": f"{td.save('llama', folder / 'llama')}|tp1-sharded,tp2-sharded,tp2-whole",
             "qwen2": f"{_qwen2(folder / 'qwen2')}|tp2-sharded",
             "phi4mini": f"{td.save('phi4mini', folder / 'phi4mini')}|tp2-sharded"}
    proc = subprocess.run([sys.executable, "-c", SAME, *cases.values()], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, **FOUR})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**{family: out[case.split("|")[0]] for family, case in cases.items()}, "pallas_spec": out["pallas_spec"]}


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi4mini"])
def test_fsdp_by_tensor_trains_as_fsdp_and_as_the_cpu(family, two_d):
    """Three AdamW steps (lr 2e-5): fsdp=2 x tensor=2 gives plain torch's losses and parameters on
    the CPU within 1e-5, and fsdp=4's (Llama); no graph and no aten fallback more than fsdp=4's.
    Phi-4-mini's fused projections split by transformers' `colwise_gather_output` and
    `rowwise_split_input` styles, their outputs sliced and chunked by the model, train the same."""
    runs = dict(two_d[family])
    # a model prepared later (a frozen reference, the whole load here) leaves the first one's layout as it was
    assert runs.pop("first_q_spec") == ["tensor", "fsdp"]
    for way, r in runs.items():
        torch.testing.assert_close(r["losses"], r["cpu_losses"], atol=1e-5, rtol=0, msg=way)
        assert r["from_cpu"] < 1e-5 and r["from_first"] < 1e-5, (way, r["from_cpu"], r["from_first"])
    if family == "llama":
        fsdp, split, whole = runs["tp1-sharded"], runs["tp2-sharded"], runs["tp2-whole"]
        assert split["compiles"] <= fsdp["compiles"] and whole["compiles"] == 0, runs  # the whole load: the same graphs
        assert split["fallbacks"] == whole["fallbacks"] == fsdp["fallbacks"], runs
        assert split["specs"] != fsdp["specs"]  # not fsdp=4 again


def test_the_plan_lays_projections_out_megatrons_way(two_d):
    """On the devices (0-3 as fsdp 2 x tensor 2): q's rows split over tensor, o's columns; Llama's
    one key/value head kept whole over tensor; Qwen2's two split, with q's bias; the embedding
    over both axes; the norms over fsdp, the same on a tensor group's two devices. A whole load
    is laid out as the shards are. The Pallas call is told the heads are split over tensor."""
    llama = two_d["llama"]["tp2-sharded"]["specs"]
    layer = "model.layers.0."
    assert llama[layer + "self_attn.q_proj.weight"] == "{devices=[2,2]0,2,1,3}"  # rows over tensor, columns over fsdp
    assert llama[layer + "self_attn.o_proj.weight"] == "{devices=[2,2]0,1,2,3}"  # rows over fsdp, columns over tensor
    assert llama[layer + "self_attn.k_proj.weight"] == "{devices=[1,2,2]0,1,2,3 last_tile_dim_replicate}"
    assert llama["model.embed_tokens.weight"] == "{devices=[2,2]0,1,2,3}"
    assert llama[layer + "input_layernorm.weight"] == "{devices=[2,2]0,1,2,3 last_tile_dim_replicate}"
    assert two_d["llama"]["tp2-whole"]["specs"] == llama
    qwen2 = two_d["qwen2"]["tp2-sharded"]["specs"]
    assert qwen2[layer + "self_attn.k_proj.weight"] == qwen2[layer + "self_attn.q_proj.weight"]
    # the Pallas kernel's partition spec: rows over fsdp, heads over tensor (kernels/attention.py, _spmd_layout)
    assert two_d["pallas_spec"] == ["fsdp", "tensor", None, None]
    assert qwen2[layer + "self_attn.q_proj.bias"] == "{devices=[2,2]0,2,1,3 last_tile_dim_replicate}"
    # Phi-4-mini's styles colwise_gather_output (fused qkv_proj, gate_up_proj) and rowwise_split_input
    # (o_proj, down_proj): laid out as column- and row-parallel, not along the contraction (issue 61)
    phi = two_d["phi4mini"]["tp2-sharded"]["specs"]
    for column in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
        assert phi[layer + column] == llama[layer + "self_attn.q_proj.weight"], column
    for row in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert phi[layer + row] == llama[layer + "self_attn.o_proj.weight"], row


STEPS = 8


def _cli(reverse_task, n, rows):
    """A bf16 causal-LM run of the CLI on 4 devices at tensor `n`, `rows` a group's batch, a checkpoint
    every 4 steps."""
    return ["--backend", "xla", "--strategy", "fsdp", "--tensor-parallel", n, "--precision", "bf16", "--max-steps",
            STEPS, "--batch-size", rows, "--log-every", 2, "--eval-samples", 2, "--save-every", 4, "--problem",
            "causal-lm", "--model", reverse_task["model"], "--train-file", reverse_task["train"], "--validation-file",
            reverse_task["validation"], "--max-length", 64]


@pytest.fixture(scope="module")
def tp2_run(reverse_task, tmp_path_factory):
    """The CLI's run at fsdp 2 x tensor 2, uninterrupted: (process, metrics, output folder)."""
    out = tmp_path_factory.mktemp("tp2")
    proc, m = run_cli([*_cli(reverse_task, 2, 2), "--output-dir", out / "run"], out, env=FOUR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, m, out / "run"


def test_a_bf16_run_of_the_cli_under_fsdp_by_tensor(tp2_run, reverse_task, tmp_path):
    """What a user runs first: full fine-tuning in bf16 with --tensor-parallel 2 on 4 devices, beside
    --strategy fsdp alone on the same global batch (4 rows: 2 x --batch-size 2, 4 x 1). The rows are
    split over the 2 fsdp devices only; the losses agree within bf16's rounding, the graphs, their
    settling and the host reads are fsdp's, and the saved model loads in plain transformers."""
    from transformers import AutoModelForCausalLM

    proc, split, out = tp2_run
    fsdp_proc, fsdp = run_cli([*_cli(reverse_task, 1, 1), "--output-dir", tmp_path / "run1"], tmp_path, env=FOUR)
    assert fsdp_proc.returncode == 0, fsdp_proc.stderr[-3000:]
    assert split["world_size"] == 2 and fsdp["world_size"] == 4
    assert split["train_samples"] == fsdp["train_samples"] == STEPS * 4
    torch.testing.assert_close([loss for _, loss, _ in split["train_loss"]],
                               [loss for _, loss, _ in fsdp["train_loss"]], atol=5e-3, rtol=0)
    for key in ("compiles", "compiles_after_first_epoch", "host_syncs_per_step", "executions"):
        assert split["xla"][key] == fsdp["xla"][key], (key, split["xla"], fsdp["xla"])
    assert split["xla"]["aten_fallbacks"] == 0
    assert "this host read" in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_a_run_under_fsdp_by_tensor_resumes_exactly_from_its_checkpoint(tp2_run, reverse_task, tmp_path):
    """The same run resumed from its step-4 checkpoint (the host's 2-D shards of the weights and
    AdamW's moments) under the same mesh: the losses after it, the evaluation, the final weights
    and the last checkpoint's moments are the uninterrupted run's, bit for bit, and the resumed
    run compiles no graph more (the moments loaded laid out as their parameters). The checkpoints
    hold every tensor: those split over one axis only (the norms, the kept-whole key/value
    projections, over `fsdp`) have two replicas of each slice on the host, which torch_xla's
    dedup_tensors left out of the checkpoint altogether, and the resume stopped on their missing
    key (parallel.xla_strategies._save_planner)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, whole, whole_dir = tp2_run
    resumed = resume_midway(_cli(reverse_task, 2, 2), whole_dir, tmp_path / "run", tmp_path, env=FOUR)
    assert [h[0] for h in resumed["train_loss"]] == [h[0] for h in whole["train_loss"]]
    after = [h for h in resumed["train_loss"] if h[0] > 4]
    assert after and after == [h for h in whole["train_loss"] if h[0] > 4]
    torch.testing.assert_close(resumed["train_loss"], whole["train_loss"], atol=0, rtol=0)
    assert_same_weights(tmp_path / "run", whole_dir, atol=0)
    assert resumed["eval"] == whole["eval"]
    assert resumed["xla"]["compiles"] <= whole["xla"]["compiles"], (resumed["xla"], whole["xla"])
    final = load_file(str(whole_dir / "model.safetensors"))
    saved = []
    for run in (whole_dir, tmp_path / "run"):
        dcp_to_torch_save(run / "checkpoints" / f"step-{STEPS:08d}" / "shards" / "host-0", tmp_path / "whole.pt")
        saved.append(torch.load(tmp_path / "whole.pt", weights_only=True))
    assert saved[0]["model"].keys() == final.keys() and len(saved[0]["optimizer"]) == 2 * len(final)
    for part in ("model", "optimizer"):
        assert saved[0][part].keys() == saved[1][part].keys()
        for k in saved[0][part]:
            torch.testing.assert_close(saved[1][part][k], saved[0][part][k], atol=0, rtol=0, msg=k)


def test_refusals_name_what_does_not_split():
    from transformers import BertConfig, LlamaConfig

    assert tp.refusal(LlamaConfig(num_attention_heads=4, num_key_value_heads=1, intermediate_size=256), 2) is None
    assert tp.refusal(BertConfig(), 2) == ("`tensor_parallel` 2: BertConfig has no tensor-parallel plan "
                                           "(transformers' base_model_tp_plan)")
    assert tp.refusal(LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2), 4) == (
        "`tensor_parallel` 4: LlamaConfig's attention heads (6) cannot be split evenly over 4 devices")
    assert tp.refusal(LlamaConfig(num_attention_heads=4, intermediate_size=345), 2) == (
        "`tensor_parallel` 2: LlamaConfig's MLP width (345) cannot be split evenly over 2 devices")
    assert tp.refusal(BertConfig(), 1) is None


def test_tensor_parallel_runs_only_as_a_mesh_of_fsdp_by_tensor():
    from xla_train.core.select import select_roles

    with pytest.raises(UserError, match="runs under `strategy` fsdp .* on the xla, cuda and cpu backends only, not "
                                        "cpu with ddp"):
        select_roles("cpu", strategy="ddp", mesh=Mesh(tensor=2))
    with pytest.raises(UserError, match="not tpu with fsdp"):
        select_roles("tpu", strategy="fsdp", mesh=Mesh(tensor=2))
    with pytest.raises(UserError, match="`tensor_parallel` must be a whole number of at least 1, not 0"):
        select_roles("cpu", mesh=Mesh(tensor=0))


def test_the_specs_follow_the_plan_through_wrappers_and_adapters():
    """FSDPv2's wrapper attribute and a LoRA layer's base_layer are seen through; a layer's number
    matches the plan's `*`; Gemma 3's plan comes from its text config."""
    from transformers import Gemma3Config, LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=50))
    specs = tp.planned_specs(model, 2)
    assert specs["model.layers.1.mlp.down_proj.weight"] == ("fsdp", "tensor")
    assert specs["model.layers.1.self_attn.v_proj.weight"] == ("tensor", "fsdp")
    assert len(specs) == 2 * 7
    assert tp._style(tp.plan_of(model.config), "base_model.model.model.layers.3._orig_module.self_attn.q_proj"
                     ".base_layer") == "colwise"
    assert tp._style(tp.plan_of(model.config), "model.layers.3.self_attn.q_proj.lora_A.default") is None
    assert tp.plan_of(Gemma3Config())["layers.*.mlp.down_proj"] == "rowwise"
    assert tp.default_spec((50, 32), tensor=True) == ("fsdp", "tensor")
    assert tp.default_spec((32,), tensor=True) == ("fsdp",)


@pytest.mark.parametrize("family", ["phi4mini", "olmo2"])
def test_gather_output_and_split_input_styles_split_as_columns_and_rows(family):
    """transformers' `colwise_gather_output` and `rowwise_split_input` (Phi-4-mini's fused qkv_proj and
    gate_up_proj, OLMo-2's q/k/v/o, whose q and k norms span every head) split a weight's output and
    input as `colwise` and `rowwise` do; a fused qkv_proj is not taken for a key/value projection kept
    whole (Phi-4-mini's one key/value head, which 2 does not divide)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(td.config(family, 50))
    plan, specs = tp.plan_of(model.config), tp.planned_specs(model, 2)
    assert {"colwise_gather_output", "rowwise_split_input"} <= set(plan.values()), plan
    layer = "model.layers.0."
    for pattern, style in plan.items():
        name = layer + pattern.removeprefix("layers.*.") + ".weight"
        if style in tp.COLUMN + tp.ROW:
            assert specs[name] == (("tensor", "fsdp") if style in tp.COLUMN else ("fsdp", "tensor")), (name, style)
    if family == "phi4mini":
        assert model.config.num_key_value_heads % 2 and specs[layer + "self_attn.qkv_proj.weight"] == ("tensor", "fsdp")


def test_the_memory_plan_splits_a_blocks_heads_and_mlp_not_its_norms():
    from transformers import LlamaConfig

    from xla_train.memory import layer_bytes

    config = LlamaConfig(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                         num_hidden_layers=2)
    whole, split = (layer_bytes(config, 2, 128, dense_mask=False, tensor=n) for n in (1, 2))
    norms = 2 * (4 * 64 + 4 * 64 + 4 * 64) * 2 * 128  # two norms' input, fp32 value and output, a token
    assert split - norms == (whole - norms) // 2
    # one key/value head, which 2 does not divide: kept whole on each device, the rest halved
    one_kv = dict(hidden_size=64, head_dim=16, num_key_value_heads=1, num_hidden_layers=2)
    assert layer_bytes(LlamaConfig(num_attention_heads=4, intermediate_size=256, **one_kv), 2, 128, tensor=2) == \
        layer_bytes(LlamaConfig(num_attention_heads=2, intermediate_size=128, **one_kv), 2, 128)
