"""Loading a model under `--backend xla --strategy fsdp`: whole on the host then FSDPv2's wrap,
against straight into the devices' shards (xla_train/parallel/sharded_load.py), side by side in one
invocation: the seconds from nothing to a sharded model, and the growth of the process's peak
resident memory over the load (Linux's VmHWM, set back just before it with clear_refs 5, so the
runtime's start-up peak does not hide it). On XLA:CPU the devices' memory is the host's, so the
sharded load's peak is its shards (the model once) plus the piece being read; the whole load's
is the model on the host plus its copies on the devices.

    python benchmarks/bench_load.py                        # a 1B Llama (Llama 3.2 1B's shape), 4 devices
    python benchmarks/bench_load.py --layers 4 --repeats 1  # a smaller one, quicker
    python benchmarks/bench_load.py --tensor-parallel 2     # the 2-D mesh's slices (fsdp 2 x tensor 2)

The model is random, written once in bf16 by save_pretrained (as published checkpoints are) into
--folder, and loaded into fp32 as training keeps it. Each load runs in a process of its own,
`--repeats` times, alternating. Prints a table; writes OUT/load.json (OUT defaults to
benchmarks/out/load).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOAD = r"""
import functools, json, sys, time
import torch
from xla_train.parallel import sharded_load
from xla_train.core.engine import Engine
from xla_train.tasks.causal_lm import DecoderModel

folder, way, tensor = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = Engine("xla", strategy="fsdp", tensor_parallel=tensor)
(torch.ones(4, device=engine.device) + 1).cpu()  # the runtime started


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far set back to what is resident now
base = status("VmRSS")
start = time.perf_counter()
load = functools.partial(DecoderModel().load, folder, 0, None)
model = sharded_load.skeleton(load, folder) if way == "sharded" else load()
model = engine.prepare(model)
engine.accelerator.synchronize()
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_growth": status("VmHWM") - base,
                  "params": sum(p.numel() for p in engine.unwrap_model(model).parameters())}))
"""


def write_model(folder, layers, **shape):
    """A random Llama in bf16, written once into `folder`: Llama 3.2 1B's shape (benchmarks/
    bench_memory.py's "Llama 1B"), `layers` blocks of its 16, `shape` overriding its sizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return
    torch.manual_seed(0)
    config = LlamaConfig(**{"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                            "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
                            **shape, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()  # to_empty made the head a tensor of its own
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(folder)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="blocks of Llama 3.2 1B's 16")
    p.add_argument("--devices", type=int, default=4, help="XLA:CPU devices (CPU_NUM_DEVICES)")
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--folder", default="/tmp/xla_train_bench_load", help="where the random model is written once")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "load"))
    args = p.parse_args()
    folder = Path(args.folder) / f"llama-1b-shape-{args.layers}"
    write_model(folder, args.layers)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(args.devices), "TOKENIZERS_PARALLELISM": "false"}
    runs = {"whole": [], "sharded": []}
    for _ in range(args.repeats):
        for way in runs:
            started = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", LOAD, str(folder), way, str(args.tensor_parallel)], cwd=ROOT,
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            runs[way].append({**json.loads(proc.stdout.strip().splitlines()[-1]),
                              "process_seconds": time.perf_counter() - started})
    files = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    params = runs["whole"][0]["params"]
    print(f"{params / 1e9:.2f}B parameters ({args.layers} blocks), {files / 2**30:.2f} GiB of bf16 safetensors, "
          f"{4 * params / 2**30:.2f} GiB in fp32; {args.devices} XLA:CPU devices, tensor parallel "
          f"{args.tensor_parallel}")
    print(f"{'load':<8} {'seconds (min / max)':>22} {'peak RSS growth GiB (min / max)':>34}")
    for way, rs in runs.items():
        s, g = [r["seconds"] for r in rs], [r["peak_growth"] / 2**30 for r in rs]
        print(f"{way:<8} {min(s):>10.1f} / {max(s):<10.1f} {min(g):>16.2f} / {max(g):<16.2f}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps({"layers": args.layers, "devices": args.devices,
                                               "tensor_parallel": args.tensor_parallel, "params": params,
                                               "fp32_bytes": 4 * params, "file_bytes": files, "runs": runs}, indent=1))
    print(f"wrote {out / 'load.json'}")


if __name__ == "__main__":
    main()
