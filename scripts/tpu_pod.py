"""Install xla_train and start the MRPC job on every host of a Cloud TPU pod slice.

    make dist                                                   # builds dist/xla_train-0.1.0-py3-none-any.whl
    python scripts/tpu_pod.py --tpu my-v4-32 --zone us-central2-b \\
        --package dist/xla_train-0.1.0-py3-none-any.whl --dry-run      # print the commands
    python scripts/tpu_pod.py --tpu my-v4-32 --zone us-central2-b \\
        --package dist/xla_train-0.1.0-py3-none-any.whl -- --model bert-base-uncased --data-dir hub

--package names what every host installs, with the [tpu] extra (torch_xla[tpu] and libtpu):
a wheel built here (copied to every host with `gcloud compute tpus tpu-vm scp --worker=all`,
then installed from the copy), a URL pip understands (`git+https://github.com/YOU/xla_train`,
with @branch or @tag to pin, or the https URL of a wheel), or a PyPI requirement (`xla-train`,
once the package is published there). A wheel or URL replaces the copy a host already has, even
one of the same version.

Every host runs `python3 -m xla_train train` with the same arguments; torch_xla's PJRT runtime
discovers the pod's topology, so each host starts one replica per local chip and all of them
train one model. Only the replica with global ordinal 0 prints and writes checkpoints, the model
and --metrics-out, so give an --output-dir on gs:// to keep the results: that replica may run on
any host (torch_xla numbers the chips by topology, not by host), so a local --metrics-out file
lands on that host. Every host gets the same run id (XLA_TRAIN_RUN_ID), made here, so the run
record (written by host 0) and the checkpoints (written by that replica) name the same run.
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import uuid

EXTRA = "tpu"
PACKAGE_HELP = ("what every host installs: a wheel file (make dist), a URL (git+https://github.com/YOU/xla_train, "
                "or a wheel's https URL), or a PyPI requirement such as xla-train; the [tpu] extra is added "
                "unless the value names extras")


def is_url(package):
    return bool(re.match(r"^[a-z][a-z0-9+.-]*://", package))


def split_extras(package):
    """'dist/x.whl[tpu]' -> ('dist/x.whl', '[tpu]'); the default extra when none is named."""
    m = re.fullmatch(r"(.*?)(\[[^\]]*\])", package)
    return (m.group(1), m.group(2)) if m else (package, f"[{EXTRA}]")


def requirement(package, wheel_path=None):
    """The pip requirement that installs `package` with its extras ([tpu] unless it names others).
    A local wheel is named by `wheel_path`, where the scp step put it on the host."""
    base, extras = split_extras(package)
    if is_url(base):
        return f"xla-train{extras} @ {base}"
    if base.endswith(".whl"):
        return wheel_path + extras
    if "[" in package:
        return package
    m = re.match(r"^[A-Za-z0-9._-]+", package)  # a name, maybe with a version: xla-train==0.1.0
    return package[: m.end()] + extras + package[m.end():] if m else package


def commands(tpu, zone, project, package, train_args, detach=False, run_id=None, launch_id=None):
    where = [f"--zone={zone}", "--worker=all"] + ([f"--project={project}"] if project else [])
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, *where]
    steps = []
    base, _ = split_extras(package)
    if is_url(base):
        req = requirement(package)
    elif base.endswith(".whl"):
        name = os.path.basename(base)  # pip needs the wheel's own file name
        steps.append(["gcloud", "compute", "tpus", "tpu-vm", "scp", base, f"{tpu}:{name}", *where])
        req = requirement(package, wheel_path=f"./{name}")  # ssh's commands start in the home folder
    else:  # a PyPI requirement
        req = requirement(package)
    if is_url(base) or base.endswith(".whl"):
        # pip keeps an installed copy of the same version as the wheel or URL: take it out first
        install = f"python3 -m pip uninstall --yes xla-train; python3 -m pip install {shlex.quote(req)}"
    else:
        install = f"python3 -m pip install --upgrade {shlex.quote(req)}"
    # `python3 -m` rather than the xla-train script: a user install's ~/.local/bin is not on ssh's PATH
    run_id = run_id or uuid.uuid4().hex[:12]  # one id for every host (xla_train/run/folder.py)
    # and one for this start of the job: a failing host leaves its line under it in the gs://
    # output, where the others read it (xla_train/parallel/launchers.py); a new start ignores an old one's
    launch_id = launch_id or uuid.uuid4().hex[:8]
    train = (f"PJRT_DEVICE=TPU XLA_TRAIN_RUN_ID={run_id} XLA_TRAIN_LAUNCH_ID={launch_id} python3 -m xla_train "
             "train " + " ".join(shlex.quote(a) for a in train_args))
    if detach:  # the job outlives the ssh session (a dropped connection would hang up on it)
        train = f"nohup sh -c {shlex.quote(train)} > xla_train.log 2>&1 < /dev/null & echo started: ~/xla_train.log"
    return steps + [ssh + ["--command", install], ssh + ["--command", train]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tpu", required=True, help="TPU VM name")
    p.add_argument("--zone", required=True)
    p.add_argument("--project", default=None)
    p.add_argument("--package", required=True, help=PACKAGE_HELP)
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--detach", action="store_true", help="start the job under nohup with its output in "
                   "~/xla_train.log on every host, so it survives a dropped ssh connection")
    p.add_argument("--run-id", default=None, help="the run's id on every host (default: a new one; give the "
                   "interrupted run's to --resume it)")
    p.add_argument("--launch-id", default=None, help="this start's id on every host (default: a new one)")
    p.add_argument("train_args", nargs="*", help="arguments for `xla-train train` (after --)")
    args = p.parse_args(argv)
    base, _ = split_extras(args.package)
    if not is_url(base):
        if base.endswith(".whl") and not os.path.isfile(base):
            p.error(f"--package {args.package}: no such wheel (make dist builds dist/xla_train-*.whl)")
        if not base.endswith(".whl") and os.path.exists(base):
            p.error(f"--package {args.package}: a folder or file other than a wheel; build a wheel with "
                    "`make dist`, or give git+URL of the repository")
    for cmd in commands(args.tpu, args.zone, args.project, args.package, args.train_args, args.detach,
                        args.run_id, args.launch_id):
        print(shlex.join(cmd), flush=True)
        if not args.dry_run:
            code = subprocess.call(cmd)
            if code:
                print(f"tpu_pod: command failed with exit code {code}", file=sys.stderr)
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
