"""A LoRA base quantized on XLA: loaded whole then quantized (the way before: from_pretrained, then
kernels.quant_xla.quantize_base) against quantized while it loads (models.load_base on the xla
backend: transformers' from_pretrained with the package's quantization_config, kernels.quant_load),
side by side in one invocation: the seconds of the load and the growth of the process's memory over
it, for int8 and NF4 with nested scales. Then under --strategy fsdp (FSDPv2 on 4 XLA:CPU devices),
LoRA added and the model prepared: the base quantized while it loads, whole on the host, then split
over the devices (the way before) against read into its shards (job.pretrained: each host reads and
quantizes its devices' rows only, parallel.sharded_load). On XLA:CPU the devices' memory is the
process's own, so the growth there counts the shards too: the base once, against the host's whole
copy plus the shards.

    python benchmarks/bench_quant_load.py              # a 134M-parameter random Llama, 8 blocks
    python benchmarks/bench_quant_load.py --layers 4   # smaller, quicker
    python benchmarks/bench_quant_load.py --ways fsdp  # the FSDPv2 pair only

Memory, two numbers, each the growth over what the process held just before the load:
- `peak RSS`: Linux's VmHWM (set back just before the load with clear_refs 5), which counts the pages
  of the checkpoint that transformers maps (safe_open's "mmap" backend) and reads: page cache, the
  kernel's to reclaim, counted as the process's (RssFile) until the files are closed after the load;
- `peak anon`: the process's own memory (RssAnon), its largest value read every millisecond by a
  thread during the load (a peak shorter than that, one tensor's temporaries, can be missed).
The model is random (Llama's layout, grouped keys and values, tied embeddings, a vocabulary of 8,192
so that the projections are most of it), written once in bf16 by save_pretrained (as published
checkpoints are) into --folder, and loaded into fp32 as training keeps it (DecoderModel.load). Each
load runs in a process of its own, `--repeats` times, alternating; no XLA device is used (the base
is quantized on the host either way). Prints a table; writes OUT/quant_load.json (OUT defaults to
benchmarks/out/quant_load).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_load import write_model  # benchmarks/, the script's folder, is on sys.path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20

LOAD = r"""
import functools, json, sys, threading, time
import torch
import transformers.models.llama.modeling_llama  # imported before the baseline, by both ways
import xla_train.kernels.quant_load  # (imports transformers' quantizers, peft)
from xla_train.kernels.quant import Quant
from xla_train.kernels.quant_xla import QuantLinear, quantize_base
from xla_train.models import add_adapters, load_base, quantize_skeleton
from xla_train.options import TrainOptions
from xla_train.parallel import sharded_load
from xla_train.tasks.causal_lm import DecoderModel

folder, way, bits = sys.argv[1], sys.argv[2], int(sys.argv[3])
quant = Quant(8, "int8") if bits == 8 else Quant(4, "nf4", nested=True)
if way.startswith("fsdp"):  # the runtime and its 4 devices started before the baseline
    from xla_train.core.engine import Engine

    engine = Engine("xla", strategy="fsdp")
    engine.prepare(torch.nn.Linear(2, 2))


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


peak_anon, done = [0], threading.Event()


def sample():
    while not done.is_set():
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.001)


with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far set back to what is resident now
base, base_anon = status("VmRSS"), status("RssAnon")
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
load = functools.partial(DecoderModel().load, folder, 0, None)
if way == "whole":
    model = load()
    quantize_base(model, quant)
elif way in ("while", "fsdp_whole"):
    model = load_base(load, quant, "xla", "fp32", folder)
else:  # fsdp_shards: as job.pretrained builds it under FSDPv2
    model = quantize_skeleton(sharded_load.skeleton(load, folder), quant)
if way.startswith("fsdp"):
    model = engine.prepare(add_adapters(model, TrainOptions(lora=True).section("model"), "CAUSAL_LM"))
seconds = time.perf_counter() - start
done.set()
thread.join()
tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
held = sum(t.numel() * t.element_size() for t in tensors)
assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 7 * model.config.num_hidden_layers
print(json.dumps({"seconds": seconds, "peak_growth": status("VmHWM") - base,
                  "anon_peak_growth": max(peak_anon[0], status("RssAnon")) - base_anon, "held_bytes": held}))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ways", default="host,fsdp", help="host: whole then quantized, and quantized while read; "
                   "fsdp: the two ways under FSDPv2 on 4 XLA:CPU devices")
    p.add_argument("--folder", default="/tmp/xla_train_bench_quant_load", help="where the random model is written once")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "quant_load"))
    args = p.parse_args()
    folder = Path(args.folder) / f"llama-1024-{args.layers}"
    write_model(folder, args.layers, vocab_size=8192, hidden_size=1024, intermediate_size=4096,
                num_attention_heads=16)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    fsdp_env = {**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    ways = {"host": ("whole", "while"), "fsdp": ("fsdp_whole", "fsdp_shards")}
    cases = [(way, bits) for bits in (8, 4) for group in args.ways.split(",") for way in ways[group]]
    runs = {f"{way}-{bits}": [] for way, bits in cases}
    for _ in range(args.repeats):
        for way, bits in cases:
            started = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", LOAD, str(folder), way, str(bits)], cwd=ROOT,
                                  env=fsdp_env if way.startswith("fsdp") else env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            runs[f"{way}-{bits}"].append({**json.loads(proc.stdout.strip().splitlines()[-1]),
                                          "process_seconds": time.perf_counter() - started})
    from safetensors import safe_open

    files = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    params = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as tensors:
            params += sum(math.prod(tensors.get_slice(k).get_shape()) for k in tensors.keys())
    largest = 4 * 1024 * 4096  # one MLP projection in fp32, the largest tensor quantized
    print(f"{params / 1e6:.0f}M parameters ({args.layers} blocks), {files / MIB:.0f} MiB of bf16 safetensors, "
          f"{4 * params / MIB:.0f} MiB in fp32; the largest projection {largest / MIB:.0f} MiB in fp32")
    print(f"{'load':<28} {'held MiB':>9} {'seconds':>8} {'peak RSS MiB':>13} {'peak anon MiB':>14}")
    labels = {"whole": "whole, then", "while": "while read", "fsdp_whole": "fsdp: while read, split",
              "fsdp_shards": "fsdp: into its shards"}
    for name, rs in runs.items():
        way, bits = name.split("-")
        label = f"{labels[way]} {'int8' if bits == '8' else 'nf4+'}"
        print(f"{label:<28} {rs[0]['held_bytes'] / MIB:>9.0f} {max(r['seconds'] for r in rs):>8.1f} "
              f"{max(r['peak_growth'] for r in rs) / MIB:>13.0f} {max(r['anon_peak_growth'] for r in rs) / MIB:>14.0f}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_load.json").write_text(json.dumps({"layers": args.layers, "params": params, "fp32_bytes": 4 * params,
                                                     "file_bytes": files, "runs": runs}, indent=1))
    print(f"wrote {out / 'quant_load.json'}")


if __name__ == "__main__":
    main()
