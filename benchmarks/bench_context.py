"""A row's activations per device under --context-parallel, measured beside the memory plan.

Each way trains one step of a tiny Llama (tests/tiny_decoders.py, fp32) on packed rows of LENGTH
tokens on XLA:CPU devices, and reads the peak of the step's compiled program per device from XLA's
own buffer assignment (XLA_FLAGS=--xla_dump_to: the SPMD-partitioned module is one device's program;
its "peak usage" is the most bytes live at once). The ways hold the same rows per device:

    fsdp 2             2 devices, 2 rows: a device holds 1 row of LENGTH tokens
    fsdp 2 x context 2 4 devices, 2 rows: a device holds 1 row of LENGTH / 2 tokens

Beside each, memory.plan's numbers for the same step and mesh. The parameters (a few hundred KiB)
are split over 2 devices in the first way and 4 in the second; the rest is the row's.

    PJRT_DEVICE=CPU python benchmarks/bench_context.py [--length 2048] [--out benchmarks/out/context.json]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = r"""
import json, sys, torch, torch_xla
from xla_train import Mesh
from xla_train.core.engine import Engine
from xla_train.memory import plan, shape_of
from xla_train.tasks.causal_lm import DecoderModel, NextToken

folder, length, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = Engine("xla", strategy="fsdp", mesh=Mesh(context=context))
ids = torch.randint(3, 100, (2, length), generator=torch.Generator().manual_seed(0))
half = length // 2
positions = torch.cat([torch.arange(half), torch.arange(length - half)]).expand(2, -1)
segments = torch.cat([torch.ones(half, dtype=torch.long), torch.full((length - half,), 2)]).expand(2, -1)
labels = torch.roll(ids, -1, 1)
labels[:, [half - 1, -1]] = -100
rows = [{"input_ids": ids[r], "position_ids": positions[r], "segments": segments[r], "labels": labels[r]}
        for r in range(2)]
model = DecoderModel().load(folder, 7, 0)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
objective = NextToken()
step = objective.memory_inputs(model, "xla", length)
model, optimizer, loader = engine.prepare(model, optimizer, torch.utils.data.DataLoader(rows, batch_size=2))
for batch in loader:
    labels = batch.pop("labels")
    objective.loss(objective.forward(model, batch), labels).backward()
    optimizer.step()
    torch_xla.sync()
import dataclasses
step = dataclasses.replace(step, rows=1, length=length)
planned = plan(engine.strategy.layout(), step, shape_of(engine.unwrap_model(model)))
print(json.dumps({"plan": planned.metrics()}))
"""


def peak(dump: Path) -> int:
    """The largest peak of the programs XLA compiled (the training step's), in bytes a device."""
    found = [int(m.group(1).replace(" ", "")) for f in dump.glob("*cpu_after_optimizations-buffer-assignment.txt")
             for m in re.finditer(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", f.read_text())]
    return max(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "context.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_decoders as td

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = td.save("llama", Path(tmp) / "llama")
        for name, devices, context in (("fsdp 2", 2, 1), ("fsdp 2 x context 2", 4, 2)):
            dump = Path(tmp) / f"dump-{context}"
            env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices),
                   "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()}
            proc = subprocess.run([sys.executable, "-c", STEP, str(folder), str(args.length), str(context)], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=1200)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            planned = json.loads(proc.stdout.strip().splitlines()[-1])["plan"]
            results[name] = {"devices": devices, "tokens_a_device": args.length // context,
                             "measured_peak_bytes": peak(dump), "plan": planned}
            print(f"{name}: {args.length // context} tokens a device; "
                  f"XLA's peak {peak(dump) / 2**20:.1f} MiB a device; "
                  f"plan: activations {planned['activation_bytes_estimate'] / 2**20:.1f} MiB, "
                  f"total {planned['peak_bytes_estimate'] / 2**20:.1f} MiB")
    one, two = results["fsdp 2"], results["fsdp 2 x context 2"]
    ratio = {"measured": two["measured_peak_bytes"] / one["measured_peak_bytes"],
             "plan_activations": two["plan"]["activation_bytes_estimate"] / one["plan"]["activation_bytes_estimate"]}
    print(f"context 2 / fsdp alone: measured peak {ratio['measured']:.2f}, planned activations "
          f"{ratio['plan_activations']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"length": args.length, "ways": results, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
