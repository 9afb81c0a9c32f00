"""Where the CPU default job's start-up goes: imports, data (reading, tokenising), model loading
and device set-up, as goodput's `startup` splits it in the metrics JSON.

    python benchmarks/bench_startup.py                            # this checkout, 5 runs
    python benchmarks/bench_startup.py --code /tmp/before --code . # two checkouts, runs alternating

Each run is `python -m xla_train train --backend cpu --max-steps 1` (the default job: the bundled
MiniLM on the bundled MRPC, every option at its default) in a fresh process; start-up ends at the
first training step, so the one step and the evaluation after it do not count. With several
checkouts (`--code`, each a folder holding xla_train/, run with PYTHONPATH set to it) the runs
alternate, so a busy machine slows each alike; the medians are compared.

Writes OUT/startup.json (OUT defaults to benchmarks/out).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("imports", "data", "model", "device")


def run_once(code, metrics):
    env = {**os.environ, "PYTHONPATH": str(code), "USE_TORCH_XLA": "0", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "xla_train", "train", "--backend", "cpu", "--max-steps", "1",
                           "--metrics-out", str(metrics)], cwd=code, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{code}: exit code {proc.returncode}\n{proc.stderr[-2000:]}")
    goodput = json.loads(metrics.read_text())["goodput"]
    return {"startup": goodput["seconds"]["startup"], **(goodput.get("startup") or {}),
            "process_seconds": round(time.perf_counter() - t0, 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", action="append", help="a checkout to run (repeatable; default: this one)")
    p.add_argument("--runs", type=int, default=5, help="runs of each checkout")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out"))
    args = p.parse_args()
    codes = [Path(c).resolve() for c in (args.code or [ROOT])]
    runs = {str(c): [] for c in codes}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for c in codes:
                r = run_once(c, Path(tmp) / f"m{i}.json")
                runs[str(c)].append(r)
                print(f"{c} run {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    medians = {c: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for c, rs in runs.items()}
    print(f"\nmedians of {args.runs} runs (seconds; start-up = imports + data + model + device):")
    print("| checkout | start-up | " + " | ".join(PARTS) + " | whole process |")
    print("| --- | ---: | " + " | ".join("---:" for _ in PARTS) + " | ---: |")
    for c, m in medians.items():
        print(f"| {c} | {m['startup']:.2f} | " + " | ".join(f"{m.get(k, float('nan')):.2f}" for k in PARTS)
              + f" | {m['process_seconds']:.2f} |")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps({"command": sys.argv, "cpu_count": os.cpu_count(),
                                                  "load_average": os.getloadavg(), "runs": runs,
                                                  "medians": medians}, indent=2) + "\n")


if __name__ == "__main__":
    main()
