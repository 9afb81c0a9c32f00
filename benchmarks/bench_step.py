"""Where an eager CPU training step of the bundled MiniLM goes: forward, backward, optimizer step,
with torch's default multi-tensor AdamW (what the course's loop and Accelerate use) beside the
fused AdamW that xla_train's CPU/CUDA fallback uses.

    python benchmarks/bench_step.py                     # batch 8 x 56 tokens, 30 timed steps each
    python benchmarks/bench_step.py --length 104

Writes OUT/step.json (OUT defaults to benchmarks/out). Both optimizers start from the same weights
and batch, alternating, so a busy machine affects both alike.
"""

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("USE_TORCH_XLA", "0")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

from xla_train.models import bundled_model_path  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--length", type=int, default=56, help="padded tokens per row (MRPC's rows average 53)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "out"))
    args = p.parse_args()

    transformers.logging.set_verbosity_error()  # not the load report of the new head, twice
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(1000, 20000, (args.batch_size, args.length)),
             "attention_mask": torch.ones(args.batch_size, args.length, dtype=torch.long),
             "labels": torch.randint(0, 2, (args.batch_size,))}
    runs = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(bundled_model_path(), num_labels=2).train()
        runs[fused] = (model, torch.optim.AdamW(model.parameters(), lr=5e-5, fused=fused or None), [])
    for i in range(args.steps + 3):  # 3 warm-up steps each
        for model, optimizer, times in runs.values():
            torch.manual_seed(i)  # the same dropout masks for both
            t0 = time.perf_counter()
            loss = model(**batch).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if i >= 3:
                times.append((t1 - t0, t2 - t1, t3 - t2))
    out = {"batch_size": args.batch_size, "length": args.length, "threads": torch.get_num_threads(),
           "params_millions": round(sum(p.numel() for p in runs[True][0].parameters()) / 1e6, 2)}
    print(f"bundled MiniLM, batch {args.batch_size} x {args.length} tokens, {out['threads']} threads, "
          f"{out['params_millions']} M parameters; mean ms over {args.steps} steps")
    print("| AdamW | forward | backward | optimizer step | whole step |\n| --- | ---: | ---: | ---: | ---: |")
    for fused, (_, _, times) in runs.items():
        f, b, o = (1e3 * sum(t[k] for t in times) / len(times) for k in range(3))
        name = "fused" if fused else "multi-tensor (default)"
        out[name] = {"forward_ms": round(f, 1), "backward_ms": round(b, 1), "optimizer_ms": round(o, 1),
                     "step_ms": round(f + b + o, 1)}
        print(f"| {name} | {f:.1f} | {b:.1f} | {o:.1f} | {f + b + o:.1f} |")
    # the same update up to rounding: the fused kernel computes AdamW's formula in one pass
    diff = max((a - b).abs().max().item() for a, b in zip(runs[False][0].parameters(), runs[True][0].parameters()))
    out["max_param_diff"] = diff
    print(f"largest parameter difference after {args.steps + 3} steps: {diff:.2e}")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / "step.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
