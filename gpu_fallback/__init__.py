"""xla_train's roles on plain torch: the torch-native accelerator (CUDA, the CPU), the Ddp and Fsdp2
strategies (NCCL or gloo, or one process) and torch.multiprocessing's launcher."""

from .device import TorchAccelerator
from .launcher import TorchLauncher
from .strategies import Ddp, Fsdp2

__all__ = ["Ddp", "Fsdp2", "TorchAccelerator", "TorchLauncher"]

