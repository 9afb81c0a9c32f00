"""LoRA over a quantized base on paper: the memory plan (xla_train/memory.py, `plan_on_paper`, the
trainer's own code) of each command below, and of the same command without its quantization (the
frozen base in bf16, as `--lora --precision bf16` keeps it), so that the table shows what the
8- or 4-bit base makes fit:
- Llama 3.1 8B over int8 on a Colab v5e-1 (one chip of 16 GiB; notebooks/colab_tpu_llama8b_int8.ipynb);
- Llama 3.1 8B over NF4 with double quantization on a 24 GB GPU (24e9 bytes: the plan of the step
  as it runs on CUDA, sdpa attention);
- Llama 3.1 70B over 4 and 8 bits on a v5e-8 (8 x 16 GiB) and a v6e-8 (8 x 32 GiB), --strategy fsdp.
bf16 autocast, every block recomputed in the backward pass, the chunked head; a quantized base's
projections and their scales at kernels.quant.projection_bytes. The models are built on torch's
meta device from their published configs (benchmarks/published_configs.json), no weights, no hub,
no TPU. tests/test_quant_plan.py checks every row.

    python benchmarks/plan_quant.py

Prints a table and writes OUT/plan.json and OUT/plan.md (OUT: benchmarks/out/plan_quant).
"""

import argparse
import dataclasses
import json
import os
import shlex
from pathlib import Path

from plan_pods import write_plan

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
L8, L70 = "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct"
GPU_24GB = 24 * 10**9  # a "24 GB" card (RTX 4090 24,564 MiB, A10 and L4 about 23,000 MiB): the smallest
RUN = ("xla-train train --problem causal-lm --train-file HuggingFaceH4/no_robots --lora --precision bf16 "
       "--gradient-checkpointing")
# name, where, devices, device kind (xla_train.core.xla.TPU_HBM; None: GPU_24GB), the step's device
# (kernels.attention.kind_of's names), the command
CASES = [
    ("8B int8", "Colab v5e-1", 1, "TPU v5 lite", "xla-tpu",
     f"{RUN} --model {L8} --load-in-8bit --batch-size 4 --max-length 2048 --output-dir llama8b-int8"),
    ("8B nf4 double-quantized", "24 GB GPU", 1, None, "cuda",
     f"{RUN} --model {L8} --load-in-4bit --use-bnb-nested-quant --batch-size 4 --max-length 2048 "
     "--output-dir llama8b-qlora"),
    ("70B 4-bit", "v5e-8", 8, "TPU v5 lite", "xla-tpu",
     f"{RUN} --model {L70} --load-in-4bit --strategy fsdp --batch-size 1 --max-length 2048 "
     "--output-dir gs://BUCKET/llama70b-4bit"),
    ("70B int8", "v5e-8", 8, "TPU v5 lite", "xla-tpu",
     f"{RUN} --model {L70} --load-in-8bit --strategy fsdp --batch-size 1 --max-length 1024 "
     "--output-dir gs://BUCKET/llama70b-int8"),
    ("70B 4-bit", "v6e-8", 8, "TPU v6 lite", "xla-tpu",
     f"{RUN} --model {L70} --load-in-4bit --strategy fsdp --batch-size 4 --max-length 2048 "
     "--output-dir gs://BUCKET/llama70b-4bit"),
    ("70B int8", "v6e-8", 8, "TPU v6 lite", "xla-tpu",
     f"{RUN} --model {L70} --load-in-8bit --strategy fsdp --batch-size 4 --max-length 2048 "
     "--output-dir gs://BUCKET/llama70b-int8"),
]


def options(command):
    """The TrainOptions an `xla-train train ...` command line makes (the CLI's own parser)."""
    from xla_train.commands.cli import build_parser, train_options

    return train_options(build_parser().parse_args(shlex.split(command)[1:]))


def unquantized(cfg):
    """The same run with its base in bf16 (--lora --precision bf16): no --load-in-8bit/4bit."""
    return dataclasses.replace(cfg, load_in_8bit=False, load_in_4bit=False, use_bnb_nested_quant=False)


def published_config(model):
    from transformers import AutoConfig

    published = json.loads((ROOT / "benchmarks" / "published_configs.json").read_text())[model]
    return AutoConfig.for_model(**{k: v for k, v in published.items() if not k.endswith("token_id")})


def device_bytes(kind):
    from xla_train.core.xla import TPU_HBM

    return TPU_HBM[kind] if kind else GPU_24GB


def plan_case(case, quantized=True):
    """memory.Plan of a CASES row's command (`quantized=False`: of the same run over a bf16 base)."""
    from xla_train.memory import plan_on_paper

    _, _, devices, kind, step_device, command = case
    cfg = options(command)
    return plan_on_paper(cfg if quantized else unquantized(cfg), published_config(cfg.model), devices,
                         device_bytes(kind), step_device)


def row(case):
    from xla_train.memory import quant_label

    name, where, devices, kind, _, command = case
    memory, plain = plan_case(case), plan_case(case, quantized=False)
    hbm = device_bytes(kind)
    bf16_base = plain.weights_total - (memory.weights_total - memory.quantized)  # the same projections in bf16
    return {"case": name, "where": where, "devices": devices, "device_gib": hbm / GIB,
            "quantization": quant_label(memory.quant), "base_bytes": memory.quantized, "bf16_base_bytes": bf16_base,
            "base_ratio": memory.quantized / bf16_base,
            "weights_gib": memory.weights / GIB, "dequantized_mib": memory.dequantized / 2**20,
            "peak_gib": memory.total / GIB, "fits": memory.total <= hbm, "headroom_gib": (hbm - memory.total) / GIB,
            "bf16_peak_gib": plain.total / GIB, "bf16_fits": plain.total <= hbm, "command": command,
            "memory": memory.metrics(), "bf16_memory": plain.metrics()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "plan_quant"))
    args = p.parse_args()
    os.environ.setdefault("USE_TORCH_XLA", "0")  # transformers would import torch_xla otherwise
    rows = [row(case) for case in CASES]
    lines = ["| model, base | where (devices x memory) | base with scales (x bf16's) | parameters a device "
             "| peak a device | fits (headroom) | over a bf16 base | command |",
             "| --- | --- | ---: | ---: | ---: | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['where']} ({r['devices']} x {r['device_gib']:.1f} GiB) "
                     f"| {r['base_bytes'] / GIB:.2f} GiB ({r['base_ratio']:.3f}x) | {r['weights_gib']:.2f} GiB "
                     f"| {r['peak_gib']:.2f} GiB | {'yes' if r['fits'] else 'no'} ({r['headroom_gib']:.2f} GiB) "
                     f"| {r['bf16_peak_gib']:.2f} GiB: {'fits' if r['bf16_fits'] else 'does not fit'} "
                     f"| `{r['command']}` |")
    write_plan(args.out_dir, rows, lines)


if __name__ == "__main__":
    main()
