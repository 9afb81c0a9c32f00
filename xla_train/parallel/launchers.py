"""Starting the workers of a job and ending them all when one fails: the one place for both.

The XLA launchers are here: `XmpLauncher` (XLA replicas through `xmp.spawn`) and `HostLauncher`
(SPMD and FSDPv2: one process per host, run in place). Two launchers start workers on this host:
`xmp.spawn` and torch.multiprocessing (gloo / NCCL workers, `gpu_fallback.launcher`). Both use one failure channel: the
launcher makes a folder and names it, with its own pid, in one environment variable its workers
inherit (`failure_channel`); a failing worker leaves its one line there (`errors.tell`), and the
launcher raises the line of the lowest-ranked worker that told one (`errors.told`).
XLA replicas also stop their siblings themselves (`replica_failures`, below), because xmp.spawn
would wait for them for ever; torch.multiprocessing stops the others itself.
"""

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from ..core.errors import ExitError, Stopped, UserError, describe, tell, told
from ..core.roles import Launcher

_CHANNEL = "XLA_TRAIN_LAUNCH"  # "LAUNCHER-PID:FOLDER": where workers register and tell failures


@contextlib.contextmanager
def failure_channel():
    """Around a launch: yields the folder its workers tell their failures in (see `worker_folder`)."""
    folder = tempfile.mkdtemp(prefix="xla_train_launch_")
    previous = os.environ.get(_CHANNEL)
    os.environ[_CHANNEL] = f"{os.getpid()}:{folder}"  # the workers, forked or spawned, inherit it
    try:
        yield folder
    finally:
        if previous is None:
            del os.environ[_CHANNEL]
        else:
            os.environ[_CHANNEL] = previous
        shutil.rmtree(folder, ignore_errors=True)


def worker_folder():
    """In a worker started inside `failure_channel()`, the launch's folder; else None. Only the
    launcher's own children are its workers: a process a worker starts inherits the variable."""
    launcher, _, folder = os.environ.get(_CHANNEL, "").partition(":")
    return folder if folder and launcher == str(os.getppid()) else None


# (roles, fn, args): the job forked replicas inherit (set before xmp.spawn, never pickled)
_HANDED_OFF: dict[str, tuple] = {}


class _XlaLauncher(Launcher):
    """What both XLA launchers share: the processes asked for, and a TPU pod's hosts."""

    start_method = "fork"

    def __init__(self, num_processes=None):
        if num_processes not in (None, 1):
            # xmp.spawn under PJRT takes nprocs 1 or None (every local device) and raises
            # ValueError for anything else (torch_xla 2.9's _internal/pjrt.py, spawn)
            # TPU_VISIBLE_CHIPS set for the whole job would override what torch_xla sets for each
            # replica (one chip each: torch_xla 2.9's _internal/tpu.py, configure_topology),
            # so every replica would claim the same chips: name only the process bounds
            raise UserError(f"`num_processes` {num_processes}: on XLA give 1 (one replica) or leave it out (one "
                            "replica per local device); to use fewer chips, set TPU_PROCESS_BOUNDS")
        from ..core.xla import pjrt_device

        self.num_processes = num_processes
        self.tpu = pjrt_device() == "TPU"

    def host_position(self):
        if os.environ["PJRT_DEVICE"].upper() != "TPU":
            return 0, 1
        from torch_xla._internal import tpu

        # the tpu-env metadata (or TPU_WORKER_ID / TPU_WORKER_HOSTNAMES), read without starting the
        # runtime (torch_xla/_internal/tpu.py, worker_id and num_tpu_workers)
        return tpu.worker_id(), tpu.num_tpu_workers()


class XmpLauncher(_XlaLauncher):
    """One replica per local device under xmp.spawn (XLA's data parallel)."""

    def __init__(self, num_processes=None):
        super().__init__(num_processes)
        if self.tpu:
            _refuse_one_process_per_pod(num_processes)

    def planned_replicas(self):
        # Read from the environment and the host, never from the runtime: the parent must not
        # start it before xmp.spawn forks the replicas.
        device = os.environ["PJRT_DEVICE"].upper()
        if device == "TPU":
            from torch_xla._internal import tpu

            if self.num_processes == 1:
                return 1  # one replica (refused on several hosts: see __init__)
            # the processes xmp.spawn starts on a host (its chips, fewer where TPU_PROCESS_BOUNDS
            # says so) x devices per process (two cores a chip on v2/v3) x hosts; "safe to call
            # before xmp.spawn" (torch_xla 2.9's _internal/tpu.py, num_local_processes)
            return tpu.num_local_processes() * tpu.num_logical_cores_per_chip() * tpu.num_tpu_workers()
        return 1 if device == "CPU" else int(os.environ.get("GPU_NUM_DEVICES", 1))  # see launch()

    def launch(self, roles, fn, args, start_method):
        nprocs = self.num_processes
        if os.environ["PJRT_DEVICE"].upper() == "CPU":
            nprocs = 1  # XLA:CPU runs one replica; xmp.spawn then calls fn in this process.
        # fork: replicas share the parent's tokenised data and model pages instead of each
        # loading a copy. The parent must not have started the XLA runtime.
        spawn_replicas(roles, fn, args, nprocs, start_method)


