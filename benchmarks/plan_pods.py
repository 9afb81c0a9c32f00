"""The memory plan (xla_train/memory.py, `plan_on_paper`) of the pod recipes: what each chip holds
for Llama 3.1 70B fully fine-tuned on a v5p-64 and on a v6e-64, and Llama 3.1 8B on a v5e-8 with
LoRA and without. Models are built on torch's meta device from their published configs
(benchmarks/published_configs.json), no weights, no hub, no TPU.

    python benchmarks/plan_pods.py

Prints a table and writes OUT/plan.json and OUT/plan.md (OUT: benchmarks/out/plan_pods). Each
row also gives what one host holds while the model loads: the whole model in fp32 where it loads
whole (other strategies, a resume), against its chips' shards where it is read into them
(--strategy fsdp on XLA, --lora's base too: parallel/sharded_load.py).
"""

import argparse
import dataclasses
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
# recipe, chips, chips a host, device kind (xla_train.core.xla.TPU_HBM), the recipe changed
CASES = [
    ("llama-3.1-70b-fsdp-v5p64.yaml", "v5p-64", 32, 4, "TPU v5p", {}),
    ("llama-3.1-70b-fsdp-v6e64.yaml", "v6e-64", 64, 4, "TPU v6 lite", {}),
    ("llama-3.1-8b-lora-v5e8.yaml", "v5e-8", 8, 8, "TPU v5 lite", {}),
    ("llama-3.1-8b-lora-v5e8.yaml", "v5e-8", 8, 8, "TPU v5 lite", {"lora": False}),
]


def plans():
    from transformers import AutoConfig

    from xla_train.core.xla import TPU_HBM
    from xla_train.memory import plan_on_paper
    from xla_train.options import TrainOptions, read_recipe

    published = json.loads((ROOT / "benchmarks" / "published_configs.json").read_text())
    rows = []
    for recipe, slice_name, chips, per_host, kind, change in CASES:
        cfg = dataclasses.replace(TrainOptions(**read_recipe(str(ROOT / "recipes" / recipe))), **change)
        memory = plan_on_paper(cfg, AutoConfig.for_model(**published[cfg.model]), chips, TPU_HBM[kind])  # memory.Plan
        whole_fp32 = memory.params * 4
        rows.append({
            "recipe": recipe, "slice": slice_name, "chips": chips, "chips_per_host": per_host,
            "model": cfg.model, "lora": cfg.lora, "precision": cfg.precision, "batch_size": cfg.batch_size,
            "max_length": cfg.max_length, "checkpointed": cfg.gradient_checkpointing,
            "params": memory.params, "trainable": memory.trainable_params,
            "weights_grads_adam_gib": (memory.weights_total + 3 * memory.gradients * chips) / GIB,
            "peak_gib_per_chip": memory.total / GIB, "chip_gib": TPU_HBM[kind] / GIB,
            "fits": memory.total <= TPU_HBM[kind],
            "host_load_today_gib": whole_fp32 / GIB,
            "host_share_gib": memory.weights * per_host / GIB,
            "memory": memory.metrics(),
        })
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "plan_pods"))
    args = p.parse_args()
    os.environ.setdefault("USE_TORCH_XLA", "0")  # transformers would import torch_xla otherwise
    rows = plans()
    lines = ["| slice | model | LoRA | batch x length a chip | weights+grads+AdamW (all chips) | peak a chip "
             "| fits | a host at load: whole / sharded |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lora = "yes" if r["lora"] else "no"
        lines.append(f"| {r['slice']} ({r['chips']} chips) | {r['model'].split('/')[1]} | {lora} "
                     f"| {r['batch_size']} x {r['max_length']} | {r['weights_grads_adam_gib']:.0f} GiB "
                     f"| {r['peak_gib_per_chip']:.1f} of {r['chip_gib']:.0f} GiB | {'yes' if r['fits'] else 'no'} "
                     f"| {r['host_load_today_gib']:.0f} / {r['host_share_gib']:.1f} GiB |")
    write_plan(args.out_dir, rows, lines)


def write_plan(out_dir, rows, lines):
    """The plan's table (`lines`) printed, and written with its `rows` to OUT_DIR/plan.md and plan.json
    (the plan scripts' one output)."""
    table = "\n".join(lines)
    print(table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(rows, indent=1))
    (out / "plan.md").write_text(table + "\n")
    print(f"wrote {out / 'plan.json'} and {out / 'plan.md'}")


if __name__ == "__main__":
    main()
