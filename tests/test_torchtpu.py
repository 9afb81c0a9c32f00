"""TorchTPU's `tpu` device and the choice of backend, to the extent this machine can run them:
torch_tpu needs torch 2.11-2.15 and TPU chips, so what runs here is the choice (a pure function of
what a host has), the one-line refusal where TorchTPU is absent, `xla-train env`, the torch-native
device class under the names torch_tpu registers (read in its wheel, docs/torchtpu.md), what that
class asks of the `tpu` device in a worker of rank 1, the worker environments the launcher computes
for one and two hosts, and the launch's one-line refusals."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gpu_fallback import TorchAccelerator, TorchLauncher
from gpu_fallback.launcher import worker_environments
from xla_train import job
from xla_train.commands.cli import as_flags, main
from xla_train.core import select
from xla_train.core.errors import UserError
from xla_train.options import TrainOptions

NONE = {"torch_xla": None, "torch_tpu": None, "libtpu": None}
XLA = {**NONE, "torch_xla": "2.9.0"}
TORCHTPU = {**NONE, "torch_tpu": "0.2.0", "libtpu": "0.0.50"}


@pytest.mark.parametrize("tpu_attached, accelerator, runtimes, backend, reason", [
    (True, "tpu", TORCHTPU, "tpu", "torch sees TorchTPU's tpu device (torch_tpu 0.2.0)"),
    (True, None, XLA, "xla", "a TPU is attached and torch_xla is installed"),
    # a TorchTPU host without torch's tpu device (no chip found, or autoload off): not silently the CPU's
    (True, None, TORCHTPU, "cpu", "a TPU is attached and torch_tpu is installed, but torch sees no tpu device"),
    (True, None, NONE, "cpu", "a TPU is attached but no TPU runtime is installed (pip install 'xla-train[tpu]' "
                              "for torch_xla, or 'xla-train[torchtpu]' for TorchTPU)"),
    (False, "cuda", XLA, "cuda", "torch sees CUDA devices"),  # torch_xla installed on a GPU host: CUDA
    (False, None, XLA, "cpu", "no TPU or CUDA device found"),
    (False, None, NONE, "cpu", "no TPU or CUDA device found"),
])
def test_auto_picks_the_tpu_runtime_that_is_installed(tpu_attached, accelerator, runtimes, backend, reason):
    assert select.auto_backend(tpu_attached, accelerator, runtimes) == (backend, reason)


def test_backend_tpu_without_torch_tpu_is_one_line_naming_the_extra():
    """The core names its parameter (`backend`); the command line shows it as the flag."""
    assert select.no_torchtpu_line(NONE) == \
        "`backend` tpu is TorchTPU, which is not installed: pip install 'xla-train[torchtpu]'"
    assert as_flags(select.no_torchtpu_line(XLA)) == (
        "--backend tpu is TorchTPU, which is not installed: pip install 'xla-train[torchtpu]' (torch_xla 2.9.0 is "
        "installed here: --backend xla, or auto, runs the TPU through it)")


def test_torch_xla_beside_another_torch_is_one_line():
    assert select.xla_torch_mismatch("2.9.0+cpu", "2.9.0") is None
    assert select.xla_torch_mismatch("2.13.0", None) is None  # no torch_xla: nothing to say
    assert select.xla_torch_mismatch("2.13.0+cpu", "2.9.0") == (
        "torch_xla 2.9.0 needs torch 2.9, but this environment has torch 2.13.0+cpu: pip install "
        "'xla-train[xla]' (or [tpu]), which pins it")


def test_a_google_host_with_torch_xla_beside_another_torch_is_one_line(monkeypatch, capsys):
    """On a v5e/v6e host (a Google PCI device) the TPU check is torch_xla's own, which cannot
    import beside another torch: `train` with --backend auto stops with the mismatch line, and
    `env` still prints its report with the warning instead of a traceback; where torch sees CUDA
    the check is not asked."""
    import importlib.util

    from xla_train.core import xla

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torch_xla"
                        else find_spec(name, *a))
    monkeypatch.setattr(xla.glob, "glob", lambda pattern: ["/sys/bus/pci/devices/0000:00:04.0/vendor"])
    monkeypatch.setattr(xla, "_read", lambda path: "0x1ae0")  # Google's vendor id
    monkeypatch.setattr(select, "installed_version", lambda name: "2.8.0" if name == "torch_xla" else None)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    line = select.xla_torch_mismatch(torch.__version__, "2.8.0")
    with pytest.raises(select.UserError, match="needs torch 2.8"):
        xla.tpu_present(select.xla_problem())
    assert main(["train"]) == 2 and capsys.readouterr().err == f"xla-train: error: {line}\n"
    monkeypatch.setattr(select, "tpu_runtimes", lambda: {**NONE, "torch_xla": "2.8.0"})
    assert main(["env"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"warning       {line}" in out
    assert out[-1] == "--backend auto -> none: the TPU check needs torch_xla, which cannot import beside this torch"
    # a Google GPU host: torch sees CUDA, so no TPU check runs and auto picks CUDA (no TPU VM has CUDA)
    monkeypatch.setattr(select, "torch_accelerator", lambda: "cuda")
    assert select.auto_choice() == ("cuda", "torch sees CUDA devices")


def test_backend_tpu_from_the_cli_here(capsys):
    """Neither environment of the tests has torch_tpu: the line of this environment (with the
    torch_xla hint in .venv, without it in .venv-torch), exit 2, before any data or model is read."""
    assert main(["train", "--backend", "tpu"]) == 2
    assert capsys.readouterr().err == f"xla-train: error: {as_flags(select.no_torchtpu_line(select.tpu_runtimes()))}\n"


@pytest.fixture
def registry(monkeypatch):
    """torch.distributed's backend registry, restored after the test."""
    for name in ("backend_list", "backend_capability", "backend_type_map", "default_device_backend_map", "_plugins"):
        value = getattr(dist.Backend, name)
        monkeypatch.setattr(dist.Backend, name, type(value)(value))
    for attr in ("TPU_DIST", "TPU"):
        monkeypatch.setattr(dist.Backend, attr, None, raising=False)


