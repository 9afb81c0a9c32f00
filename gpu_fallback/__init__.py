"""xla_train's roles on plain torch: the torch-native accelerator (CUDA, the CPU, TorchTPU's tpu
device), the Ddp and Fsdp2 strategies (NCCL or gloo, or one process) and torch.multiprocessing's
launcher. `roles` makes them for a backend; setup.py registers it with xla_train's selection
(entry points of the group `xla_train.roles`: cuda, cpu, tpu), which never imports this package."""

from collections.abc import Callable

from xla_train.core.roles import Roles, Strategy
from xla_train.parallel.mesh import Mesh

from .device import TorchAccelerator
from .launcher import TorchLauncher
from .strategies import Ddp, Fsdp2

__all__ = ["Ddp", "Fsdp2", "TorchAccelerator", "TorchLauncher", "roles"]


def roles(backend: str, num_processes: int | None = None, strategy: str = "ddp", mesh: Mesh | None = None
          ) -> Roles:
    """The roles of the torch-native `backend` (cuda, cpu, tpu) under `strategy` (ddp or fsdp),
    with `num_processes` workers (None: the device's default), not yet started; under fsdp, the
    `mesh`'s axes split the work (parallel.mesh: tensor, expert, context)."""
    accelerator = TorchAccelerator(backend)
    launcher = TorchLauncher(num_processes, accelerator.default_processes)
    strategies: dict[str, Callable[[TorchAccelerator, Mesh | None], Strategy]] = {"ddp": Ddp, "fsdp": Fsdp2}
    return Roles(accelerator, strategies[strategy](accelerator, mesh), launcher)