class HostLauncher(_XlaLauncher):
    """SPMD and FSDPv2: one process per host drives every device; it runs the job in place
    (whatever --num-processes says: no xmp.spawn, which would start the runtime before use_spmd())."""

    def planned_replicas(self):
        return self.host_position()[1]

    def launch(self, roles, fn, args, start_method):
        with pod_watch():  # no launcher watches this process: on several hosts, the pod's marker
            roles.run_worker(fn, args)


def _refuse_one_process_per_pod(num_processes):
    """`--num-processes 1` on several TPU hosts would make each host a world of one: torch_xla's
    single-process path sets TPU_PROCESS_BOUNDS=1,1,1 (torch_xla 2.9's _internal/pjrt.py,
    initialize_singleprocess; tpu.py, configure_one_chip_topology), so the hosts would train
    apart, each as rank 0, writing the same checkpoints."""
    from torch_xla._internal import tpu

    hosts = tpu.num_tpu_workers()
    if num_processes == 1 and hosts > 1:
        raise UserError(f"`num_processes` 1 on a TPU slice of {hosts} hosts would train {hosts} separate models; "
                        "leave it out (one replica per chip), or use `strategy` spmd")


def spawn_replicas(roles, fn, args, nprocs, start_method="fork"):
    """`fn(*args)` in `nprocs` XLA replicas through xmp.spawn (None: one per local device; 1: in
    this process), each through `roles.run_worker`; one replica's failure ends them all."""
    import torch_xla.distributed.xla_multiprocessing as xmp

    entry, entry_args = spawn_arguments(roles, fn, args, start_method)
    try:
        with replica_failures() if nprocs != 1 else contextlib.nullcontext():
            xmp.spawn(entry, args=entry_args, nprocs=nprocs, start_method=start_method)
    finally:
        _HANDED_OFF.clear()


def spawn_arguments(roles, fn, args, start_method):
    """The function and arguments for xmp.spawn. It pickles them into every replica
    (torch_xla/_internal/pjrt.py, run_multiprocess: executor.map over a partial of fn and args),
    and torch's pickler moves every tensor through shared memory (/dev/shm: 64 MB in a default
    container). Forked replicas take the job from this module instead: only a key is pickled."""
    if start_method != "fork":
        return _run_replica, (roles, fn, args)
    key = f"job-{len(_HANDED_OFF)}"
    _HANDED_OFF[key] = (roles, fn, args)
    return _run_handed_off, (key,)


def _run_handed_off(index, key):
    _run_replica(index, *_HANDED_OFF[key])


def _run_replica(index, roles, fn, args):
    """One replica of xmp.spawn (`index`: its global ordinal). Under PJRT, xmp.spawn runs the
    replicas in a ProcessPoolExecutor, collects their results in order, and leaving its `with`
    block waits for every worker (torch_xla 2.9's _internal/pjrt.py, run_multiprocess).
    So a replica that fails alone would leave the others waiting in their next collective, and
    the launcher waiting for them, for ever. Within `replica_failures()` a failing replica instead
    tells the launcher its line, kills its sibling replicas (they are stuck in, or bound for, a
    collective; a checkpoint is written whole or not at all) and leaves the pool at once: the
    executor then fails the pending results with BrokenProcessPool (concurrent/futures/process.py,
    terminate_broken), which `replica_failures()` turns into the line. A replica that dies without
    a word (the kernel's out-of-memory killer) is noticed by the others' watchdog, which does the same."""
    folder = worker_folder()
    if folder is None:  # nprocs=1: xmp.spawn calls this in the launcher's process, errors go up as they are
        roles.run_worker(fn, args)
        return
    done = threading.Event()
    try:
        Path(folder, f"pid-{os.getpid()}").touch()  # threads of one process (Colab) share a pid
        threading.Thread(target=_watch_siblings, args=(folder, done, index), daemon=True).start()
        roles.run_worker(fn, args)
    except Stopped:
        raise  # every replica stopped at the same step: they leave together
    except BaseException as e:  # noqa: B036 - any failure must end every replica
        code = e.exit_code if isinstance(e, ExitError) else 1
        try:
            if not isinstance(e, ExitError):
                traceback.print_exc()  # a bug: its traceback, then the job's one line
                e = UserError(f"replica {index} failed: {describe(e)}", code)
            tell(folder, index, e)
            tell_pod(e)
        finally:  # even if the line cannot be told (a full disk), the job must end
            _leave(folder, code)
    finally:
        done.set()


