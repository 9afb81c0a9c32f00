"""Which roles run, and why: the one place that maps `--backend` and `--strategy` names to an
accelerator, a strategy and a launcher (like Lightning Fabric's connector). Implementations are
imported only once chosen, so the fallback works on a machine without torch_xla."""

import importlib.util

import torch

from .errors import UserError, check_choice
from .roles import Roles

BACKENDS = ("auto", "xla", "cuda", "cpu")
# ddp: one replica per device; spmd: one process shards the batch (XLA); fsdp: the model too (FSDPv2 on
# XLA, FSDP2 on CUDA and the CPU)
STRATEGIES = ("ddp", "spmd", "fsdp")


def xla_available():
    return importlib.util.find_spec("torch_xla") is not None


def auto_choice():
    """(backend name, reason) that `--backend auto` picks: TPU, then CUDA, then CPU."""
    from .xla import tpu_present  # imports no torch_xla

    if tpu_present() and xla_available():
        return "xla", "a TPU is attached and torch_xla is installed"
    if torch.cuda.is_available():
        return "cuda", f"{torch.cuda.device_count()} CUDA device(s) visible"
    reason = "no TPU or CUDA device found"
    if tpu_present():
        reason = "a TPU is attached but torch_xla is not installed (pip install 'xla-train[tpu]')"
    return "cpu", reason


def select_roles(name="auto", num_processes=None, strategy="ddp"):
    """The roles for `--backend NAME` and `--strategy`, not yet started (no runtime, no process
    group). The one place that maps the two names to implementations."""
    check_choice("--backend", name or "", BACKENDS)  # "" for None: given, and not a name
    check_choice("--strategy", strategy or "", STRATEGIES)
    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, not {num_processes}")
    if name == "auto":
        name, _ = auto_choice()
    if name == "xla":
        return _xla_roles(num_processes, strategy)
    if strategy == "spmd":
        raise UserError(f"--strategy spmd needs the xla backend, not {name}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--backend cuda: no CUDA device is visible")
    from gpu_fallback import Ddp, Fsdp2, TorchAccelerator, TorchLauncher

    accelerator = TorchAccelerator(name)
    strategies = {"ddp": Ddp, "fsdp": Fsdp2}
    launcher = TorchLauncher(num_processes, accelerator.default_processes)
    return Roles(accelerator, strategies[strategy](accelerator), launcher)


def _xla_roles(num_processes, strategy):
    if not xla_available():
        raise UserError("--backend xla needs torch_xla: pip install 'xla-train[tpu]' (or torch_xla for CPU)")
    from . import launchers, xla

    # ddp: replicas under xmp.spawn; spmd and fsdp: one process per host on a virtual device
    strategies = {"ddp": (xla.XlaDdp, launchers.XmpLauncher), "spmd": (xla.XlaSpmd, launchers.HostLauncher),
                  "fsdp": (xla.XlaFsdp, launchers.HostLauncher)}
    cls, launcher_cls = strategies[strategy]
    launcher = launcher_cls(num_processes)  # the processes asked for are checked first
    accelerator = xla.XlaAccelerator(virtual=launcher_cls is launchers.HostLauncher)
    return Roles(accelerator, cls(accelerator), launcher)
