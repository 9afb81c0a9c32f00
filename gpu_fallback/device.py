"""The torch-native accelerator: one class for every device torch knows (CUDA, TorchTPU's `tpu`, the
CPU), through `torch.accelerator` and the device's module (`torch.get_device_module`).

Launch commands (the strategies and the launcher are in `strategies.py` and `launcher.py`):
    xla-train train --backend cpu                       # one CPU process
    xla-train train --backend cpu --num-processes 2     # two gloo processes on this host
    xla-train train --backend cuda                      # one process per visible GPU
    xla-train train --backend tpu                       # TorchTPU: one process per TPU chip
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m xla_train train --backend cuda
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from xla_train.core.errors import UserError, first_line
from xla_train.core.roles import Accelerator, Kernel, PathLike, serve

from .launcher import launched_by_torchrun

# eager CPU (2 cores here), training step of the bundled model, per padded token; on an
# accelerator a rough guess for a current GPU, not measured here
TOKEN_SECONDS = {"cpu": 1.2e-3}
ACCELERATOR_TOKEN_SECONDS = 5e-6
# --compile: torch.compile's mode per device (CUDA: CUDA graphs, which static shapes make safe;
# else the default), and the cost of one graph of the bundled model for --buckets auto (the CPU:
# inductor's C++ build on 2 busy cores, measured here; an accelerator: a guess, not measured)
COMPILE_MODES = {"cuda": "reduce-overhead"}
COMPILE_SECONDS = {"cpu": 60.0}
ACCELERATOR_COMPILE_SECONDS = 30.0
# Graphs one compiled forward may keep (dynamo's recompile_limit, 8 by default, beyond which it
# runs eager): one per bucket length in training and one in evaluation, 2 x 4 by default
RECOMPILE_LIMIT = 64
# torch.compile's own timers (torch._dynamo.utils.compilation_time_metrics): a frame's compilation
# (torch 2.9's torch._dynamo.convert_frame._compile, its compile_inner) and its backward's, at the
# first backward (torch._inductor.compile_fx.compile_fx, its bw_compiler; the same names in torch 2.13)
COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
# torch.compile's graphs taken from its caches (`use_compile_cache`): per dynamo graph, AOTAutograd's
# cache (its forward and backward together; torch._functorch's autograd_cache, on by default since
# torch 2.7), and per graph inductor compiles (forward, backward, inference apart), the FX graph cache
CACHE_COUNTERS = {"cache_hits": ("aot_autograd", "autograd_cache_hit"),
                  "cache_misses": ("aot_autograd", "autograd_cache_miss"),
                  "inductor_cache_hits": ("inductor", "fxgraph_cache_hit"),
                  "inductor_cache_misses": ("inductor", "fxgraph_cache_miss")}
# what torch's inductor says once per process when fp32 matrix products could use TensorFloat-32
# (torch._inductor.compile_fx._warn_tf32_disabled): `tf32` is the answer, else it stays off the console
TF32_WARNING = "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled"


# torch's FlexAttention keeps packed documents apart on CUDA (compiled: fused, taken by
# --attention auto) and on the CPU (eager: an unfused reference, taken only when asked for).
serve("cuda", Kernel("flex", auto=True))
serve("cpu", Kernel("flex", auto=False))


class TorchAccelerator(Accelerator):
    """A device of plain torch: `device_type` "cuda" (one device per process, LOCAL_RANK's), "tpu"
    (one chip per process, which the process sees as `tpu:0`) or "cpu" (the host, which
    `torch.accelerator` does not count as an accelerator).

    TorchTPU (torch_tpu 0.2.0, read in its wheel; docs/torchtpu.md) makes "tpu" a device like
    CUDA's: PrivateUse1 renamed "tpu" and `torch.tpu` registered as its module
    (torch_tpu/_loader.py, _init_device_impl), with the rng state (_internal/device/_device_module.py,
    get_rng_state and set_rng_state), the device name and total memory (get_device_name,
    get_device_properties) and a c10 DeviceAllocator whose stats
    `torch.accelerator.max_memory_allocated` reads (TpuAllocator::getDeviceStats in its
    libpywrap_*_common.so; no Python memory API)."""

    fused_optimizer = True  # one fused AdamW kernel instead of a chain of multi-tensor ops
    compile_refusal = None  # --compile: torch.compile (see `compile`)
    tf32 = False  # `use_tf32`: fp32 matrix products on TensorFloat-32 tensor cores (CUDA)

    def __init__(self, device_type: str) -> None:
        self.name = device_type
        self.accelerated = device_type != "cpu"
        self.token_seconds = TOKEN_SECONDS.get(device_type, ACCELERATOR_TOKEN_SECONDS)
        # torch.distributed's process group for this device: "nccl" for CUDA, "gloo" for the CPU,
        # "tpu_dist" for TorchTPU's tpu, which torch_tpu registers first with devices=["tpu"]
        # (torch_tpu/_loader.py, _init_device_impl), and torch maps a device to the first backend registered
        # for it (Backend.register_backend)
        self.process_group = dist.Backend.default_device_backend_map[device_type]
        # transformers and accelerate move work onto XLA when torch_xla is importable; this
        # backend is the plain-torch path, so tell them not to.
        os.environ.setdefault("USE_TORCH_XLA", "0")

    @property
    def _module(self) -> Any:
        """torch.cuda, torch.cpu...: the device's rng state and memory, where it has them (looked up
        each time: a module does not pickle, and spawned workers get this object pickled)."""
        return torch.get_device_module(self.name)

    @property
    def device(self) -> torch.device:
        if not self.accelerated:
            return torch.device("cpu")
        if self.name == "tpu":
            # TorchTPU makes LOCAL_RANK's chip the only one a worker sees (TPU_VISIBLE_CHIPS; torch_tpu
            # common/environment.cc, InitializeDistributedEnvironment): index 0, whatever the rank
            return torch.device("tpu", 0)
        return torch.device(self.name, int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def _which(self) -> tuple[torch.device, ...]:
        """The device argument of the device module's and torch.accelerator's calls: CUDA's device of
        this process; none on TorchTPU, whose calls take the current device and refuse any index but
        the current one (torch.tpu.set_device: "Changing the active TPU device within a process is not
        supported"; get_rng_state/set_rng_state: _rng_validate_device_index)."""
        return () if self.name == "tpu" else (self.device,)

    def describe(self) -> str:
        if not self.accelerated:
            return f"cpu ({torch.get_num_threads()} threads)"
        return self._module.get_device_name(*self._which)

    def default_processes(self) -> int:
        """Workers on this host when --num-processes is not given: one per device."""
        return torch.accelerator.device_count() if self.accelerated else 1

    def prepare_launch(self, processes: int) -> None:
        """In the launching process, before it starts `processes` workers on this host: TorchTPU's
        ranks must agree on addresses, topology and profiling session, which its
        set_tpu_launch_env decides in the parent (torch_tpu/_internal/distributed/distributed.py,
        set_tpu_launch_env; it sets only variables not already set, so an operator may pin them). On a
        slice of several hosts it also sets NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT, which the
        launcher keeps (launcher.worker_environments). A process count that its topology table does
        not know (torch_tpu/_internal/utils/hardware.py, get_tpu_topology: 1, 4 or 8 chips on v5e and
        v6e; 1, 2, 4 or 8 on v4 and v5p; 2, 4 or 8 on v7) ends in one line."""
        if self.name != "tpu":
            return
        try:
            self._module.distributed.set_tpu_launch_env(nproc_per_node=processes)
        except (RuntimeError, ValueError) as e:  # its documented ValueErrors; get_tpu_topology's RuntimeError
            line = f"`backend` tpu: TorchTPU cannot start {processes} process(es) on this host: {first_line(e)}"
            if "topology" in str(e):  # get_tpu_topology's "No TPU topology found for count: N"
                line += (" (its topology table knows 1, 4 or 8 chips on v5e and v6e, 1, 2, 4 or 8 on v4 and v5p, "
                         "2, 4 or 8 devices on v7): give `num_processes` one of those, or leave it out (one "
                         "process per chip)")
            raise UserError(line) from None

    def fork_refusal(self) -> str | None:
        """Why workers cannot be forked from this process now (None: they can). TorchTPU refuses the
        TPU to a child forked after its runtime started in the parent (torch_tpu/_internal/device/
        _device_module.py, _lazy_init and _init_runtime_options: "cannot access or re-initialize TPU
        in a forked subprocess")."""
        if self.name == "tpu" and self._module.is_initialized():
            return ("`backend` tpu: TorchTPU's runtime already started in this process, and a forked worker "
                    "cannot use the TPU: call notebook_launcher before anything runs on the TPU (restart the "
                    "notebook's kernel first), or start the job with xla-train train")
        return None

    def setup(self) -> None:
        # before the NCCL group, which binds to the current device; TorchTPU's one chip is current already
        if self.name == "cuda" and launched_by_torchrun():
            torch.accelerator.set_device_index(self.device)

    def wrap_loader(self, loader: torch.utils.data.DataLoader, sharding: Any = None) -> _DeviceLoader:
        return _DeviceLoader(loader, self.device, sharding)

    def use_compile(self) -> None:
        super().use_compile()
        self.compile_seconds = COMPILE_SECONDS.get(self.name, ACCELERATOR_COMPILE_SECONDS)

    def use_compile_cache(self, path: PathLike) -> None:
        """torch.compile's graphs kept in `path` across runs: inductor's on-disk caches (the FX graph
        cache of every compiled graph, AOTAutograd's cache of each forward-and-backward, Triton's
        kernels) live under TORCHINDUCTOR_CACHE_DIR, which torch reads at each use
        (torch._inductor.runtime.cache_dir_utils.cache_dir), so setting it before the first compilation
        moves them from /tmp/torchinductor_USER to `path`. A second run of the same job then loads its
        graphs instead of compiling them (dynamo still traces the Python); `compile_stats` counts the
        hits. Processes of one run share the folder: inductor writes its entries atomically."""
        if self.name == "tpu":  # TorchTPU compiles with its own dynamo backend, not inductor
            super().use_compile_cache(path)
        if not self.compiling:
            raise UserError(f"`compile_cache` keeps torch.compile's graphs: on the {self.name} backend it needs "
                            "`compile`")
        import torch._functorch.config
        import torch._inductor.config

        folder = os.path.abspath(os.fspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise UserError(f"`compile_cache` {path}: cannot make the folder ({e.strerror})") from None
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        torch._inductor.config.fx_graph_cache = True
        torch._functorch.config.enable_autograd_cache = True

    def use_tf32(self) -> None:
        if self.name != "cuda":
            super().use_tf32()
        # matmuls in TF32 (torch.backends.cuda.matmul's fp32_precision "tf32", allow_tf32 in older
        # torch), as the HF Trainer's tf32=True; cuDNN's convolutions already default to TF32
        torch.set_float32_matmul_precision("high")
        self.tf32 = True

    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """In place (`nn.Module.compile`: the same object, so DDP, state dicts and saving see no
        wrapper; DDP's forward is compiled through dynamo's DDPOptimizer). `dynamic=False`: every
        input shape is a graph of its own, specialised, never a dynamic-shape graph; the buckets
        bound the shapes, so the graphs too (RECOMPILE_LIMIT)."""
        import torch._dynamo
        import torch._inductor.config

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        torch._inductor.config.fallback_random = True  # dropout masks from torch's generator, as eager draws them
        if not self.tf32:  # fp32 kept exact on purpose (`use_tf32` not asked): no advice on the console
            warnings.filterwarnings("ignore", message=TF32_WARNING)
        model.compile(mode=COMPILE_MODES.get(self.name), dynamic=False)
        return model

    def compile_stats(self) -> dict[str, Any] | None:
        """--compile: torch.compile's graphs and seconds (process-wide counters); None without it."""
        if not self.compiling:
            return None
        from torch._dynamo.utils import compilation_time_metrics, counters

        return {"compiles": counters["stats"]["unique_graphs"],
                "compile_seconds": sum(sum(compilation_time_metrics.get(k, ())) for k in COMPILE_TIMERS),
                **{key: counters[group][name] for key, (group, name) in CACHE_COUNTERS.items()}}

    def seed(self, seed: int, replica: int = 0) -> None:
        if not self.accelerated:
            super().seed(seed, replica)  # the host's generator is the device's
            return
        torch.manual_seed(seed)  # the host's, and every device's alike
        if replica and hasattr(self._module, "manual_seed"):
            # the current device only: this worker's (CUDA: LOCAL_RANK's, made current in `setup`;
            # TorchTPU: its one chip)
            self._module.manual_seed(seed + replica)

    def rng_state(self) -> torch.Tensor:
        if not hasattr(self._module, "get_rng_state"):
            return super().rng_state()
        return torch.cat([torch.get_rng_state(), self._module.get_rng_state(*self._which)])

    def set_rng_state(self, state: torch.Tensor) -> None:
        super().set_rng_state(state)
        if hasattr(self._module, "set_rng_state"):
            self._module.set_rng_state(state[len(torch.get_rng_state()):].clone(), *self._which)

    def synchronize(self) -> None:
        if self.accelerated:
            torch.accelerator.synchronize(*self._which)

    def device_memory(self) -> int | None:
        # torch.cuda's and torch.tpu's device properties both carry total_memory (the HBM of one TPU
        # device: torch_tpu/_internal/device/_device_module.py, get_device_properties)
        return self._module.get_device_properties(*self._which).total_memory if self.accelerated else None

    def device_kind(self) -> str | None:
        return self.describe() if self.accelerated else None

    def peak_memory(self) -> int | None:
        return torch.accelerator.max_memory_allocated(*self._which) if self.accelerated else None


class _DeviceLoader:
    """Moves each batch of a DataLoader to the device; `split`, where given (the strategy's
    `input_sharding`: FSDP2 under a `context` axis), cuts it to this worker's part first."""

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device,
                 split: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> None:
        self.loader, self.device, self.split = loader, device, split

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            if self.split is not None:
                batch = self.split(batch)
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
