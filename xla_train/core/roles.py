"""The roles a run is made of, apart: the device it computes on (`Accelerator`), how the work is
split over devices and processes (`Strategy`) and how those processes start (`Launcher`), as
Lightning Fabric separates them. `Roles` composes one of each; `xla_train.core.select` picks them.

This module imports no implementation (only the mesh's value, parallel.mesh). Implementations:
`xla_train.core.xla` (torch_xla's accelerator), `xla_train.parallel.xla_strategies` (its XlaDdp,
XlaSpmd and XlaFsdp strategies), `xla_train.parallel.launchers` (xmp.spawn's
replicas, one process per host) and, in `gpu_fallback`, the torch-native accelerator (CUDA, the
CPU), the Ddp and Fsdp2 strategies and torch.multiprocessing's launcher. Nothing outside those
files imports torch_xla or torch.distributed, and nothing else branches on a kind: where kinds
differ, the difference is an attribute or a method here.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ..parallel.mesh import Mesh
from .errors import UserError

# A batch as a loader yields it: model inputs (and a prepared loader's `valid` mask) by name
Batch = dict[str, Any]
# What a checkpointed or profiled file's path may be given as
PathLike = str | os.PathLike[str]

_active: Roles | None = None  # the roles `launch` started this worker process with (see `Roles.run_worker`)


def active_roles() -> Roles | None:
    """The roles of the launch this process is a worker of, or None outside `launch`."""
    return _active


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, in the order `optimizer.state_dict()` numbers its states."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks `model` declares (transformers' `_no_split_modules`): FSDP's units,
    each gathered for its own forward and backward only."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shaped_like(value: object, param: torch.Tensor) -> bool:
    """Whether an optimizer state `value` is a moment of `param` (AdamW's two): a tensor of the
    parameter's shape, laid out like it when the parameter is sharded; steps and scalars are not."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


@dataclass(frozen=True)
class Kernel:
    """A kernel that keeps packed documents apart (kernels.attention) on one kind of device
    (kernels.attention.kind_of's names), as that device's implementation declares it (`serve`):
    core.xla for torch_xla's TPUs, gpu_fallback for CUDA and the CPU."""

    path: str  # one of kernels.attention.PATHS
    auto: bool  # whether `attention="auto"` takes it on that device
    # why it cannot serve rows of `length` tokens (None: not known yet) with heads `head_dim` wide, or None
    refusal: Callable[[int | None, int | None], str | None] | None = None
    softcap: bool = True  # whether it soft-caps scores (Gemma 2's attn_logit_softcapping)
    round_up: Callable[[int], int] | None = None  # the shortest row length it serves from `length` on
    # which of the path's kernels serves one layer, and at what cost: layer(length, head_dim, window, softcap,
    # sinks) -> LayerPlan, with `window` a sliding window shorter than the row (else None), `softcap` the
    # scores' cap (else None), `sinks` whether the softmax has learned sinks (gpt-oss). None: the path serves
    # every layer the model-wide checks let through (flex), and takes no sinks
    layer: Callable[[int, int | None, int | None, float | None, bool], LayerPlan] | None = None


@dataclass(frozen=True)
class LayerPlan:
    """Which kernel serves one attention layer (Kernel.layer): its name, or None with the reason where none
    does (that layer takes the mask path), and its cost: matrix products per head of a row, forward and
    backward (score entries times head_dim), a first-order count."""

    kernel: str | None
    reason: str | None
    cost: int


KERNELS: dict[tuple[str, str], Kernel] = {}  # (device kind, path) -> the kernel, as the implementations declare them


def serve(kind: str, kernel: Kernel) -> None:
    """Declares that `kind` devices run `kernel` (an implementation calls it once, at import)."""
    KERNELS[(kind, kernel.path)] = kernel


class Accelerator(ABC):
    """The device one process computes on: its torch.device, its costs and counters, its random
    generators, and how tensors reach it and come back."""

    name: str  # "xla" | "cuda" | "cpu"
    # Rough costs for `--buckets auto` (see shapes.CostModel); accelerators override them.
    compile_seconds: float = 0.0
    token_seconds: float = 1e-5
    # torch.optim's fused kernels (`fused=True`) exist for the CPU and CUDA, not for XLA, which
    # traces the default multi-tensor update into the step's one graph anyway.
    fused_optimizer: bool = False
    # Whether every new input shape costs a compilation: DataLoaders padded per batch
    # (DataCollatorWithPadding) are then rebuilt with a few fixed shapes by `Engine.prepare`.
    static_shapes: bool = False
    # --compile (`Roles.use_compile`): why this device refuses it, or None where it compiles the
    # model with torch.compile; `compiling` once a run asked for it
    compile_refusal: str | None = "it applies to the torch-native backends (cuda, tpu, cpu)"
    compiling: bool = False

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """This process's torch.device."""

    def describe(self) -> str:
        return str(self.device)

    def kernel_kind(self) -> str:
        """The kind its tensors are (kernels.attention.kind_of's names: the KERNELS it runs), told
        without touching the device."""
        return self.name

    def setup(self) -> None:
        """Called in each worker before anything touches the device."""

    def adapt_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as this device runs it best, before a strategy places it (XLA: its attention)."""
        return model

    def use_compile(self) -> None:
        """--compile: from now on `compile` is applied to prepared models (see `Roles.use_compile`)."""
        self.compiling = True

    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """--compile: the model, already placed and wrapped by the strategy, compiled."""
        raise NotImplementedError

    @abstractmethod
    def wrap_loader(self, loader: torch.utils.data.DataLoader, sharding: Any = None) -> Iterable[Batch]:
        """An iterable over `loader`'s batches, already on the device (laid out by `sharding`,
        the strategy's input sharding, where the device takes one)."""

    def use_compile_cache(self, path: PathLike) -> None:
        """Keeps compiled graphs in `path` across runs, where the device compiles anything (XLA:
        its persistent cache; the torch-native devices under `compile`: torch.compile's caches).
        Called before the first compilation of the process."""
        raise UserError(f"`compile_cache` applies where graphs are compiled: the xla backend, or `compile` on "
                        f"the torch-native backends, not {self.name}")

    def use_tf32(self) -> None:
        """TensorFloat-32 tensor cores for fp32 matrix products (the HF Trainer's `tf32`), where
        the device has them; a UserError elsewhere."""
        raise UserError(f"`tf32` applies to the cuda backend (TensorFloat-32 tensor cores), not {self.name}")

    def inference_mode(self) -> AbstractContextManager[Any]:
        """A context for forward passes whose results are never differentiated."""
        return torch.inference_mode()

    def activation_checkpoint(self) -> Callable[..., Any] | None:
        """The function that recomputes a checkpointed block in the backward pass, or None for
        transformers' own (torch.utils.checkpoint)."""
        return None

    def autocast(self, precision: str) -> AbstractContextManager[Any]:
        """A context for the forward pass: bf16 autocast, or a no-op for fp32."""
        if precision == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # --- to the host ------------------------------------------------------------------------
    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies a list of device tensors to the CPU (one device-to-host transfer on XLA)."""
        return [t.detach().cpu() for t in tensors]

    def read(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies tensors that are already computed (e.g. in a step closure) to the CPU, in one
        device-to-host transfer on XLA, without cutting the graph."""
        return [t.detach().cpu() for t in tensors]

    def step_closure(self, fn: Callable[..., object], args: Sequence[Any] = ()) -> None:
        """Runs `fn(*args)` once the current step's tensors are computed (at once when eager)."""
        fn(*args)

    def synchronize(self) -> None:
        """Waits until all queued device work is done (for honest timings)."""

    def cut_graph(self) -> None:
        """Ends the pending lazy graph here, so what is built next is a graph of its own (XLA;
        nothing to do when eager)."""

    # --- random state -----------------------------------------------------------------------
    def seed(self, seed: int, replica: int = 0) -> None:
        """Seeds the host generator from `seed` and the device's from `seed + replica`, `replica`
        this process's data-parallel replica (Strategy.sampling_replica), so that replicas draw
        their own dropout masks and samples, as TRL's set_seed(seed, device_specific=True) seeds
        each process. On the CPU the host generator is the device's: `seed + replica`."""
        torch.manual_seed(seed + replica)

    def seed_micro_batch(self, seed: int, epoch: int, batch: int, replica: int = 0) -> None:
        """See Engine.seed_micro_batch: nothing to do where the generator's state is restored exactly."""

    def rng_state(self) -> torch.Tensor:
        """This process's random state (host generator, plus the device's) as a 1-D uint8 tensor."""
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state[: len(torch.get_rng_state())].clone())

    # --- observability ----------------------------------------------------------------------
    def start_profile(self, folder: PathLike, run: str) -> Any:
        """Starts capturing a profile into local `folder`; returns the session for `stop_profile`.
        `run` names the capture alike on every host (XLA: the profile plugin's run folder)."""
        import torch.profiler as tp

        # the device's own Kineto activity: CUDA's, or PrivateUse1's for TorchTPU's tpu, whose Kineto
        # backend torch_tpu 0.2.0 registers at load (_loader.py's _init_device_impl calls its
        # profiler's register_kineto_backend)
        device = {"cuda": tp.ProfilerActivity.CUDA, "tpu": tp.ProfilerActivity.PrivateUse1}.get(self.device.type)
        activities = [tp.ProfilerActivity.CPU] + ([device] if device else [])
        session = tp.profile(activities=activities, on_trace_ready=tp.tensorboard_trace_handler(str(folder)),
                             record_shapes=True)
        session.start()
        return session

    def stop_profile(self, session: Any) -> None:
        self.synchronize()  # the window's queued device work belongs in it
        session.stop()

    def step_annotation(self, step: int) -> AbstractContextManager[Any]:
        """A context that marks a micro-batch of optimizer step `step` in the profile; it must
        change nothing the device runs."""
        return torch.profiler.record_function(f"train_step_{step}")

    def device_memory(self) -> int | None:
        """Bytes of memory of this process's device, or None where the device cannot tell."""
        return None

    def device_kind(self) -> str | None:
        """The device's model as its runtime names it ("TPU v5 lite", "NVIDIA H100 80GB HBM3"), or
        None (a CPU): what core.peaks looks its peak FLOP/s up by."""
        return None

    def peak_memory(self) -> int | None:
        """The most bytes the device held so far, or None where the device cannot measure it."""
        return None

    def compile_stats(self) -> dict[str, Any] | None:
        """A snapshot of compilation counters, or None where nothing is compiled."""
        return None

    def trace_compilations(self, path: PathLike) -> str | None:
        """Asks the runtime to append the cause and Python frames of every compilation to `path`.
        Returns the file the analyses go to, or None where nothing is compiled or it is too late
        (it must be called before the first compilation of the process)."""
        return None


