"""The memory plan (xla_train/memory.py) for model sizes TPU users bring: which fit one 16 GiB v5e
chip when every device holds the whole model (ddp, spmd), and when `--strategy fsdp` shards the
weights, gradients and AdamW state over the devices (`--devices`, 8 by default: a v5e-8 host).

    python benchmarks/bench_memory.py                   # batch 8 per device, 128 tokens, 8 devices
    python benchmarks/bench_memory.py --batch-size 1 --length 512
    python benchmarks/bench_memory.py --measure          # and the plan against the peak measured on the CPU

--measure trains a scaled Llama (4 blocks, 256 wide, GQA, the bundled vocabulary's 30,522 words,
tied) one fp32 step on the CPU as the causal-LM task runs it (sdpa and a packed row's boolean 4-D
mask; the head whole or in chunks; blocks kept or checkpointed) and prints the plan's peak beside
the one torch's profiler measures (the parameters and AdamW's state, exact, added). Every run also
prints what the plan says of Llama 3.2 1B at --max-length 8192 on a 16 GiB chip.

Models are built on torch's meta device from their configs (no weights, no hub): the bundled
MiniLM-L6-H384, bert-base-uncased, bert-large-uncased, a 1B Llama (Llama 3.2 1B's shape) and a 7B
Llama (Llama 2 7B's shape), each with a 2-label classification head. Prints a table and writes
OUT/memory.json and OUT/memory.md (OUT defaults to benchmarks/out/memory).
"""

import argparse
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V5E = 16 * 2**30


def configs():
    from transformers import AutoConfig, BertConfig, LlamaConfig

    from xla_train.models import bundled_model_path

    bert = dict(vocab_size=30522, max_position_embeddings=512, num_labels=2)
    return {
        "MiniLM-L6-H384 (bundled)": AutoConfig.from_pretrained(bundled_model_path(), num_labels=2),
        "bert-base": BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                intermediate_size=3072, **bert),
        "bert-large": BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                 intermediate_size=4096, **bert),
        "Llama 1B": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                                num_labels=2, pad_token_id=0),
        "Llama 7B": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, num_labels=2, pad_token_id=0),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8, help="rows per device")
    p.add_argument("--length", type=int, default=128, help="tokens per row")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "memory"))
    p.add_argument("--measure", action="store_true", help="also measure the peak of a scaled Llama on the CPU")
    args = p.parse_args()
    os.environ.setdefault("USE_TORCH_XLA", "0")  # transformers would import torch_xla otherwise
    import torch
    from transformers import AutoModelForSequenceClassification

    from xla_train.memory import GIB, plan, shape_of
    from xla_train.parallel.mesh import Mesh
    from xla_train.tasks.base import PassInputs

    rows = []
    for name, config in configs().items():
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config)
        shape = shape_of(model)
        # bf16 autocast: 16-bit activations, fp32 weights and state; checkpointed: --gradient-checkpointing
        cases = [("ddp / spmd", False, "fp32", False), ("ddp / spmd", False, "bf16", False),
                 ("ddp / spmd", False, "bf16", True), ("fsdp", True, "bf16", False), ("fsdp", True, "bf16", True)]
        for strategy, sharded, precision, checkpointed in cases:
            step = PassInputs("sdpa", rows=args.batch_size, length=args.length, precision=precision,
                              checkpointed=checkpointed)
            memory = plan(Mesh().resolve(args.devices, sharded), step, shape)
            rows.append({"model": name, "strategy": strategy, "precision": precision,
                         "devices": args.devices, **memory.counts(), **memory.metrics(), "needed_bytes": memory.total,
                         "fits_v5e_16GiB": memory.total <= V5E})
    header = ("| model | strategy | precision | checkpointed | parameters | params GiB/device | grads | AdamW "
              "| activations (est.) | total GiB/device | fits a 16 GiB v5e |\n"
              "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    lines = [header] + [
        f"| {r['model']} | {r['strategy']} | {r['precision']} | {'yes' if r['gradient_checkpointing'] else 'no'} | "
        f"{r['total_params'] / 1e6:,.0f} M | "
        f"{r['param_bytes_per_device'] / GIB:.2f} | {r['grad_bytes_per_device'] / GIB:.2f} | "
        f"{r['optimizer_bytes_per_device'] / GIB:.2f} | {r['activation_bytes_estimate'] / GIB:.2f} | "
        f"{r['needed_bytes'] / GIB:.2f} | {'yes' if r['fits_v5e_16GiB'] else 'no'} |" for r in rows]
    table = "\n".join(lines)
    print(f"batch {args.batch_size} x {args.length} tokens per device, {args.devices} devices\n{table}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    long_context = one_b_at_8192()
    print("\n".join(line for _, line in long_context))
    measured = measure() if args.measure else None
    (out / "memory.json").write_text(json.dumps({"args": vars(args), "rows": rows, "measured": measured,
                                                 "llama_1b_8192": [c for c, _ in long_context]}, indent=1) + "\n")
    (out / "memory.md").write_text(table + "\n")


LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, pad_token_id=0)