def test_the_tpu_device_takes_the_process_group_torch_tpu_registers(registry):
    """torch_tpu's load registers two names for the tpu device, "tpu_dist" then "tpu"
    (torch_tpu 0.2.0's _loader.py, _init_device_impl); torch maps a device to the first registered for it, and
    TorchAccelerator("tpu") starts that group. Registered here as torch_tpu does it."""

    def create_process_group(*args):  # never called: the group is not started
        raise AssertionError

    for name in ("tpu_dist", "tpu"):
        dist.Backend.register_backend(name, create_process_group, devices=["tpu"])
    accelerator = TorchAccelerator("tpu")
    assert accelerator.process_group == "tpu_dist"
    assert accelerator.accelerated and accelerator.name == "tpu"
    assert (TorchAccelerator("cpu").process_group, TorchAccelerator("cuda").process_group) == ("gloo", "nccl")


def test_env_names_the_tpu_runtimes_and_autos_choice(capsys):
    """`xla-train env` in either environment: torch's version, each TPU runtime with its version or
    `not installed`, the accelerator torch sees, and auto's choice."""
    assert main(["env"]) == 0
    out = capsys.readouterr().out.splitlines()
    runtimes = select.tpu_runtimes()
    assert out[0] == f"torch         {torch.__version__}"
    assert out[1:4] == [f"{name:<14}{runtimes[name] or 'not installed'}" for name in select.TPU_RUNTIMES]
    assert (runtimes["torch_xla"] == "2.9.0") == (torch.__version__.split("+")[0] == "2.9.0")  # its pin
    assert any(line.startswith("PJRT_DEVICE ") for line in out) == bool(runtimes["torch_xla"])
    if not torch.cuda.is_available():  # CI's machines
        assert "accelerator   none (torch sees the CPU only)" in out
        assert out[-1] == "--backend auto -> cpu: no TPU or CUDA device found"