class Strategy(ABC):
    """How the work is split: over which devices and processes, along which named mesh axes, how
    the model is wrapped, how gradients are reduced and how sharded state is read and written.
    One per process, on one accelerator (`self.accelerator`)."""

    # The mesh's first axis, which every mesh of this strategy has: `data` (replicas) or `fsdp`
    # (the parameters split, `sharded`: what the named axes leave of the devices goes to it)
    main_axis: str = "data"
    sharded: bool = False
    devices_named = "devices"  # what a refusal calls the devices the mesh is laid over
    # Checkpoints of this host's shards (FSDPv2, FSDP2), instead of whole copies that one process
    # writes: on several hosts no host can read another's shards.
    writes_shards: bool = False
    # The model built without its pretrained weights, which `wrap_model` reads into their shards
    # (FSDPv2 on XLA: job.pretrained, parallel.sharded_load).
    loads_shards: bool = False
    compile_refusal: str | None = None  # why --compile does not run with this strategy, or None

    def __init__(self, accelerator: Accelerator, mesh: Mesh | None = None) -> None:
        """`mesh`: the axis sizes the run asks for (parallel.mesh; None: data or fsdp alone)."""
        self.accelerator = accelerator
        self.axes = mesh or Mesh()

    def setup(self) -> None:
        """Called in each worker before anything touches the device (process groups and such)."""

    def teardown(self) -> None:
        """Called in each worker once the function has returned (process groups go)."""

    # --- topology ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Processes (XLA: replicas) that train together and exchange gradients."""
        return 1

    @property
    def rank(self) -> int:
        return 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_host_main(self) -> bool:
        """Whether this worker is its host's first (one per host: each host's profile)."""
        return self.is_main

    @property
    def devices_per_process(self) -> int:
        """Devices that one process feeds (more than 1 only for SPMD)."""
        return 1

    @property
    def replicas_per_process(self) -> int:
        """Replicas sharing this process, and so its counters (Colab's threaded replicas)."""
        return 1

    @property
    def peers(self) -> int:
        """The processes of the job, each with its own signals: the replicas (under SPMD, one
        process per host). They agree on a stop; Engine's loaders split the rows over their
        `row_shares`."""
        return self.world_size

    @property
    def row_shares(self) -> int:
        """The processes that load different rows of every batch: the peers, except that the
        processes of one tensor-parallel group (FSDP2 with `tensor_parallel`) load the same rows."""
        return self.peers

    @property
    def row_share(self) -> int:
        """Which of the `row_shares` this process loads."""
        return self.rank

    @property
    def sampling_replica(self) -> int:
        """Which replica's random stream this process draws (Accelerator.seed: dropout masks,
        sampled tokens): its `row_share` where each replica is a program of its own on rows of its
        own (ddp, DDP, FSDP2; a tensor-parallel group's processes draw alike, as they hold the same
        rows); 0 with one replica (world size 1: SPMD and FSDPv2, where one program samples every
        row and each host's process must draw as the others)."""
        return self.row_share if self.world_size > 1 else 0

    def layout(self) -> Mesh:
        """The mesh asked for (`axes`) laid over every device of the job, each axis sized."""
        return self.axes.resolve(self.world_size * self.devices_per_process, self.sharded, self.devices_named)

    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """The mesh as ((axis name, size), ...): every device of the job."""
        return self.layout().shape(self.main_axis)

    @property
    def data_parallel_size(self) -> int:
        """Devices that see different rows of a batch (the row axes of the mesh)."""
        return self.layout().rows

    def planned_data_parallel_size(self, launcher: Launcher) -> int:
        """`data_parallel_size` in the launching process, before `launch` and without starting any
        runtime (the parent must not start XLA's before xmp.spawn forks the replicas)."""
        return self.axes.resolve(self.planned_devices(launcher), self.sharded, self.devices_named).rows

    def planned_devices(self, launcher: Launcher) -> int:
        """Every device of the job, counted in the launching process (see above)."""
        return launcher.planned_replicas()

    def input_sharding(self) -> Any:
        """How a batch is laid over the process's devices (None: the batch on its one device)."""
        return None

    # --- model ------------------------------------------------------------------------------
    @abstractmethod
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Places `model` on the device(s) and wraps it for this strategy."""

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def plain_modules(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        """A context in which the unwrapped `model`'s module names are the model's own, for a
        library that reads them (peft's save of an adapter); only FSDPv2 renames them."""
        return nullcontext(model)

    def check_model(self, config: Any, lora: bool = False) -> None:
        """Refuses, in one line (UserError), a model of `config` (with LoRA adapters if `lora`)
        that this strategy cannot split, before anything loads."""

    @property
    def param_shards(self) -> int:
        """Devices each parameter, gradient and optimizer state is split over (FSDP: every one)."""
        return 1

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor computed from sharded parameters as the whole result (FSDP2: a collective that
        every replica calls); others as they are."""
        return tensor

    def split_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (rows first) laid out as a batch's rows are (SPMD: split over the row axes, the
        rest whole); elsewhere, where a process's rows are on its own device, as it is."""
        return tensor

    def load_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Puts weights (a state dict on the CPU: whole, or a model's trained tensors only, see
        checkpoint.trained_state) into a prepared model."""
        result = self.unwrap_model(model).load_state_dict(weights, strict=False)  # the frozen ones stay
        assert not result.unexpected_keys, result.unexpected_keys[:3]

    # --- the step ---------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        """A context for micro-steps whose gradients must not be all-reduced yet."""
        return nullcontext()

    @abstractmethod
    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None
                       ) -> torch.Tensor | None:
        """All-reduces gradients across replicas (once), optionally clips, then steps. Returns
        the norm of the reduced gradients when it clipped, else None."""

    def grad_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The norm of `params`' gradients (those that have one), over every shard."""
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    # --- across replicas --------------------------------------------------------------------
    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenates `tensor` (same shape on every replica) along dim 0 across replicas."""
        return tensor

    def gather_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """`gather` of a batch's rows: each of the `row_shares` once (a tensor-parallel group's
        processes hold the same rows, FSDP2's gathers them from one of its processes)."""
        return self.gather(tensor)

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every peer's `row` (a 1-D host tensor) as rows of one device tensor, for a reduction
        over dim 0 on the device (under SPMD a process's row comes once per device it feeds)."""
        return self.gather(row[None].to(self.accelerator.device))

    def barrier(self) -> None:
        """Waits until every replica reaches it (nothing to wait for with one)."""

    def to_host(self, tensors: Sequence[torch.Tensor], main_only: bool = False) -> list[torch.Tensor] | None:
        """Cuts the pending graph and copies device tensors to the CPU (one transfer on XLA).
        `main_only`: only the main replica, which writes files, gets the copies; the others cut
        their graph at the same point, so every replica keeps running the same graphs, and get
        None. (FSDP: every replica takes part in gathering the shards.)"""
        if not main_only or self.is_main:
            return self.accelerator.to_host(tensors)
        self.accelerator.cut_graph()
        return None

    def read(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`Accelerator.read` of tensors laid out by this strategy."""
        return self.accelerator.read(tensors)

    # --- sharded checkpoints (writes_shards) ------------------------------------------------
    def place_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Lays an optimizer state just loaded from a checkpoint out like its parameters (FSDP)."""

    def save_shards(self, tensors: dict[str, torch.Tensor], folder: PathLike) -> None:
        """Writes this host's shards of `tensors` (a dict of device tensors) into `folder`."""
        raise NotImplementedError

    def load_shards(self, tensors: dict[str, torch.Tensor], folder: PathLike) -> None:
        """Loads this host's shards from `folder` into `tensors` (a dict of device tensors laid
        out as when they were saved), in place."""
        raise NotImplementedError

    def zeros_like_param(self, param: torch.Tensor) -> torch.Tensor:
        """Zeros of `param`'s shape and dtype on the device, laid out like it (a template that
        `load_shards` fills)."""
        raise NotImplementedError


class Launcher(ABC):
    """How the job's processes start on this host, and what runs in each."""

    start_method: str = "spawn"  # torch.multiprocessing's, where processes are started

    @abstractmethod
    def launch(self, roles: Roles, fn: Callable[..., object], args: Sequence[Any], start_method: str) -> None:
        """Runs `fn(*args)` once on every local worker and waits for all of them, each worker
        through `roles.run_worker`. `start_method` "fork" lets a notebook's own functions run in
        the workers."""

    @abstractmethod
    def planned_replicas(self) -> int:
        """In the launching process, before `launch` and without starting any runtime: how many
        replicas (processes, or XLA's replica threads) the job will have on every host."""

    def host_position(self) -> tuple[int, int]:
        """In the launching process, before `launch`: (this host's index, the number of hosts)
        that start the job together (a TPU pod's hosts); (0, 1) on one host."""
        return 0, 1

    def run_worker(self, roles: Roles, fn: Callable[..., object], args: Sequence[Any] = ()) -> None:
        """In each worker: `roles` become the process's (an `Engine` made inside `fn` uses them),
        are set up, run `fn(*args)` and are torn down."""
        with roles.activated():
            fn(*args)
        roles.teardown()


class Roles:
    """One accelerator, one strategy (on that accelerator) and one launcher: a run's setup, not yet
    started (no runtime, no process group) until `start`. One per worker process."""

    _started = False

    def __init__(self, accelerator: Accelerator, strategy: Strategy, launcher: Launcher) -> None:
        self.accelerator, self.strategy, self.launcher = accelerator, strategy, launcher

    @property
    def name(self) -> str:
        return self.accelerator.name

    def planned_data_parallel_size(self) -> int:
        """In the launching process, before `launch` and without starting any runtime: how many
        devices will train in data parallel (every replica on every host, SPMD's devices too)."""
        return self.strategy.planned_data_parallel_size(self.launcher)

    def host_position(self) -> tuple[int, int]:
        return self.launcher.host_position()

    def use_compile(self) -> None:
        """--compile, checked before any work: `Engine.prepare` compiles the model it places (one
        line, a UserError, where the device or the strategy does not support it)."""
        refusal = self.accelerator.compile_refusal or self.strategy.compile_refusal
        if refusal:
            raise UserError(f"`compile`: {refusal}")
        self.accelerator.use_compile()

    def launch(self, fn: Callable[..., object], args: Sequence[Any] = (), start_method: str | None = None) -> None:
        """Runs `fn(*args)` on every local worker (see `Launcher.launch`)."""
        self.launcher.launch(self, fn, args, start_method or self.launcher.start_method)

    def run_worker(self, fn: Callable[..., object], args: Sequence[Any] = ()) -> None:
        self.launcher.run_worker(self, fn, args)

    @contextmanager
    def activated(self) -> Iterator[Roles]:
        """These roles as the process's (`active_roles()`), set up, for the block."""
        global _active
        _active = self
        try:
            self.start()
            yield self
        finally:
            _active = None

    def start(self) -> None:
        """Sets the accelerator, then the strategy, up once per process (an Engine made outside
        `launch` calls it too)."""
        if not self._started:
            self._started = True
            self.accelerator.setup()
            self.strategy.setup()

    def teardown(self) -> None:
        self.strategy.teardown()


@contextmanager
def dcp_errors() -> Iterator[None]:
    """torch.distributed.checkpoint without its warnings (that no process group is used, on
    purpose: each host or worker writes and reads its own shards, `Strategy.save_shards`; torch's
    TypedStorage deprecation, once per tensor), and with its failure as the error that caused it
    (a full disk, a damaged file): it wraps them in a CheckpointException, which is a
    BaseException, not an Exception."""
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            yield
        except CheckpointException as e:
            raise next(exc for exc, _ in e.failures.values()) from None
