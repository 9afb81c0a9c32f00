"""Install xla_train and start the MRPC job on every host of a Cloud TPU pod slice.

    python scripts/tpu_pod.py --tpu my-v4-32 --zone us-central2-b --dry-run      # print the commands
    python scripts/tpu_pod.py --tpu my-v4-32 --zone us-central2-b -- --model bert-base-uncased --data-dir hub

Every host runs `xla-train train` with the same arguments; torch_xla's PJRT runtime discovers
the pod's topology, so each host starts one replica per local chip and all of them train one
model. Only the replica with global ordinal 0 prints and writes files, so give an --output-dir
on gs:// to keep the results.
"""

import argparse
import shlex
import subprocess
import sys


def commands(tpu, zone, project, package, train_args):
    base = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}", "--worker=all"]
    if project:
        base.append(f"--project={project}")
    install = f"pip install --upgrade {shlex.quote(package)}"
    train = "PJRT_DEVICE=TPU xla-train train " + " ".join(shlex.quote(a) for a in train_args)
    return [base + ["--command", install], base + ["--command", train]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tpu", required=True, help="TPU VM name")
    p.add_argument("--zone", required=True)
    p.add_argument("--project", default=None)
    p.add_argument("--package", default="xla-train[tpu]", help="what pip installs on every host")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("train_args", nargs="*", help="arguments for `xla-train train` (after --)")
    args = p.parse_args(argv)
    for cmd in commands(args.tpu, args.zone, args.project, args.package, args.train_args):
        print(shlex.join(cmd), flush=True)
        if not args.dry_run:
            code = subprocess.call(cmd)
            if code:
                print(f"tpu_pod: command failed with exit code {code}", file=sys.stderr)
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
