"""The torch-native launcher: torchrun's processes as they are, one process, or workers started
with torch.multiprocessing on this host (gloo on the CPU, NCCL on CUDA, tpu_dist on TorchTPU)."""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from xla_train.core.errors import ExitError, Stopped, UserError, tell, told
from xla_train.core.roles import Launcher
from xla_train.parallel.launchers import failure_channel, worker_folder

if TYPE_CHECKING:
    from xla_train.core.roles import Roles


class _Launched(Protocol):
    """What `TorchLauncher.launch` asks of the accelerator (device.TorchAccelerator, which imports
    this module: named by what it does, not imported)."""

    name: str

    def prepare_launch(self, processes: int) -> None: ...

    def fork_refusal(self) -> str | None: ...


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hosts(several_hosts: bool) -> int:
    """The hosts a launch spans: NNODES where a TPU slice's hosts are read from the environment, else 1."""
    return int(os.environ.get("NNODES", 1)) if several_hosts else 1


def worker_environments(nprocs: int, several_hosts: bool = False) -> list[dict[str, str]]:
    """The variables of each of this host's `nprocs` workers, as torchrun sets them (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). One host: the workers are the world, on a free
    port of the loopback. `several_hosts` (TorchTPU): where the environment says a slice of several
    hosts, as set_tpu_launch_env leaves it (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT: torch_tpu
    0.2.0, _internal/distributed/distributed.py), every host's workers form one world, ranked host by
    host (RANK = NODE_RANK * nprocs + LOCAL_RANK), as torchrun ranks them
    (examples/distributed/tensor_parallel/manual/launch_multihost.sh in TorchTPU's repository)."""
    nnodes = _hosts(several_hosts)
    if nnodes > 1:
        missing = [name for name in ("NODE_RANK", "MASTER_ADDR") if not os.environ.get(name)]
        if missing:
            raise UserError(f"NNODES={nnodes} (several hosts) needs {' and '.join(missing)} as well: set them, or "
                            "let TorchTPU's set_tpu_launch_env set all of them (unset NNODES)")
        node_rank = int(os.environ["NODE_RANK"])
        if not 0 <= node_rank < nnodes:
            raise UserError(f"NODE_RANK={node_rank} is not a host of NNODES={nnodes} (0 to {nnodes - 1})")
        master = {"MASTER_ADDR": os.environ["MASTER_ADDR"], "MASTER_PORT": os.environ.get("MASTER_PORT", "29500")}
    else:
        node_rank, master = 0, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    return [{**master, "WORLD_SIZE": str(nnodes * nprocs), "RANK": str(node_rank * nprocs + local_rank),
             "LOCAL_RANK": str(local_rank)} for local_rank in range(nprocs)]


def fork_hazard() -> str | None:
    """Why gloo workers must be spawned from this process rather than forked (None: forking is safe).
    A forked child keeps only the thread that forked, so any pool or runtime whose threads the
    parent started is broken in it. torch's OpenMP pool (GNU libgomp in torch's wheels): once the
    parent ran a parallel region with more than one thread, a forked child's first parallel
    region waits for ever for threads it does not have (a 2000x2000 matmul in the parent, then
    a matmul in each child: hung, tests/test_distributed.py, test_forking_gloo_workers_after_openmp).
    With one thread (`torch.get_num_threads() == 1`, as OMP_NUM_THREADS=1 sets) no region uses the
    pool, even one started before (measured), so the children, which inherit that one thread, are safe."""
    if torch.get_num_threads() > 1:
        return f"torch's OpenMP pool may hold {torch.get_num_threads()} threads"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "CUDA is initialised"
    xla = sys.modules.get("torch_xla")
    if xla is not None and xla._XLAC._xla_runtime_is_initialized():
        return "torch_xla's runtime has started"
    return None