NO_WORD = ("a replica process ended without a word (killed by a signal or by the system for want of "
           "memory, or it could not start); every replica was stopped")


@contextlib.contextmanager
def replica_failures():
    """Around xmp.spawn with several replicas: one replica's failure ends the job with its line."""
    with failure_channel() as folder:
        try:
            yield
        except BrokenProcessPool:
            raise told(folder) or UserError(NO_WORD, 1) from None


def _siblings(folder):
    pids = {int(name[4:]) for name in os.listdir(folder) if name.startswith("pid-")}
    return pids - {os.getpid()}


def _gone(pid):
    """Ended, or a zombie its launcher has not reaped yet (Linux's /proc; elsewhere never)."""
    if not os.path.isdir("/proc"):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _watch_siblings(folder, done, index):
    # A sibling's process ends only when the launcher's pool shuts down, after every replica
    # returned: one that ends while this replica still runs was killed. Another host's failure
    # is read from the pod's marker (every few seconds: it is a Cloud Storage request).
    ticks = 0
    while not done.wait(1.0):
        if any(_gone(pid) for pid in _siblings(folder)):
            _leave(folder, 1)
        ticks += 1
        failed = pod_failure() if ticks % POD_POLL_SECONDS == 0 else None
        if failed:
            with contextlib.suppress(OSError):
                tell(folder, index, failed)
            _leave(folder, failed.exit_code)


# ---------------------------------------------------------------------------------------------
# Several hosts: the launchers above see this host only. A job on several hosts writes to gs://
# (train.py refuses a local folder there), so a failing process leaves a marker object there too,
# and every host's watchdog (replicas: `_watch_siblings`; SPMD's one process: `pod_watch`) reads it
# and ends its processes with that line, instead of waiting in the next collective for ever.

POD_FAILURES = "XLA_TRAIN_POD_FAILURES"  # the marker's URL: OUTPUT/xla_train_failed-LAUNCH
POD_POLL_SECONDS = 5


def pod_marker(output_url, launch_id):
    """This launch's failure marker in the job's output (one per launch, so a failure of an earlier
    launch of the same run does not end a resumed one)."""
    return f"{output_url.rstrip('/')}/xla_train_failed-{launch_id}"


@contextlib.contextmanager
def watch_pod(marker):
    """Around a launch on several hosts: `marker` (pod_marker's) where its workers, which inherit
    it, tell and read failures; the variable is as it was afterwards. None: one host, nothing set."""
    if marker is None:
        yield
        return
    previous = os.environ.get(POD_FAILURES)
    os.environ[POD_FAILURES] = marker
    try:
        yield
    finally:
        if previous is None:
            del os.environ[POD_FAILURES]
        else:
            os.environ[POD_FAILURES] = previous


def _pod_marker():
    url = os.environ.get(POD_FAILURES)
    if not url:
        return None
    from ..io.storage import open_store

    prefix, _, name = url.rpartition("/")
    return open_store(prefix), name


def tell_pod(error):
    """Leaves `error`'s line where every host of the job reads it (nothing on one host)."""
    marker = _pod_marker()
    if marker:
        store, name = marker
        with contextlib.suppress(Exception):  # noqa: B110 - the host's own line is told in any case
            store.write_text(name, f"{error.exit_code} {error}")


def pod_failure():
    """The failure another host told, as a UserError; None if none did (or on one host)."""
    marker = _pod_marker()
    if not marker:
        return None
    store, name = marker
    try:
        text = store.read_text(name)
    except UserError:  # the bucket did not answer this time: ask again at the next poll
        return None
    if not text:
        return None
    code, _, line = text.partition(" ")
    return UserError(line, int(code))


@contextlib.contextmanager
def pod_watch():
    """Around SPMD's one process per host: its failure is told to the other hosts, and theirs
    ends this one with their line."""
    if not os.environ.get(POD_FAILURES):
        yield
        return
    done = threading.Event()

    def watch():
        while not done.wait(POD_POLL_SECONDS):
            failed = pod_failure()
            if failed:
                print(failed.line(), file=sys.stderr, flush=True)
                os._exit(failed.exit_code)

    threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    except Stopped:
        raise
    except BaseException as e:  # noqa: B036 - the other hosts must hear of any failure
        tell_pod(e if isinstance(e, ExitError) else UserError(f"process failed: {describe(e)}", 1))
        raise
    finally:
        done.set()


def _leave(folder, code):
    try:
        for pid in _siblings(folder):
            if not _gone(pid):  # a pid already gone may be another process's by now
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
