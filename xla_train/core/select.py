"""Which roles run, and why: the one place that maps `--backend` and `--strategy` names to an
accelerator, a strategy and a launcher (like Lightning Fabric's connector). Implementations are
imported only once chosen, so the fallback works on a machine without torch_xla."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..parallel.mesh import Mesh
from .errors import UserError, check_choice

if TYPE_CHECKING:  # torch is imported where it is used: the options check the names here without it
    from .roles import Roles

BACKENDS = ("auto", "xla", "tpu", "cuda", "cpu")
# ddp: one replica per device; spmd: one process shards the batch (XLA); fsdp: the model too (FSDPv2 on
# XLA, FSDP2 on the torch-native devices)
STRATEGIES = ("ddp", "spmd", "fsdp")
# The TPU runtimes: torch_xla (--backend xla, the xla and tpu extras, torch 2.9) and TorchTPU
# (--backend tpu, the torchtpu extra, torch 2.11-2.15). Their torches differ, so one environment
# holds one of them; libtpu is what both drive the chips with.
TPU_RUNTIMES = ("torch_xla", "torch_tpu", "libtpu")


def shards_parameters(strategy: str) -> bool:
    """Whether `strategy` splits the parameters (its mesh's first axis is fsdp): what a mesh laid
    out on paper, before any roles are made, gives the devices the named axes leave."""
    return strategy == "fsdp"


def xla_available():
    return importlib.util.find_spec("torch_xla") is not None


def installed_version(distribution):
    """The installed version of a distribution, from its metadata (importing torch_xla starts PJRT's
    defaults), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def tpu_runtimes():
    """{runtime: version or None} for TPU_RUNTIMES."""
    return {name: installed_version(name) for name in TPU_RUNTIMES}


TORCHAX_DEVICE = "jax"


def torch_accelerator():
    """The accelerator torch itself sees ("cuda", "tpu"...), or None. TorchTPU's package is a torch
    device extension (entry point `torch.backends` -> torch_tpu._loader:load, which torch calls at
    its import); load() registers "tpu" only when it finds TPU chips (torch_tpu 0.2.0's _loader.py,
    load; the device renamed from PrivateUse1 in its _init_device_impl)."""
    import torch

    accelerator = torch.accelerator.current_accelerator(check_available=True)  # a CUDA build sees no GPU
    # "jax": torchax (imported by torch_xla's mark_sharding and call_jax where flax is installed) renames
    # PrivateUse1 to "jax" and declares it available at import (torchax/__init__.py, device_module.py): no device
    return accelerator.type if accelerator is not None and accelerator.type != TORCHAX_DEVICE else None


def xla_torch_mismatch(torch_version, xla_version):
    """The line saying why torch_xla cannot import next to this torch, or None. torch_xla's wheel
    names no torch in its requirements (torch_xla-2.9.0.dist-info/METADATA), yet its _XLAC is built
    against one torch release: beside another, `import torch_xla` fails on an undefined symbol."""
    release = lambda v: tuple(v.split("+")[0].split(".")[:2])  # noqa: E731  2.9.0+cpu -> (2, 9)
    if not xla_version or release(torch_version) == release(xla_version):
        return None
    return (f"torch_xla {xla_version} needs torch {'.'.join(release(xla_version))}, but this environment has "
            f"torch {torch_version}: pip install 'xla-train[xla]' (or [tpu]), which pins it")


def auto_backend(tpu_attached, accelerator, runtimes):
    """(backend name, reason) that `--backend auto` picks from what this host has: whether a TPU is
    attached, the accelerator torch sees (torch_accelerator) and the TPU runtimes installed
    (tpu_runtimes). A TPU first, through whichever runtime is installed, then CUDA, then the CPU."""
    if accelerator == "tpu":
        return "tpu", f"torch sees TorchTPU's tpu device (torch_tpu {runtimes.get('torch_tpu')})"
    if tpu_attached and runtimes.get("torch_xla"):
        return "xla", "a TPU is attached and torch_xla is installed"
    if accelerator == "cuda":
        return "cuda", "torch sees CUDA devices"
    if tpu_attached and runtimes.get("torch_tpu"):
        return "cpu", "a TPU is attached and torch_tpu is installed, but torch sees no tpu device"
    if tpu_attached:
        return "cpu", ("a TPU is attached but no TPU runtime is installed (pip install 'xla-train[tpu]' "
                       "for torch_xla, or 'xla-train[torchtpu]' for TorchTPU)")
    return "cpu", "no TPU or CUDA device found"


def xla_problem():
    """Why the installed torch_xla cannot be imported beside this torch, or None."""
    import torch

    return xla_torch_mismatch(torch.__version__, installed_version("torch_xla"))


def tpu_attached(accelerator):
    """Whether a TPU is attached (xla.tpu_present), asked only where torch sees no accelerator (a
    TPU VM has no CUDA device, and TorchTPU's tpu device is one): on a Google GPU host the check
    would need torch_xla, which may be installed beside a torch it cannot import with."""
    from .xla import tpu_present  # imports no torch_xla

    return accelerator is None and tpu_present(xla_problem())


def auto_choice():
    """(backend name, reason) that `--backend auto` picks on this host."""
    accelerator = torch_accelerator()
    return auto_backend(tpu_attached(accelerator), accelerator, tpu_runtimes())


def no_torchtpu_line(runtimes):
    """Why `--backend tpu` cannot run here: TorchTPU is not installed."""
    line = "`backend` tpu is TorchTPU, which is not installed: pip install 'xla-train[torchtpu]'"
    if runtimes.get("torch_xla"):
        line += (f" (torch_xla {runtimes['torch_xla']} is installed here: `backend` xla, or auto, runs the TPU "
                 "through it)")
    return line


def select_roles(name="auto", num_processes=None, strategy="ddp", mesh: Mesh | None = None):
    """The roles for `--backend NAME`, `--strategy` and the mesh's axes (parallel.mesh: what
    `--tensor-parallel`, `--expert-parallel` and `--context-parallel` ask for), not yet started (no
    runtime, no process group). The one place that maps the names to implementations."""
    check_choice("`backend`", name or "", BACKENDS)  # "" for None: given, and not a name
    check_choice("`strategy`", strategy or "", STRATEGIES)
    if num_processes is not None and num_processes < 1:
        raise UserError(f"`num_processes` must be at least 1, not {num_processes}")
    mesh = mesh or Mesh()
    if name == "auto":
        name, _ = auto_choice()
    # tensor, expert and context parallelism run on FSDP2 too (TorchTPU's DTensors under transformers'
    # styles are not read yet)
    backends = ("xla", "cuda", "cpu")
    if mesh.split and (name not in backends or strategy != "fsdp"):
        raise UserError(f"{mesh.named()} runs under `strategy` fsdp (a mesh of fsdp and the named axes) on the "
                        f"{' and '.join([', '.join(backends[:-1]), backends[-1]] if len(backends) > 1 else backends)} "
                        f"backend{'s' if len(backends) > 1 else ''} only, "
                        f"not {name} with {strategy}")
    if name == "xla":
        return _xla_roles(num_processes, strategy, mesh)
    if strategy == "spmd":
        raise UserError(f"`strategy` spmd needs the xla backend, not {name}")
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("`backend` cuda: no CUDA device is visible")
    if name == "tpu":
        _check_torchtpu()
    return registered_roles(name)(name, num_processes, strategy, mesh)


# The torch-native backends' roles are not the core's: a package registers a function that makes
# them, `make(backend, num_processes, strategy, mesh) -> Roles`, under the backend's name, either by
# calling `register_roles` or through an entry point of this group in its metadata
# (gpu_fallback's, in setup.py: found once the package is installed).
ROLES_GROUP = "xla_train.roles"
FALLBACK_BACKENDS = ("cuda", "cpu", "tpu")  # gpu_fallback's (setup.py's entry points)
_REGISTERED: dict[str, Callable[[str, int | None, str, Mesh], Roles]] = {}


def register_roles(name: str, make: Callable[[str, int | None, str, Mesh], Roles]) -> None:
    """Makes `make` the roles of `backend` `name` (cuda, cpu, tpu)."""
    _REGISTERED[name] = make


def registered_roles(name: str) -> Callable[[str, int | None, str, Mesh], Roles]:
    """What makes backend `name`'s roles: registered in this process, else an installed package's
    entry point (importlib.metadata, group ROLES_GROUP)."""
    if name not in _REGISTERED:
        from importlib.metadata import entry_points

        for point in entry_points(group=ROLES_GROUP, name=name):
            register_roles(name, point.load())
    if name not in _REGISTERED and name in FALLBACK_BACKENDS and importlib.util.find_spec("gpu_fallback"):
        # a checkout on PYTHONPATH, not installed: no entry points, the package beside this one
        register_roles(name, importlib.import_module("gpu_fallback").roles)
    if name not in _REGISTERED:
        raise UserError(f"`backend` {name}: no package registers its roles (gpu_fallback's entry point "
                        f"{ROLES_GROUP!r} is missing: install xla-train with pip)")
    return _REGISTERED[name]


def _check_torchtpu():
    runtimes = tpu_runtimes()
    if not runtimes["torch_tpu"]:
        raise UserError(no_torchtpu_line(runtimes))
    if torch_accelerator() != "tpu":
        raise UserError(f"`backend` tpu: torch_tpu {runtimes['torch_tpu']} is installed but torch sees no tpu "
                        "device (no TPU chip found, or TORCH_DEVICE_BACKEND_AUTOLOAD=0 kept torch from loading it)")


def _xla_roles(num_processes, strategy, mesh):
    if not xla_available():
        raise UserError("`backend` xla needs torch_xla: pip install 'xla-train[tpu]' (or [xla] for CPU)")
    mismatch = xla_problem()
    if mismatch:
        raise UserError(mismatch)
    from ..parallel import launchers, xla_strategies
    from . import xla
    from .roles import Roles

    # ddp: replicas under xmp.spawn; spmd and fsdp: one process per host on a virtual device
    strategies = {"ddp": (xla_strategies.XlaDdp, launchers.XmpLauncher),
                  "spmd": (xla_strategies.XlaSpmd, launchers.HostLauncher),
                  "fsdp": (xla_strategies.XlaFsdp, launchers.HostLauncher)}
    cls, launcher_cls = strategies[strategy]
    launcher = launcher_cls(num_processes)  # the processes asked for are checked first
    accelerator = xla.XlaAccelerator(virtual=launcher_cls is launchers.HostLauncher)
    strategy_part = cls(accelerator, mesh)
    return Roles(accelerator, strategy_part, launcher)