class TorchLauncher(Launcher):
    """One process per device (`default_processes()`: the accelerator's count), `num_processes`
    gloo workers on the CPU, or the processes torchrun started."""

    # "auto": gloo workers are forked where `fork_hazard` finds nothing (they then skip importing
    # torch, transformers and the package again, and take the job without pickling it), else
    # spawned; workers of an accelerator are spawned
    start_method = "auto"

    def __init__(self, num_processes: int | None, default_processes: Callable[[], int]) -> None:
        self.num_processes, self.default_processes = num_processes, default_processes

    def planned_replicas(self) -> int:
        if launched_by_torchrun():
            return int(os.environ["WORLD_SIZE"])
        return self.num_processes or self.default_processes()

    def launch(self, roles: Roles, fn: Callable[..., object], args: Sequence[Any], start_method: str) -> None:
        nprocs = self.num_processes or self.default_processes()
        if launched_by_torchrun():
            roles.run_worker(fn, args)  # torchrun started this process already
            return
        accelerator = cast(_Launched, roles.accelerator)  # select.py pairs this launcher with TorchAccelerator only
        accelerator.prepare_launch(nprocs)
        several_hosts = accelerator.name == "tpu"  # a TPU slice's hosts, from set_tpu_launch_env
        if nprocs == 1 and _hosts(several_hosts) == 1:
            roles.run_worker(fn, args)
            return
        # "auto" (`start_method` above): fork the CPU's workers where `fork_hazard` allows, else spawn.
        # Notebooks need fork (spawn cannot import a function defined in a cell), so
        # notebook_launcher forks before the notebook has run torch ops in parallel, as Accelerate's does.
        # A worker that fails leaves its one-line message in the launch's folder and this process
        # prints it: torch stops the other workers as soon as one exits, maybe before they could print.
        if start_method == "auto":
            start_method = "fork" if accelerator.name == "cpu" and fork_hazard() is None else "spawn"
        refusal = start_method == "fork" and accelerator.fork_refusal()
        if refusal:
            raise UserError(refusal)
        envs = worker_environments(nprocs, several_hosts)
        # When one worker exits with an error, torch stops the others and logs each one it
        # terminates; the worker's own message says what happened.
        spawn_log = logging.getLogger("torch.multiprocessing.spawn")
        level = spawn_log.level
        spawn_log.setLevel(logging.ERROR)
        try:
            with failure_channel() as errors:
                try:
                    torch.multiprocessing.start_processes(_worker, args=(roles, envs, fn, args), nprocs=nprocs,
                                                          start_method=start_method)
                except torch.multiprocessing.ProcessExitedException as e:
                    if e.exit_code is None or e.exit_code < 0:  # killed by a signal it did not handle
                        raise
                    raise told(errors) or UserError("", e.exit_code) from None
        finally:
            spawn_log.setLevel(level)

    def run_worker(self, roles: Roles, fn: Callable[..., object], args: Sequence[Any] = (),
                   report_stop: bool = False) -> None:
        stopped = None
        with roles.activated():
            try:
                fn(*args)
            except Stopped as e:  # every replica stopped at the same step: they leave together
                stopped = e.args  # not the exception: its traceback holds fn's frames and DDP model
                # a spawned worker: say it before the barrier lets others exit
                if report_stop and roles.strategy.is_main:
                    print(e.line(), file=sys.stderr, flush=True)
        # Only now, with fn's DDP model and its gradient reducer freed, may the process group go:
        # a reducer that outlives its group can hang in the group's destructor. (No group, nothing
        # to free first: a full collection costs 0.25 s in a process holding many objects.)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gc.collect()
        roles.teardown()
        if stopped:
            raise Stopped(*stopped)


def _worker(local_rank, roles, envs, fn, args):
    os.environ.update(envs[local_rank])
    try:
        roles.launcher.run_worker(roles, fn, args, report_stop=True)
    except ExitError as e:
        # One line, not the traceback torch.multiprocessing would pass up, told by the launcher
        # (a stop was reported before the workers parted).
        if str(e) and not isinstance(e, Stopped) and worker_folder():
            tell(worker_folder(), local_rank, e)
        sys.exit(e.exit_code)
