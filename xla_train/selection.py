"""Which backend runs, and why: the one place that maps `--backend` names to implementations
(like Lightning Fabric's connector). Implementations are imported only once chosen, so the
fallback works on a machine without torch_xla."""

import importlib.util

import torch

from .errors import UserError
from .options import BACKENDS, STRATEGIES



def xla_available():
    return importlib.util.find_spec("torch_xla") is not None


def auto_choice():
    """(backend name, reason) that `--backend auto` picks: TPU, then CUDA, then CPU."""
    from .xla_backend import tpu_present  # imports no torch_xla

    if tpu_present() and xla_available():
        return "xla", "a TPU is attached and torch_xla is installed"
    if torch.cuda.is_available():
        return "cuda", f"{torch.cuda.device_count()} CUDA device(s) visible"
    reason = "no TPU or CUDA device found"
    if tpu_present():
        reason = "a TPU is attached but torch_xla is not installed (pip install 'xla-train[tpu]')"
    return "cpu", reason


def select_backend(name="auto", num_processes=None, strategy="ddp"):
    """The backend for `--backend NAME` and `--strategy`, not yet started (no runtime, no
    process group). The one place that maps the two names to an implementation."""
    if name not in BACKENDS:
        raise UserError(f"--backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    if strategy not in STRATEGIES:
        raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, not {num_processes}")
    if name == "auto":
        name, _ = auto_choice()
    if name == "xla":
        if not xla_available():
            raise UserError("--backend xla needs torch_xla: pip install 'xla-train[tpu]' (or torch_xla for CPU)")
        from . import xla_backend

        classes = {"ddp": xla_backend.XLABackend, "spmd": xla_backend.XLASpmdBackend, "fsdp": xla_backend.XLAFsdpBackend}
        return classes[strategy](num_processes)
    if strategy == "spmd":
        raise UserError(f"--strategy spmd needs the xla backend, not {name}")
    from gpu_fallback import backend as torch_backend

    if name == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--backend cuda: no CUDA device is visible")
        return (torch_backend.CudaFsdpBackend if strategy == "fsdp" else torch_backend.CudaBackend)(num_processes)
    return (torch_backend.CPUFsdpBackend if strategy == "fsdp" else torch_backend.CPUBackend)(num_processes)