# --- more than one chip: one chip per process, one world over several hosts -------------------

# What torch_tpu 0.2.0's set_tpu_launch_env leaves in the launching process's environment
# (torch_tpu/_internal/distributed/distributed.py): on one host the slice's addresses and topology;
# on the second of two hosts (TPU_WORKER_HOSTNAMES names both) also NNODES, NODE_RANK (from
# JOB_COMPLETION_INDEX here), MASTER_ADDR (the first host) and MASTER_PORT (29500).
ONE_HOST = {"TORCH_TPU_SLICEBUILDER_ADDRESSES": "localhost:8471,localhost:8472,localhost:8473,localhost:8474",
            "TORCH_TPU_TOPOLOGY": "2,2,1", "TORCH_TPU_XPROF_SESSION_ID": "1"}
SECOND_OF_TWO_HOSTS = {"TPU_WORKER_HOSTNAMES": "t1v-w-0,t1v-w-1", "JOB_COMPLETION_INDEX": "1",
                       "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(f"t1v-w-{h}:{8070 + i}" for h in (0, 1)
                                                                    for i in range(4)),
                       "TORCH_TPU_TOPOLOGY": "2,2,1", "TORCH_TPU_XPROF_SESSION_ID": "1",
                       "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "t1v-w-0", "MASTER_PORT": "29500"}
WORLD = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def worlds(envs):
    return [{k: env[k] for k in WORLD} for env in envs]


def test_the_workers_of_one_host_are_the_world(monkeypatch):
    monkeypatch.setattr(os, "environ", dict(ONE_HOST))
    envs = worker_environments(4, several_hosts=True)
    port = envs[0]["MASTER_PORT"]
    assert worlds(envs) == [{"RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": port} for i in range(4)]


def test_the_workers_of_two_hosts_are_one_world_ranked_host_by_host(monkeypatch):
    """The second host's 4 workers are ranks 4-7 of 8, at the first host's address, as torchrun's
    --nnodes/--node_rank/--master_addr/--master_port make them in TorchTPU's own multi-host launch
    (examples/distributed/tensor_parallel/manual/launch_multihost.sh)."""
    monkeypatch.setattr(os, "environ", dict(SECOND_OF_TWO_HOSTS))
    assert worlds(worker_environments(4, several_hosts=True)) == [
        {"RANK": str(4 + i), "LOCAL_RANK": str(i), "WORLD_SIZE": "8", "MASTER_ADDR": "t1v-w-0", "MASTER_PORT": "29500"}
        for i in range(4)]
    # CUDA and the CPU read no hosts from the environment: their workers are this host's world, as before
    assert [(e["RANK"], e["WORLD_SIZE"], e["MASTER_ADDR"]) for e in worker_environments(2)] == [
        ("0", "2", "127.0.0.1"), ("1", "2", "127.0.0.1")]
    del os.environ["NODE_RANK"]
    with pytest.raises(UserError, match="^NNODES=2 .several hosts. needs NODE_RANK as well"):
        worker_environments(4, several_hosts=True)


def launched_worlds(monkeypatch, environ, nprocs, accelerator):
    """The worlds TorchLauncher.launch gives its `nprocs` workers under `environ` (os.environ
    patched): torch.multiprocessing is patched to run each worker's entry here, one after another,
    and each records the variables it runs with instead of training."""
    monkeypatch.setattr(os, "environ", dict(environ))
    seen = []

    class Recording(TorchLauncher):
        def run_worker(self, roles, fn, args=(), report_stop=False):
            seen.append({k: os.environ[k] for k in WORLD})

    def start_processes(entry, args, nprocs, start_method):
        for local_rank in range(nprocs):
            entry(local_rank, *args)

    monkeypatch.setattr(torch.multiprocessing, "start_processes", start_processes)
    roles = SimpleNamespace(accelerator=accelerator, launcher=Recording(nprocs, None))
    roles.launcher.launch(roles, None, (), "spawn")
    return seen


