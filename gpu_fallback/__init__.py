"""The xla_train backend API on CUDA (DDP over NCCL) or the CPU (single process or gloo)."""

from .backend import CPUBackend, CudaBackend, TorchBackend

__all__ = ["CPUBackend", "CudaBackend", "TorchBackend"]
