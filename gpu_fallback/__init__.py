"""xla_train's roles on plain torch: the torch-native accelerator (CUDA, the CPU, TorchTPU's tpu
device), the Ddp and Fsdp2 strategies (NCCL or gloo, or one process) and torch.multiprocessing's
launcher. `roles` makes them for a backend; setup.py registers it with xla_train's selection
(entry points of the group `xla_train.roles`: cuda, cpu, tpu), which never imports this package."""

from xla_train.core.roles import Roles

from .device import TorchAccelerator
from .launcher import TorchLauncher
from .strategies import Ddp, Fsdp2

__all__ = ["Ddp", "Fsdp2", "TorchAccelerator", "TorchLauncher", "roles"]


def roles(backend: str, num_processes: int | None = None, strategy: str = "ddp") -> Roles:
    """The roles of the torch-native `backend` (cuda, cpu, tpu) under `strategy` (ddp or fsdp),
    with `num_processes` workers (None: the device's default), not yet started."""
    accelerator = TorchAccelerator(backend)
    strategies = {"ddp": Ddp, "fsdp": Fsdp2}
    launcher = TorchLauncher(num_processes, accelerator.default_processes)
    return Roles(accelerator, strategies[strategy](accelerator), launcher)