def test_the_launcher_keeps_the_hosts_that_set_tpu_launch_env_set(monkeypatch):
    tpu = SimpleNamespace(name="tpu", prepare_launch=lambda processes: None)  # its variables are in `environ`
    assert launched_worlds(monkeypatch, SECOND_OF_TWO_HOSTS, 4, tpu) == [
        {"RANK": str(4 + i), "LOCAL_RANK": str(i), "WORLD_SIZE": "8", "MASTER_ADDR": "t1v-w-0", "MASTER_PORT": "29500"}
        for i in range(4)]
    one_host = launched_worlds(monkeypatch, ONE_HOST, 2, tpu)
    assert [(w["RANK"], w["WORLD_SIZE"], w["MASTER_ADDR"]) for w in one_host] == [("0", "2", "127.0.0.1"),
                                                                                  ("1", "2", "127.0.0.1")]


@pytest.fixture
def torch_tpu_module(registry, monkeypatch):
    """TorchAccelerator("tpu") whose device module (torch.tpu where torch_tpu is loaded) is `module`:
    only its launch functions, set per test; nothing runs on it."""
    dist.Backend.register_backend("tpu_dist", lambda *a: None, devices=["tpu"])
    module = SimpleNamespace(distributed=SimpleNamespace(set_tpu_launch_env=lambda nproc_per_node: None),
                             is_initialized=lambda: False)
    monkeypatch.setattr(TorchAccelerator, "_module", property(lambda self: module))
    return module


def test_a_chip_count_the_topology_table_does_not_know_is_one_line(torch_tpu_module):
    """torch_tpu 0.2.0's table (_internal/utils/hardware.py): v5e and v6e know 1, 4 and 8 chips, so
    set_tpu_launch_env(nproc_per_node=2) raises get_tpu_topology's RuntimeError on them."""

    def set_tpu_launch_env(nproc_per_node):
        raise RuntimeError(f"No TPU topology found for count: {nproc_per_node}")

    torch_tpu_module.distributed.set_tpu_launch_env = set_tpu_launch_env
    with pytest.raises(UserError) as e:
        TorchAccelerator("tpu").prepare_launch(2)
    line = as_flags(str(e.value))  # the core names its parameter (`backend`); the command line, the flag
    assert line.startswith("--backend tpu: TorchTPU cannot start 2 process(es) on this host: No TPU topology found "
                           "for count: 2 (its topology table knows 1, 4 or 8 chips on v5e")
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_forking_tpu_workers_after_the_runtime_started_is_one_line(torch_tpu_module, monkeypatch):
    """notebook_launcher forks; TorchTPU refuses the TPU to a child forked after its runtime started
    (torch_tpu/_internal/device/_device_module.py, _lazy_init): refused before any worker starts."""
    torch_tpu_module.is_initialized = lambda: True
    monkeypatch.setattr(torch.multiprocessing, "start_processes", lambda *a, **k: pytest.fail("workers started"))
    roles = SimpleNamespace(accelerator=TorchAccelerator("tpu"), launcher=TorchLauncher(2, None))
    with pytest.raises(UserError, match="^`backend` tpu: TorchTPU's runtime already started in this process, and a "
                                        "forked worker cannot use the TPU: call notebook_launcher before"):
        roles.launcher.launch(roles, None, (), "fork")


