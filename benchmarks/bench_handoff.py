"""Memory of forked replicas: the job handed to them through a module-level reference (what
`launchers.spawn_arguments` does with fork) against the job pickled into each of them (what
xmp.spawn does with its arguments: torch_xla/_internal/pjrt.py, run_multiprocess, an
executor.map over a partial of the function and its arguments; torch's pickler moves every
tensor into shared memory).

The parent prepares the real job (the bundled MRPC train and dev sets tokenised, the bundled
model with its new head) as `xla-train train` does, then starts N replicas in a fork-context
ProcessPoolExecutor, the pool xmp.spawn uses, through xla_train.parallel.launchers' own replica entry. Each
replica does what a training replica does with its inputs before the device gets them: takes its
private model copy and writes every parameter once (an optimizer step), and collates its first
500 training batches. With all replicas alive, each reads its memory from /proc (USS: pages only
it holds; PSS: its share of every page), one of them the parent's too, and /dev/shm's use. XLA:CPU
runs one replica per process here, so the replicas run on the CPU backend; what is measured is
host memory, which is where the job's data and model live before they reach a device.

    python benchmarks/bench_handoff.py                  # 2 and 4 replicas, both hand-offs
    python benchmarks/bench_handoff.py --replicas 8
    python benchmarks/bench_handoff.py --train-copies 100 --out-dir benchmarks/out/handoff-mnli-size

Prints and writes OUT/handoff.md and OUT/handoff.json (OUT defaults to benchmarks/out/handoff).
"""

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MIB = 1 << 20
BATCHES = 500  # collated by each replica (its first 4000 rows)


def memory(pid="self"):
    """kB fields of /proc/PID/smaps_rollup, in MiB: rss, pss and uss (private pages)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":")
        fields[name] = int(value.split()[0]) * 1024 / MIB
    return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"]}


def shm_used():
    return shutil.disk_usage("/dev/shm").used / MIB


def wait_for(folder, prefix, n):
    while len([f for f in os.listdir(folder) if f.startswith(prefix)]) < n:
        time.sleep(0.05)


def replica(job, started, folder, n):
    """Stands for train_worker up to the first step: what a replica does with the handed job."""
    import torch

    from xla_train.commands.train import _private_copy
    from xla_train.core.batching import make_loader

    arrived = time.time() - started
    model = _private_copy(job.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.0)  # an update writes every page of the weights
    train_dl = make_loader(job.data["train"], job.tokenizer, job.cfg.batch_size, job.shapes.padding, shuffle=True,
                           seed=job.cfg.seed, fill="repeat")
    rows = sum(len(batch["input_ids"]) for batch, _ in zip(train_dl, range(BATCHES)))
    Path(folder, f"ready-{os.getpid()}").touch()
    wait_for(folder, "ready-", n)  # every replica alive and done: shares divide among all of them
    result = {"arrived_s": arrived, "rows": rows, **memory()}
    try:
        os.close(os.open(Path(folder, "parent"), os.O_CREAT | os.O_EXCL))  # the first one here
    except FileExistsError:
        pass
    else:
        result["parent"] = memory(os.getppid())
        result["shm"] = shm_used()
    Path(folder, f"result-{os.getpid()}.json").write_text(json.dumps(result))
    wait_for(folder, "result-", n)


def call(index, entry, entry_args):
    """What xmp.spawn's _SpawnFn does in each replica: entry(global ordinal, *args)."""
    entry(index, *entry_args)


def run_case(job, n, handoff, shm_before):
    import concurrent.futures

    import torch.multiprocessing

    from xla_train.core.select import select_roles
    from xla_train.parallel import launchers

    folder = tempfile.mkdtemp()
    args = (job, time.time(), folder, n)
    entry, entry_args = launchers.spawn_arguments(select_roles("cpu"), replica, args, "fork" if handoff else "spawn")
    start = time.time()
    with launchers.replica_failures():
        with concurrent.futures.ProcessPoolExecutor(n, mp_context=torch.multiprocessing.get_context("fork")) as pool:
            list(pool.map(functools.partial(call, entry=entry, entry_args=entry_args), range(n)))
    launchers._HANDED_OFF.clear()
    results = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("result-*.json"))]
    first = next(r for r in results if "parent" in r)
    shutil.rmtree(folder)
    return {
        "handoff": "module reference (fork)" if handoff else "pickled arguments",
        "replicas": n,
        "seconds": round(time.time() - start, 2),
        "slowest_arrival_s": round(max(r["arrived_s"] for r in results), 2),
        "replica_uss_mib": round(sum(r["uss"] for r in results) / n, 1),
        "replica_pss_mib": round(sum(r["pss"] for r in results) / n, 1),
        "parent_pss_mib": round(first["parent"]["pss"], 1),
        "dev_shm_used_mib": round(first["shm"] - shm_before, 1),
        "total_pss_mib": round(sum(r["pss"] for r in results) + first["parent"]["pss"], 1),
        "rows_per_replica": results[0]["rows"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="2,4", help="replica counts, comma-separated")
    p.add_argument("--train-copies", type=int, default=1,
                   help="the training set this many times over (100: 366,800 rows, about MNLI's 392,702)")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "handoff"))
    a = p.parse_args()
    os.environ.setdefault("USE_TORCH_XLA", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from xla_train.core.select import select_roles
    from xla_train.job import prepare
    from xla_train.options import TrainOptions

    cfg = TrainOptions(backend="cpu", buckets="32,64,96,128")
    job = prepare(cfg, select_roles("cpu"))
    data, model = job.data, job.model
    if a.train_copies > 1:
        import datasets

        data["train"] = datasets.concatenate_datasets([data["train"]] * a.train_copies)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / MIB
    print(f"job: {len(data['train'])} training rows tokenised, model weights {weights:.1f} MiB, "
          f"parent {memory()['pss']:.0f} MiB PSS; /dev/shm {shutil.disk_usage('/dev/shm').total / MIB:.0f} MiB")
    shm_before = shm_used()  # the job's use of /dev/shm is measured from here
    rows = []
    for handoff in (True, False):  # the pickled cases last: they move the parent's model into /dev/shm
        for n in (int(x) for x in a.replicas.split(",")):
            rows.append(run_case(job, n, handoff, shm_before))
            print(json.dumps(rows[-1]), flush=True)
    keys = list(rows[0])
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "handoff.json").write_text(json.dumps({"weights_mib": round(weights, 1), "train_rows": len(data["train"]),
                                                  "cases": rows}, indent=2) + "\n")
    (out / "handoff.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
