"""Long rows on paper: the memory plan (xla_train/memory.py, `plan_on_paper`, the trainer's own code)
of Llama 3.1 8B fine-tuned on packed rows of 32,768 and 131,072 tokens on one TPU host each of a
v5p-8, a v6e-8 and a v5e-8, and the smallest `--context-parallel` that fits a chip: the mesh
(fsdp x context over the host's chips), what a chip holds and the command that runs it
(recipes/long-context-sft.yaml). bf16 autocast, every block recomputed in the backward pass
(--gradient-checkpointing), one row a context group (--batch-size 1), the Pallas kernel's
attention and the chunked head; a full fine-tune, and with --lora where the full one does not fit.
The model is built on torch's meta device from its published config
(benchmarks/published_configs.json: hidden 4096, 32 layers, 32 heads, 8 key/value heads, MLP
14336, vocabulary 128256), no weights, no hub, no TPU.

    python benchmarks/plan_long_context.py

Prints a table and writes OUT/plan.json and OUT/plan.md (OUT: benchmarks/out/plan_long_context).
Devices are counted as torch_xla counts them (a v5p chip is one device: a v5p-8 host has 4).
"""

import argparse
import dataclasses
import json
import os
from pathlib import Path

from plan_pods import write_plan

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
RECIPE = "long-context-sft.yaml"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SHAPE = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=14336, vocab_size=128256)
# slice, devices (torch_xla's), device kind (xla_train.core.xla.TPU_HBM)
SLICES = [("v5p-8", 4, "TPU v5p"), ("v6e-8", 8, "TPU v6 lite"), ("v5e-8", 8, "TPU v5 lite")]
LENGTHS = (32768, 131072)


def command(length, context, lora):
    """The command line that runs the case: the recipe, its length and context axis as flags."""
    return (f"xla-train train --config recipes/{RECIPE} --max-length {length} --context-parallel {context}"
            + (" --lora" if lora else ""))


def plans():
    from transformers import AutoConfig

    from xla_train.core.xla import TPU_HBM
    from xla_train.memory import plan_on_paper
    from xla_train.options import TrainOptions, read_recipe

    published = json.loads((ROOT / "benchmarks" / "published_configs.json").read_text())[MODEL]
    assert {k: published[k] for k in SHAPE} == SHAPE, "Llama 3.1 8B's shape"
    config = AutoConfig.for_model(**published)
    recipe = TrainOptions(**read_recipe(str(ROOT / "recipes" / RECIPE)))
    rows = []
    for slice_name, devices, kind in SLICES:
        chip = TPU_HBM[kind]
        for length in LENGTHS:
            for lora in (False, True):
                tried = []
                for context in (n for n in (1, 2, 4, 8) if devices % n == 0):
                    cfg = dataclasses.replace(recipe, max_length=length, context_parallel=context, lora=lora)
                    memory = plan_on_paper(cfg, config, devices, chip)
                    tried.append({"context": context, "peak_gib": round(memory.total / GIB, 2)})
                    if memory.total <= chip:
                        break
                fits = memory.total <= chip
                mesh = memory.mesh
                rows.append({
                    "slice": slice_name, "devices": devices, "chip_gib": chip / GIB, "length": length, "lora": lora,
                    "fits": fits, "fsdp": mesh.fsdp, "context": mesh.context, "tried": tried,
                    "tokens_per_chip": -(-length // mesh.context),
                    "state_gib": (memory.weights + memory.gradients + memory.optimizer) / GIB,
                    "activations_gib": (memory.activations or 0) / GIB,
                    "block_gib": ((memory.layer or 0) + memory.gathered) / GIB,
                    "logits_gib": (memory.logits or 0) / GIB, "autocast_gib": memory.autocast_copies / GIB,
                    "peak_gib": memory.total / GIB, "attention": memory.step.attention,
                    "command": command(length, mesh.context, lora) if fits else None,
                    "memory": memory.metrics(),
                })
                if fits and not lora:
                    break  # the full fine-tune fits: LoRA is not needed to make it
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "plan_long_context"))
    args = p.parse_args()
    os.environ.setdefault("USE_TORCH_XLA", "0")  # transformers would import torch_xla otherwise
    rows = plans()
    lines = ["| slice (chips x HBM) | row | LoRA | mesh | tokens a chip | weights+grads+AdamW | block inputs "
             "| one block + gathered K/V | head | peak a chip | command |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        mesh = f"fsdp {r['fsdp']} x context {r['context']}"
        lines.append(f"| {r['slice']} ({r['devices']} x {r['chip_gib']:.0f} GiB) | {r['length'] // 1024}k "
                     f"| {'yes' if r['lora'] else 'no'} | {mesh if r['fits'] else 'none fits'} "
                     f"| {r['tokens_per_chip']:,} | {r['state_gib']:.1f} GiB | {r['activations_gib']:.1f} GiB "
                     f"| {r['block_gib']:.1f} GiB | {r['logits_gib']:.1f} GiB "
                     f"| {r['peak_gib']:.1f} of {r['chip_gib']:.0f} GiB | "
                     + (f"`{r['command']}` |" if r["command"] else
                        "smallest peak: " + ", ".join(f"context {t['context']}: {t['peak_gib']:.1f}"
                                                      for t in r["tried"]) + " GiB |"))
    write_plan(args.out_dir, rows, lines)


if __name__ == "__main__":
    main()