WORKER_OF_RANK_1 = """
import json, os, sys
import torch
import torch.distributed as dist

torch.utils.rename_privateuse1_backend("tpu")  # as torch_tpu's load does (torch_tpu/_loader.py)
dist.Backend.register_backend("tpu_dist", lambda *a: None, devices=["tpu"])
calls = []

def recorder(name, result=None):
    def call(*args):
        calls.append([name, *[str(a) for a in args if not isinstance(a, torch.Tensor)]])
        return result
    return call

tpu = type(sys)("tpu")  # torch.tpu: records what the accelerator asks of it, runs nothing
tpu.get_rng_state = recorder("get_rng_state", torch.zeros(16, dtype=torch.uint8))
tpu.set_rng_state = recorder("set_rng_state")
tpu.get_device_properties = recorder("get_device_properties", type("Properties", (), {"total_memory": 1}))
tpu.get_device_name = recorder("get_device_name", "TPU v6e")
torch._register_device_module("tpu", tpu)
for name in ("set_device_index", "synchronize", "max_memory_allocated"):
    setattr(torch.accelerator, name, recorder(name, 0))

from gpu_fallback import Ddp, TorchAccelerator, strategies

os.environ.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")  # the second worker, as the launcher starts it
accelerator = TorchAccelerator("tpu")
accelerator.setup()
accelerator.set_rng_state(accelerator.rng_state())
accelerator.synchronize(), accelerator.peak_memory(), accelerator.device_memory(), accelerator.describe()
strategies.DistributedDataParallel = lambda model, **options: calls.append(["DDP", str(options)])
Ddp.world_size = 2  # a process group of two, without starting one
model = torch.nn.Linear(1, 1)
model.to = lambda device: calls.append(["to", str(device)]) or model
Ddp(accelerator).wrap_model(model)
print(json.dumps({"device": str(accelerator.device), "calls": calls}))
"""


def test_a_worker_of_rank_1_uses_its_one_chip_as_tpu_0():
    """TorchTPU binds each worker to LOCAL_RANK's chip, which the worker sees as `tpu:0`
    (TPU_VISIBLE_CHIPS from LOCAL_RANK: torch_tpu common/environment.cc,
    InitializeDistributedEnvironment), and refuses any other index: the worker of rank 1 places
    everything on tpu:0 and passes no index to set_device, the rng state, synchronize, the memory
    calls or DDP (its tutorial docs/notebooks/distributed_training_101.py: no device_ids).
    In a process of its own: torch's PrivateUse1 is renamed `tpu` there (once per process), with a
    torch.tpu that records the calls."""
    proc = subprocess.run([sys.executable, "-c", WORKER_OF_RANK_1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["device"] == "tpu:0"
    assert result["calls"] == [["get_rng_state"], ["set_rng_state"], ["synchronize"], ["max_memory_allocated"],
                               ["get_device_properties"], ["get_device_name"], ["to", "tpu:0"],
                               ["DDP", "{'device_ids': None}"]]


def test_the_launching_process_seeds_the_cpu_only(mrpc_slice, tiny_model, monkeypatch):
    """The model loads (and its new head is drawn) in the launching process; on TorchTPU,
    torch.manual_seed would also seed every chip (torch/random.py, _seed_custom_device calls
    torch.tpu.manual_seed_all), starting TorchTPU's runtime there on the chips the workers need.
    The tasks seed the CPU's generator only (models.seed_host), on every backend: the head is
    drawn on the CPU, the same as torch.manual_seed draws it."""
    seeded = []
    monkeypatch.setattr(torch.random, "_seed_custom_device", seeded.append)
    cfg = TrainOptions(model=str(tiny_model), data_dir=str(mrpc_slice), backend="cpu", seed=7)
    heads = []
    for other in (1, 2):  # whatever the generator's state before, the head is --seed's
        torch.random.default_generator.manual_seed(other)
        heads.append(job.prepare(cfg, select.select_roles("cpu")).model.classifier.weight)
    assert seeded == []  # no device's generator was reached
    assert torch.equal(heads[0], heads[1])


@pytest.mark.xla
@pytest.mark.xla_in_process
@pytest.mark.slow
def test_torchax_is_no_accelerator():
    """torch_xla imports torchax for mark_sharding and call_jax where flax is installed (the tpu and
    dev extras), and torchax renames PrivateUse1 "jax" and declares it available (torchax/__init__.py,
    device_module.py): torch then reports a "jax" accelerator, which `--backend auto` must not take."""
    from torch_xla._internal.jax_workarounds import maybe_get_torchax

    assert maybe_get_torchax() is not None  # flax is there: torch_xla's bundled torchax imports
    assert torch.accelerator.current_accelerator(check_available=True).type == select.TORCHAX_DEVICE
    assert select.torch_accelerator() is None