def one_b_at_8192():
    """What the plan says of Llama 3.2 1B (bf16, one row of 8,192 tokens a device, sdpa with the
    packed path's mask) on a 16 GiB chip, as asked and with each remedy."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from xla_train.memory import GIB, plan, shape_of
    from xla_train.parallel.mesh import Mesh
    from xla_train.tasks.base import PassInputs

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B))
    cases = [("as asked", 1, False, False, False), ("--gradient-checkpointing", 1, True, False, False),
             ("--gradient-checkpointing, chunked logits", 1, True, True, False),
             ("--strategy fsdp on 8 chips, --gradient-checkpointing", 8, True, False, False),
             ("--strategy fsdp on 8 chips, --gradient-checkpointing, chunked logits", 8, True, True, False),
             ("--lora, --gradient-checkpointing, chunked logits", 1, True, True, True)]
    out = []
    for name, shards, checkpointed, chunked, lora in cases:
        for p in model.parameters():
            p.requires_grad_(not lora)
        step = PassInputs("sdpa", logits="chunked" if chunked else "whole", rows=1, length=8192, precision="bf16",
                          checkpointed=checkpointed)
        peak = plan(Mesh(fsdp=shards), step, shape_of(model), V5E).total
        out.append(({"case": name, "peak_bytes_estimate": peak, "fits_16GiB": peak <= V5E},
                    f"Llama 3.2 1B, bf16, 1 x 8,192 tokens, {name}: {peak / GIB:.1f} GiB, "
                    f"{'fits' if peak <= V5E else 'does not fit'} a 16 GiB chip"))
    return out


def measure():
    """The plan's peak against the measured one for the scaled Llama (see the module's doc)."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_decoders import scaled_llama_step

    from xla_train.memory import MIB, measure_peak

    rows, length, chunk, results = 2, 512, 256, []
    for checkpointed in (False, True):
        for chunked in (False, True):
            _, memory, step = scaled_llama_step(checkpointed, chunked, rows, length, chunk)
            step()
            got = memory.weights + memory.optimizer + measure_peak(step)
            row = {"checkpointed": checkpointed, "chunked_logits": chunked, "rows": rows, "length": length,
                   "plan_bytes": memory.total, "measured_bytes": got, "ratio": memory.total / got}
            results.append(row)
            print(f"scaled Llama, fp32, {rows} x {length} tokens, blocks {'checkpointed' if checkpointed else 'kept'}, "
                  f"logits {'chunked' if chunked else 'whole'}: plan {row['plan_bytes'] / MIB:.1f} MiB, measured "
                  f"{got / MIB:.1f} MiB (plan / measured {row['ratio']:.3f})", flush=True)
    return results


if __name__ == "__main__":
    main()
