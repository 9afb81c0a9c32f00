"""The backend interface, and the one function that picks an implementation.

Two implementations: `xla_train.xla_backend.XLABackend` (torch_xla, PJRT) and
`gpu_fallback.backend.TorchBackend` (CUDA DDP with NCCL, or the CPU with gloo). Nothing outside
those two files imports torch_xla or torch.distributed, and nothing else branches on the backend.
"""

import importlib.util
import os
from abc import ABC, abstractmethod
from contextlib import nullcontext

import torch

from .errors import UserError

BACKENDS = ("auto", "xla", "cuda", "cpu")
STRATEGIES = ("ddp", "spmd")  # ddp: one replica per device; spmd: one process shards the batch (XLA)


class Backend(ABC):
    """What the training loop needs from a device runtime. One instance per worker process."""

    name: str  # "xla" | "cuda" | "cpu"
    # Rough costs for `--buckets auto` (see data.CostModel); backends override them.
    compile_seconds = 0.0
    token_seconds = 1e-5
    # torch.optim's fused kernels (`fused=True`) exist for the CPU and CUDA, not for XLA, which
    # traces the default multi-tensor update into the step's one graph anyway.
    fused_optimizer = False

    # --- launching ------------------------------------------------------------------------
    @abstractmethod
    def launch(self, fn, args=(), nprocs=None, start_method=None):
        """Runs `fn(*args)` once on every local core/GPU/CPU worker and waits for all of them.
        `start_method` "fork" lets a notebook's own functions run in the workers."""

    def setup(self):
        """Called in each worker before anything touches the device (process groups and such)."""

    def teardown(self):
        """Called by `launch` in each worker once the function has returned (process groups go)."""

    # --- topology ---------------------------------------------------------------------------
    @property
    @abstractmethod
    def device(self): ...

    @property
    def world_size(self):
        return 1

    @property
    def rank(self):
        return 0

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def devices_per_process(self):
        """Devices that one process feeds (more than 1 only for SPMD)."""
        return 1

    def describe_device(self):
        return str(self.device)

    # --- model, data, step ------------------------------------------------------------------
    @abstractmethod
    def prepare_model(self, model):
        """Moves `model` to the device (and wraps it for data parallelism where needed)."""

    def unwrap_model(self, model):
        return model

    @abstractmethod
    def wrap_loader(self, loader):
        """An iterable over `loader`'s batches, already on the device."""

    def backward(self, loss):
        loss.backward()

    def no_sync(self, model):
        """A context for micro-steps whose gradients must not be all-reduced yet."""
        return nullcontext()

    def use_compile_cache(self, path):
        """Keeps compiled graphs in `path` across runs, where the backend compiles anything."""
        raise UserError(f"--compile-cache only applies to the xla backend, not {self.name}")

    @abstractmethod
    def optimizer_step(self, optimizer, max_grad_norm=None):
        """All-reduces gradients across replicas (once), optionally clips, then steps."""

    def autocast(self, precision):
        """A context for the forward pass: bf16 autocast, or a no-op for fp32."""
        if precision == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # --- across replicas --------------------------------------------------------------------
    def gather(self, tensor):
        """Concatenates `tensor` (same shape on every replica) along dim 0 across replicas."""
        return tensor

    def barrier(self):
        pass

    def to_host(self, tensors):
        """Copies a list of device tensors to the CPU (one device-to-host transfer on XLA)."""
        return [t.detach().cpu() for t in tensors]

    def read(self, tensors):
        """Copies tensors that are already computed (e.g. in a step closure) to the CPU, in one
        device-to-host transfer on XLA, without cutting the graph."""
        return [t.detach().cpu() for t in tensors]

    def step_closure(self, fn, args=()):
        """Runs `fn(*args)` once the current step's tensors are computed (at once when eager)."""
        fn(*args)

    def synchronize(self):
        """Waits until all queued device work is done (for honest timings)."""

    def save(self, obj, path):
        """Every replica calls this; only the main one writes."""
        if self.is_main:
            torch.save(obj, path)

    def seed(self, seed):
        torch.manual_seed(seed)

    def rng_state(self):
        """This process's random state (host generator, plus the device's) as a 1-D uint8 tensor."""
        return torch.get_rng_state()

    def set_rng_state(self, state):
        torch.set_rng_state(state[: len(torch.get_rng_state())].clone())

    # --- observability ----------------------------------------------------------------------
    def compile_stats(self):
        """A snapshot of compilation counters, or None where nothing is compiled."""
        return None

    def trace_compilations(self, path):
        """Asks the runtime to append the cause and Python frames of every compilation to `path`.
        Returns the file the analyses go to, or None where nothing is compiled or it is too late
        (it must be called before the first compilation of the process)."""
        return None


def xla_available():
    return importlib.util.find_spec("torch_xla") is not None


def _tpu_present():
    # A TPU VM exposes its chips as /dev/accel* (v4 and later) or /dev/vfio (v5e/v6e);
    # PJRT_DEVICE=TPU set by the user also counts. Checked without importing torch_xla.
    if os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    return any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))


def auto_choice():
    """(backend name, reason) that `--backend auto` picks: TPU, then CUDA, then CPU."""
    if _tpu_present() and xla_available():
        return "xla", "a TPU is attached and torch_xla is installed"
    if torch.cuda.is_available():
        return "cuda", f"{torch.cuda.device_count()} CUDA device(s) visible"
    reason = "no TPU or CUDA device found"
    if _tpu_present():
        reason = "a TPU is attached but torch_xla is not installed (pip install 'xla-train[tpu]')"
    return "cpu", reason


def select_backend(name="auto", num_processes=None, strategy="ddp"):
    """The backend for `--backend NAME`; the only place that maps names to implementations."""
    if name not in BACKENDS:
        raise UserError(f"--backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    if strategy not in STRATEGIES:
        raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    if name == "auto":
        name, _ = auto_choice()
    if strategy == "spmd" and name != "xla":
        raise UserError(f"--strategy spmd needs the xla backend, not {name}")
    if name == "xla":
        if not xla_available():
            raise UserError("--backend xla needs torch_xla: pip install 'xla-train[tpu]' (or torch_xla for CPU)")
        from .xla_backend import XLABackend

        return XLABackend(num_processes, strategy)
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--backend cuda: no CUDA device is visible")
    from gpu_fallback.backend import TorchBackend

    return TorchBackend(name, num_processes)
