"""The public API for bringing your own training loop, in the spirit of HF Accelerate.

    engine = Engine(backend="auto")
    train_dl, eval_dl, model, optimizer = engine.prepare(train_dl, eval_dl, model, optimizer)
    for batch in train_dl:
        with engine.autocast():
            loss = model(**batch).loss
        engine.backward(loss)
        if engine.optimizer_step(optimizer):   # True when an optimizer step was taken
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

`launch(fn, args)` runs `fn` on every local TPU core / GPU / CPU worker; create the Engine
inside `fn` (it then uses the roles that launched the worker). The package's own job
(`xla_train.commands.train`) is written on this same API.

An Engine's roles are attributes: `engine.accelerator` (the device: seeds, host copies, counters,
profiles), `engine.strategy` (how work is split: mesh, data-parallel degree, model wrapping,
collectives, sharded checkpoints) and `engine.launcher`. Code that needs one asks it directly.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, overload

import torch
from tqdm.auto import tqdm
from transformers import DataCollatorWithPadding

from ..io.checkpoint_io import trained_state, whole_state
from ..kernels import router_loss
from ..parallel.mesh import Mesh
from .batching import BatchPlan, make_loader
from .errors import UserError, describe
from .hf import quiet_transformers
from .roles import Batch, PathLike, Roles, active_roles, optimizer_params
from .select import select_roles
from .shapes import even_buckets
from .ties import retie, ties


class Engine:
    """Picks the roles (accelerator, strategy, launcher) and adapts loaders, model and optimizer
    to them. One per worker."""

    # the norm of the last optimizer step's reduced gradients, a device tensor (see `optimizer_step`)
    last_grad_norm: torch.Tensor

    def __init__(self, backend: str | Roles = "auto", precision: str = "fp32", grad_accum: int = 1,
                 max_grad_norm: float | None = None, num_processes: int | None = None,
                 compile_cache: PathLike | None = None, strategy: str = "ddp", compile: bool = False,
                 tf32: bool = False, mesh: Mesh | None = None) -> None:
        """`mesh`: the axes beside the strategy's own (parallel.mesh.Mesh: tensor, expert, context
        sizes; None: none); inside `launch`, the one the workers were launched with."""
        roles = _engine_roles(backend, num_processes, strategy, mesh)
        self.accelerator, self.strategy, self.launcher = roles.accelerator, roles.strategy, roles.launcher
        if compile:
            roles.use_compile()  # prepare compiles the model: torch.compile on the torch-native backends
        roles.start()  # process groups, SPMD mode: before anything touches the device
        if tf32:
            self.accelerator.use_tf32()  # fp32 matrix products on TensorFloat-32 tensor cores (CUDA)
        if compile_cache:
            self.accelerator.use_compile_cache(compile_cache)  # before the first compilation
        self.precision, self.grad_accum, self.max_grad_norm = precision, grad_accum, max_grad_norm
        self._micro_steps = 0
        self._model: torch.nn.Module | None = None
        self._valid: torch.Tensor | None = None  # filler mask of the last batch a prepared loader yielded

    # --- who am I -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The torch.device this process computes on."""
        return self.accelerator.device

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def data_parallel_size(self) -> int:
        """Copies of the model that see different batches (the strategy's data axes; under SPMD,
        every device the processes feed). The metrics' and a checkpoint's `world_size`."""
        return self.strategy.data_parallel_size

    @property
    def replicas_per_process(self) -> int:
        """Replicas sharing this process and its counters (threads on Colab's TPU v2-8/v3-8)."""
        return self.strategy.replicas_per_process

    @property
    def is_main_process(self) -> bool:
        return self.strategy.is_main

    @property
    def is_host_main(self) -> bool:
        """Whether this worker is its host's first (the main process, on one host)."""
        return self.strategy.is_host_main

    @property
    def runtime(self) -> str:
        """The accelerator's name: "xla", "cuda" or "cpu"."""
        return self.accelerator.name

    def describe_device(self) -> str:
        return self.accelerator.describe()

    @property
    def fused_optimizer(self) -> bool:
        """Whether torch.optim's fused kernels (`fused=True`) run on this device."""
        return self.accelerator.fused_optimizer

    def seed(self, seed: int) -> None:
        """Seeds the host generator and the device's (dropout masks, sampling), the device's per
        data-parallel replica where each replica samples its own rows (Strategy.sampling_replica:
        the replica's index folded into the seed, as TRL's set_seed(..., device_specific=True));
        one seed under SPMD and within a tensor-parallel group."""
        self.accelerator.seed(seed, self.strategy.sampling_replica)

    def seed_micro_batch(self, seed: int, epoch: int, batch: int) -> None:
        """Seeds the device's generator for micro-batch `batch` of `epoch` (XLA; elsewhere the
        generator's saved state resumes exactly), per replica as `seed`. XLA's generator moves on
        at every graph cut, needed or not, so after a resume, whose cuts differ from the
        uninterrupted run's, its dropout masks would differ; seeded from the position they are the
        same."""
        self.accelerator.seed_micro_batch(seed, epoch, batch, self.strategy.sampling_replica)

    def print(self, *args: object, **kwargs: Any) -> None:
        """print() on the main process only, without breaking progress bars."""
        if self.is_main_process:
            tqdm.write(" ".join(str(a) for a in args), **kwargs)

    # --- prepare ------------------------------------------------------------------------
    def prepare(self, *objects: Any, trained: bool = True) -> Any:
        """Returns each object ready for the accelerator and strategy, in the order given.

        Modules go to the device (wrapped in DDP on several fallback workers); optimizers are
        re-pointed at the moved parameters (on XLA, `.to(device)` makes new Parameter objects);
        DataLoaders are sharded across replicas and yield batches already on the device. With
        `compile=True`, modules are then compiled in place (torch.compile, one graph per shape).
        The last module prepared is the one `accumulate` skips gradient syncs of, unless
        `trained=False` (a model only run, such as a reference model beside the trained one).
        """
        modules = [o for o in objects if isinstance(o, torch.nn.Module)]
        before = [list(m.parameters()) for m in modules]
        moved = {id(m): self._compiled(self._moved(self.accelerator.adapt_model(m))) for m in modules}
        if modules and trained:
            self._model = moved[id(modules[-1])]  # for no_sync on micro-steps
        remap = {}
        for m, old in zip(modules, before):
            remap.update({id(p): q for p, q in zip(old, self.strategy.unwrap_model(moved[id(m)]).parameters())})
        out = []
        for o in objects:
            if isinstance(o, torch.nn.Module):
                out.append(moved[id(o)])
            elif isinstance(o, torch.optim.Optimizer):
                for group in o.param_groups:
                    group["params"] = [remap.get(id(p), p) for p in group["params"]]
                out.append(o)
            elif isinstance(o, torch.utils.data.DataLoader):
                out.append(self._prepare_loader(o))
            else:
                out.append(o)
        return tuple(out) if len(out) > 1 else out[0]

    def _moved(self, model):
        """`model` on the device and wrapped by the strategy, its tied parameters one again (XLA's
        move unties them: core.ties)."""
        groups = ties(model)
        wrapped = self.strategy.wrap_model(model)
        retie(groups)
        return wrapped

    def _compiled(self, model):
        return self.accelerator.compile(model) if self.accelerator.compiling else model

    def _prepare_loader(self, loader):
        if (self.accelerator.static_shapes and isinstance(loader.collate_fn, DataCollatorWithPadding)
                and hasattr(loader.dataset, "with_format")):
            loader = _static_shape_loader(loader)
        # Each process that loads rows takes its own share of every global batch: a replica (ddp,
        # FSDP2; a tensor-parallel group's processes share one), or under SPMD each host's one
        # process (`row_shares`: the hosts; `row_share`: the process index), which loads the rows of
        # every device it feeds (its part of the data-parallel devices) and hands them to torch_xla
        # as its part of the global batch (XlaSpmd.input_sharding).
        loaders, share = self.strategy.row_shares, self.strategy.row_share
        plan = loader.batch_sampler
        if isinstance(plan, BatchPlan):
            plan.shard(loaders, share)
            plan.batch_size *= self.data_parallel_size // loaders  # the devices this process feeds
        elif loaders > 1:
            sampler: torch.utils.data.DistributedSampler[int]
            sampler = torch.utils.data.DistributedSampler(loader.dataset, loaders, share,
                                                          shuffle=not isinstance(loader.sampler,
                                                                                 torch.utils.data.SequentialSampler))
            loader = torch.utils.data.DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                                                 collate_fn=loader.collate_fn, drop_last=loader.drop_last)
        return PreparedLoader(loader, self.accelerator.wrap_loader(loader, self.strategy.input_sharding()), self)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.strategy.unwrap_model(model)

    # --- the step -----------------------------------------------------------------------
    def autocast(self) -> AbstractContextManager[Any]:
        """bf16 autocast on the device with precision="bf16"; a no-op for fp32."""
        return self.accelerator.autocast(self.precision)

    def checkpoint_activations(self, model: Any) -> Any:
        """Gradient checkpointing for a transformers model, before `prepare`: each block's
        activations are recomputed in the backward pass instead of kept (on XLA with torch_xla's
        checkpoint, which XLA does not undo)."""
        checkpoint_activations(model, self.accelerator.activation_checkpoint())
        return model

    def inference_mode(self) -> AbstractContextManager[Any]:
        """`torch.inference_mode()` where the device supports it, else `torch.no_grad()`; also
        `no_grad` where the parameters are sharded: FSDP2 allocates its unsharded parameters at the
        first forward pass, and made in inference mode (a pass before the first training step, as
        a preference kind's reference pass is) they could not be updated in place by training."""
        if self.strategy.param_shards > 1:
            return torch.no_grad()
        return self.accelerator.inference_mode()

    @property
    def sync_gradients(self) -> bool:
        """True when the next `optimizer_step` will step (the last micro-step of an accumulation)."""
        return (self._micro_steps + 1) % self.grad_accum == 0

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled for gradient accumulation; gradients are all-reduced once per
        optimizer step (DDP's no_sync on micro-steps; XLA reduces inside optimizer_step)."""
        loss = loss / self.grad_accum if self.grad_accum > 1 else loss
        if self.sync_gradients or self._model is None:
            loss.backward()
        else:
            with self.strategy.no_sync(self._model):
                loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Steps (all-reducing and clipping gradients) on accumulation boundaries.

        Returns True if it stepped. The norm of the all-reduced gradients (before clipping) is
        kept in `self.last_grad_norm`, computed every step so that it is part of the step's one
        graph on XLA; it is a device tensor: read it in a step closure, not in the loop.
        """
        boundary = self.sync_gradients
        self._micro_steps += 1
        if not boundary:
            return False
        norm = self.strategy.optimizer_step(optimizer, self.max_grad_norm)
        if norm is None:  # not clipped: the step leaves the reduced gradients in .grad
            norm = self.strategy.grad_norm(optimizer_params(optimizer))
        self.last_grad_norm = norm
        return True

    # --- across replicas ----------------------------------------------------------------
    def gather_for_metrics(self, tensors: torch.Tensor | Sequence[torch.Tensor], valid: torch.Tensor | None = None
                           ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Gathers 1-D tensors of one dtype from every replica to the host, dropping the rows
        that `valid` marks 0: the filler of the last short batch, so every evaluation row is
        counted exactly once. `valid` defaults to that of the last batch a prepared loader gave.

        One device-to-host transfer per call. Returns CPU tensors in the order given. Over a
        whole split, `gather_on_device` per batch and one `rows_to_host` at the end transfer once.
        """
        single = torch.is_tensor(tensors)
        cols = self.rows_to_host([self.gather_on_device(tensors, valid)])
        return cols[0] if single else cols

    def gather_on_device(self, tensors: torch.Tensor | Sequence[torch.Tensor], valid: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """`gather_for_metrics` without the transfer: every replica's rows of these 1-D tensors
        (and their `valid` mask) as one device tensor, for `rows_to_host`."""
        tensors = [tensors] if torch.is_tensor(tensors) else list(tensors)
        if valid is None:
            valid = self._valid if self._valid is not None else torch.ones_like(tensors[0])
        return self.strategy.gather_batch(torch.stack([*tensors, valid.to(tensors[0].dtype)], dim=1))

    def rows_to_host(self, parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The columns of `gather_on_device`'s results, in one transfer, filler rows dropped."""
        self.accelerator.cut_graph()  # the last batch's graph, if its loader has not cut it
        host = torch.cat(self.strategy.read(parts))  # one device-to-host transfer on XLA
        host = host[host[:, -1] != 0]
        return tuple(host[:, i] for i in range(host.shape[1] - 1))

    @overload
    def to_host(self, tensors: Sequence[torch.Tensor], main_only: Literal[False] = False) -> list[torch.Tensor]: ...

    @overload
    def to_host(self, tensors: Sequence[torch.Tensor], main_only: bool) -> list[torch.Tensor] | None: ...

    def to_host(self, tensors: Sequence[torch.Tensor], main_only: bool = False) -> list[torch.Tensor] | None:
        """Cuts the pending graph and copies device tensors to the CPU (one transfer on XLA).
        `main_only`: the main replica, which writes files, gets the copies; the others cut their
        graph at the same point, so every replica keeps running the same graphs, and get None."""
        return self.strategy.to_host(tensors, main_only)

    def to_writer(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """`to_host(tensors, main_only=True)` (kept for models.py)."""
        return self.strategy.to_host(tensors, main_only=True)

    def step_closure(self, fn: Callable[..., object], args: Sequence[Any] = ()) -> None:
        """Runs `fn(*args)` on the host once the current step has run (at once when eager):
        logging that never makes the loop wait for the device."""
        self.accelerator.step_closure(fn, args)

    def synchronize(self) -> None:
        """Waits for all queued device work (for honest timings)."""
        self.accelerator.synchronize()

    def cut_graph(self) -> None:
        """Ends the pending graph (XLA): what comes next compiles, and is cached, on its own."""
        self.accelerator.cut_graph()

    def wait_for_everyone(self) -> None:
        self.strategy.barrier()

    # --- observability ------------------------------------------------------------------
    def compile_stats(self) -> dict[str, Any] | None:
        """A snapshot of the process's compilation counters, or None where nothing compiles."""
        return self.accelerator.compile_stats()

    def peak_memory(self) -> int | None:
        """The most bytes the device held so far, or None where the device cannot measure it."""
        return self.accelerator.peak_memory()

    def trace_compilations(self, path: PathLike) -> str | None:
        """Sends the cause and Python frames of every compilation to `path` (see Accelerator)."""
        return self.accelerator.trace_compilations(path)

    def save_pretrained(self, model: torch.nn.Module, tokenizer: Any, path: PathLike) -> None:
        """`save_pretrained` of the unwrapped model and tokenizer. A whole model's weights go to
        the CPU and into transformers' safetensors files (`shard_plan`: one file, or files of
        `SHARD_SIZE` and their index) one file at a time, so a host never holds more of them than
        a file's (sharded weights are made whole one tensor at a time); a model whose weights
        transformers converts on saving (stacked experts) is saved by transformers itself, whole.
        A peft model saves its adapter (only the trained tensors are copied) and the classifier's
        config beside it (its labels)."""
        model = self.unwrap_model(model)
        hf: Any = model  # a transformers PreTrainedModel, or a peft model around one
        adapter = hasattr(model, "peft_config")
        state = trained_state(model) if adapter else whole_state(model)
        split = None if adapter else shard_plan(model, state)
        what = f"cannot save the model to {path}"
        weights = None
        if split is not None:  # file by file: only the config is left to write
            for name, keys in split.filename_to_tensors.items():
                copies = self.to_host([state[k] for k in keys], main_only=True)
                self.on_main(functools.partial(save_file, dict(zip(keys, copies or [])), Path(path, name)), what)
        else:
            weights = self.to_host(list(state.values()), main_only=True)

        def write() -> None:
            card = Path(path, "README.md")
            had_card = card.exists()
            with quiet_transformers(), self.strategy.plain_modules(model), router_loss.as_loaded(model):
                if split is not None:
                    write_config(hf, path, split)
                else:
                    assert weights is not None  # on the main replica, which got the copies
                    hf.save_pretrained(path, state_dict=dict(zip(state, weights)), max_shard_size=SHARD_SIZE)
                if adapter:  # the head's config beside the adapter, named as the trained class (predict reads it)
                    base = hf.get_base_model()
                    base.config.architectures = trained_architectures(base)
                    base.config.save_pretrained(path)
                tokenizer.save_pretrained(path)
            if adapter and not had_card:
                card.unlink(missing_ok=True)  # peft's model card: the folder holds the run's files and the user's only

        self.on_main(write, what)

    def on_main(self, write: Callable[[], object], what: str) -> None:
        """Runs `write()` on the main replica only; every replica learns whether it worked, and
        all raise a UserError if not (this keeps them together until the files are whole). Any
        error counts, not only OSError (a SafetensorError, a Cloud Storage transport error): a
        replica that failed alone would leave the others waiting in the next collective. A bug
        (a TypeError, say) is shared too, but its traceback is printed here first and every
        replica exits 1."""
        self._shared_outcome(write if self.is_main_process else None, what)

    def on_every(self, write: Callable[[], object], what: str) -> None:
        """`on_main`, with `write()` run by every process (each writes its own part: a host's
        shards); the first failing process's error is every one's."""
        self._shared_outcome(write, what)

    def _shared_outcome(self, write: Callable[[], object] | None, what: str) -> None:
        error, code = None, 2
        if write is not None:
            try:
                write()
            except UserError as e:
                error, code = str(e), e.exit_code
            except OSError as e:  # a full disk, a folder removed under the run
                error = f"{what}: {e.strerror or e}"
            except Exception as e:  # broad on purpose (see on_main): the failure must reach every replica
                error = f"{what}: {describe(e)}"
                if isinstance(e, _BUGS):
                    traceback.print_exc()  # in the process that has it
                    code = 1
        if self.strategy.peers == 1:
            if error is not None:
                raise UserError(error, code)
            return
        # the exit code and the message's first bytes, a row from each process (under SPMD, once
        # for every device it feeds), all of them copied to every process, which takes the first
        # failure's
        payload = torch.zeros(1 + _MESSAGE_BYTES, dtype=torch.int32)
        if error is not None:
            data = error.encode()[:_MESSAGE_BYTES]
            payload[0], payload[1:1 + len(data)] = code, torch.tensor(list(data), dtype=torch.int32)
        (rows,) = self.to_host([self.strategy.gather_rows(payload)])
        failed = [row for row in rows if row[0]]
        if failed:
            raise UserError(bytes(failed[0][1:].tolist()).rstrip(b"\0").decode(errors="replace"), int(failed[0][0]))


_MESSAGE_BYTES = 512  # of a failure's line, shared with the other replicas (after its exit code)
# What only a bug in the package raises from a write: on_main prints its traceback
_BUGS = (TypeError, AttributeError, NameError, LookupError, AssertionError, ZeroDivisionError)


class PreparedLoader:
    """A prepared DataLoader: iterates device batches; `set_epoch` reshuffles like a sampler.

    The batch plan's `valid` mask (0 for filler rows) is taken out of each batch, so batches
    hold only model inputs, and kept on the Engine for `gather_for_metrics`.
    """

    def __init__(self, loader: torch.utils.data.DataLoader, device_iterable: Iterable[Batch], engine: Engine
                 ) -> None:
        self.loader, self._iterable, self._engine = loader, device_iterable, engine

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Reshuffles for `epoch`; `start` > 0 skips that many batches (a `BatchPlan` loader only)."""
        if start:
            plan = self.loader.batch_sampler
            assert isinstance(plan, BatchPlan), "set_epoch(start=...) needs a BatchPlan loader"
            plan.set_epoch(epoch, start)
            return
        for s in (self.loader.batch_sampler, self.loader.sampler):
            set_epoch = getattr(s, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        for batch in self._iterable:
            self._engine._valid = batch.pop("valid", None)
            yield batch


def _static_shape_loader(loader):
    """The same data as a DataLoader with per-batch padding (DataCollatorWithPadding), rebuilt
    with fixed shapes for XLA: rows grouped by length, padded to multiples of 32, full batches."""
    ds, tokenizer = loader.dataset, loader.collate_fn.tokenizer
    lengths = [len(ids) for ids in ds.with_format(None)["input_ids"]]
    shuffle = not isinstance(loader.sampler, torch.utils.data.SequentialSampler)
    return make_loader(ds, tokenizer, loader.batch_size, even_buckets(lengths),
                       shuffle=shuffle, seed=torch.initial_seed(), fill="repeat" if shuffle else "mask",
                       lengths=lengths)


def _engine_roles(backend, num_processes, strategy, mesh=None):
    """The roles an Engine uses: the launching ones inside `launch`, else new ones."""
    if isinstance(backend, Roles):
        return backend
    active = active_roles()
    if active is None:
        return select_roles(backend, num_processes, strategy, mesh)
    if backend not in ("auto", active.name):
        raise UserError(f"Engine(backend={backend!r}) inside a worker launched with the {active.name} backend")
    if mesh not in (None, active.strategy.axes):
        raise UserError(f"Engine(mesh={mesh}) inside a worker launched with mesh {active.strategy.axes}: "
                        "pass it to launch")
    return active


def launch(fn: Callable[..., object], args: Sequence[Any] = (), backend: str = "auto",
           num_processes: int | None = None, strategy: str = "ddp", mesh: Mesh | None = None) -> None:
    """Runs `fn(*args)` on every local worker of `backend` (xmp.spawn on TPU; one process per GPU
    or `num_processes` gloo workers on the fallback; in this process when there is one), their
    devices laid out as `mesh` says (parallel.mesh.Mesh)."""
    select_roles(backend, num_processes, strategy, mesh).launch(fn, args)


def notebook_launcher(fn: Callable[..., object], args: Sequence[Any] = (), backend: str = "auto",
                      num_processes: int | None = None, strategy: str = "ddp", mesh: Mesh | None = None) -> None:
    """`launch` for a notebook cell: workers are forked, so `fn` may be defined in the notebook.
    Call it before the notebook itself has put anything on an accelerator."""
    select_roles(backend, num_processes, strategy, mesh).launch(fn, args, start_method="fork")


def checkpoint_activations(model: Any, checkpoint: Callable[..., Any] | None = None) -> None:
    """--gradient-checkpointing: transformers' own switch (every block checkpointed, the
    embeddings' output made to require grad so a frozen base still back-propagates), with
    `checkpoint` in place of torch.utils.checkpoint where the backend needs its own (XLA)."""
    if not model.supports_gradient_checkpointing:
        raise UserError(f"`gradient_checkpointing`: {type(model).__name__} does not support it")
    # activation_checkpointing_enable from transformers 5.24; gradient_checkpointing_enable before
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    if checkpoint is not None:  # the one hook that takes another function (private, as the Trainer's TPU path uses)
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint)


SHARD_SIZE = "5GB"  # a saved model's files at most: the hub's usual size (transformers 5 writes 50 GB files)


def shard_plan(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> Any:
    """How transformers' `save_pretrained` would split `state` (a whole model's, ties once) into
    files of SHARD_SIZE (huggingface_hub's `split_torch_state_dict_into_shards`, as transformers
    calls it, on shape-only copies), or None where transformers would change the weights on saving
    (`revert_weight_conversion`: experts stacked on loading are split again), which then saves."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    shapes = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    kept = remove_tied_weights_from_state_dict(dict(shapes), model)
    reverted = revert_weight_conversion(model, dict(kept))
    if reverted.keys() != kept.keys() or kept.keys() != shapes.keys() \
            or any(reverted[k].shape != kept[k].shape for k in kept):
        return None
    return split_torch_state_dict_into_shards(reverted, filename_pattern="model{suffix}.safetensors",
                                              max_shard_size=SHARD_SIZE)  # in transformers' order


def save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def trained_architectures(model: Any) -> list[str]:
    """The config's `architectures` of a trained `model`: its class (a checkpoint's own name may be
    a bare encoder's, BertModel, under the head the task put on it); FSDP2 renames the class."""
    return [type(model).__name__.removeprefix("FSDP")]


def write_config(model: Any, path: PathLike, split: Any) -> None:
    """What transformers' `save_pretrained` writes beside the weights of a model saved file by file:
    the sharded files' index, the config (with its dtype and architecture) and the generation
    config."""
    import json

    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        Path(path, "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = trained_architectures(model)
    model.config.save_pretrained(path)
    if model.can_generate():
        model.generation_config.save_pretrained(path)
