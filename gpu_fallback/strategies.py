"""The torch-native strategies: DDP, and torch's FSDP2 (`fully_shard`), over a torch.distributed
process group (NCCL on CUDA, gloo on the CPU) or in one process.

    xla-train train --backend cuda --strategy fsdp      # the model sharded over the GPUs (FSDP2)
    xla-train train --backend cpu --strategy fsdp --num-processes 2
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from xla_train.core.errors import UserError
from xla_train.core.roles import PathLike, Strategy, blocks_of, dcp_errors, optimizer_params, shaped_like
from xla_train.core.ties import retie, ties
from xla_train.kernels import context
from xla_train.kernels.attention import unwrapped
from xla_train.kernels.experts import expert_refusal
from xla_train.parallel import sharded_load
from xla_train.parallel import tensor_parallel as tensor_plan
from xla_train.parallel.mesh import Mesh

from .launcher import launched_by_torchrun

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedModel

    from .device import TorchAccelerator


class TorchStrategy(Strategy):
    """What DDP and FSDP2 share: the process group (one process per device), its collectives,
    and the step (gradients are reduced during backward)."""

    accelerator: TorchAccelerator  # select.py pairs these strategies with the torch-native accelerator only

    def setup(self) -> None:
        if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
            dist.init_process_group(self.accelerator.process_group)

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.barrier()  # no replica leaves while another still talks to it
            dist.destroy_process_group()

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None
                       ) -> torch.Tensor | None:
        norm = None  # DDP averaged the gradients during backward
        if max_grad_norm:
            norm = torch.nn.utils.clip_grad_norm_(optimizer_params(optimizer), max_grad_norm)
        optimizer.step()
        return norm

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _all_gather(tensor, self.world_size)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


class Ddp(TorchStrategy):
    """Plain torch data parallel: DDP across processes (one per device), or one process."""

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        device = self.accelerator.device
        model = model.to(device)
        if self.world_size > 1:
            # DDP broadcasts rank 0's parameters, so every replica starts identical. device_ids: CUDA's
            # device of this process; none on the CPU, nor on TorchTPU, whose workers each see their one
            # chip as the current device (its tutorial docs/notebooks/distributed_training_101.py: "we
            # don't pass device_ids to DDP")
            model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return model

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else nullcontext()


class Fsdp2(TorchStrategy):
    """torch's FSDP2 in place of DDP: every parameter, gradient and AdamW moment is a DTensor
    sharded on dim 0 over the workers (the mesh's `fsdp` axis); each transformer block the model
    declares (`_no_split_modules`) is gathered for its forward and backward only, then the rest.

    With a mesh's `tensor` axis N the workers form a mesh (fsdp, W/N) x (tensor, N), tensor peers on
    neighbouring ranks: each block's projections are first split over `tensor` by the model's own
    plan with transformers' own styles (`_resolve_parallel_plans`, `apply_tensor_parallelism`:
    transformers/distributed/tensor_parallel.py, as `from_pretrained(distributed_config=...)` does),
    then FSDP2 shards every parameter over `fsdp`. A tensor group's workers see the same rows.

    With a mesh's `context` axis N, a context group's N workers (neighbouring ranks) load the same
    rows and each keeps 1/N of every row's tokens (`input_sharding`); attention sees the whole row
    and the loss sums each row over the group (kernels/context.py). Context peers hold the same
    parameters, so FSDP2 shards them and reduces their gradients over fsdp x context flattened.

    With a mesh's `expert` axis N, an expert group's N workers (neighbouring ranks, different rows)
    hold E/N experts each, by the model's own expert plan (`base_model_ep_plan`: `grouped_gemm` splits
    the stacked weights by expert, `ep_dispatch_experts` sends each (token, expert) pair to its
    expert's worker and the result back, two all-to-alls: transformers/distributed/expert_parallel.py,
    as `from_pretrained(distributed_config=DistributedConfig(ep_size=N))` does). FSDP2 then shards the
    experts over `fsdp` (torchtitan's dp_shard_mod_ep) and the rest over fsdp x expert flattened."""

    main_axis = "fsdp"
    sharded = True
    devices_named = "workers (`num_processes`)"
    loads_shards = True  # job.pretrained builds the model without its weights; wrap_model reads its shards
    # Checkpoints: each worker writes and reads its own shards (its DTensors' local parts) with
    # torch.distributed.checkpoint, without the process group (no_dist: its own `.metadata`), into
    # `shards/host-<rank>/`, as XlaFsdp's hosts do; resumed by the same number of workers.
    writes_shards = True
    # not run here: FSDP2's hooks under torch.compile (dynamo skips them, one graph per block)
    compile_refusal = "not supported with `strategy` fsdp yet; use `strategy` ddp"

    def __init__(self, accelerator: TorchAccelerator, mesh: Mesh | None = None) -> None:
        super().__init__(accelerator, mesh)
        self._mesh: DeviceMesh | None = None

    @property
    def row_shares(self) -> int:
        return self.layout().rows

    @property
    def row_share(self) -> int:
        return self.layout().row_share(self.rank)  # tensor peers are neighbouring ranks

    def check_model(self, config: Any, lora: bool = False) -> None:
        # transformers' colwise style splits the key/value projections too: no heads kept whole
        tensor = self.axes.tensor
        line = tensor_plan.refusal(config, tensor, every_projection=True)
        if not line and lora and tensor > 1:
            line = (f"`tensor_parallel` {tensor} with `lora` runs on the xla backend only so far "
                    "(transformers' styles split the layers LoRA wraps)")
        line = line or self._expert_refusal(config, lora)
        if line:
            raise UserError(line)

    def _expert_refusal(self, config: Any, lora: bool) -> str | None:
        """Why `config`'s experts do not split over the `expert` axis here, in one line, or None."""
        axes = self.axes
        n = axes.expert
        line = expert_refusal(config, n)
        if line or n == 1:
            return line
        text = getattr(config, "get_text_config", lambda: config)()
        if "ep_dispatch_experts" not in (getattr(text, "base_model_ep_plan", None) or {}).values():
            return f"`expert_parallel` {n}: {type(config).__name__} has no expert-parallel plan in transformers"
        if axes.tensor > 1 or axes.context > 1 or lora:
            beside = "`lora`" if lora else "`tensor_parallel`" if axes.tensor > 1 else "`context_parallel`"
            return f"`expert_parallel` {n} with {beside} runs on the xla backend only so far"
        return None

    @property
    def param_shards(self) -> int:
        return self.layout().devices  # fsdp, expert and context, and the plan's over tensor too

    def mesh(self) -> DeviceMesh:
        """The job's mesh, made once (each sub-mesh is a process group of its own)."""

        if self._mesh is None:
            # given explicitly: the default mesh of a GPU host is CUDA's even when the group is gloo
            # (pytorch#132471)
            layout = self.layout()
            # transformers' token dispatch takes the tensor group as well (of one worker without tensor parallelism)
            keep = (tensor_plan.TENSOR,) if layout.expert > 1 else ()
            self._mesh = layout.device_mesh(self.accelerator.device.type, self.main_axis, keep)
        return self._mesh

    def teardown(self) -> None:
        self._mesh = None
        super().teardown()

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        # A model built without its checkpoint's weights (job.pretrained, parallel.sharded_load): it is
        # split and sharded as it is, then each worker's shards are read into (`_fill`).
        source = sharded_load.take(model)
        built = {}
        if source is not None:
            built = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
                     if not t.is_meta}  # the new head, the rotary buffers: `to_empty` clears them
        # placed before the mesh: torch's DeviceMesh sets the device to LOCAL_RANK's only where the
        # device's runtime has not started (device_mesh.py, _setup_world_group_and_device), which
        # TorchTPU would refuse on every worker but the first
        device = self.accelerator.device
        model = model._apply(lambda t: t if t.is_meta else t.to(device))
        if dist.is_initialized():
            mesh = self.mesh()
            if self.axes.tensor > 1:
                self._split(model, mesh[tensor_plan.TENSOR])
            shards = self._param_mesh()
            if self.axes.expert > 1:
                self._split_experts(model, mesh)
            for block in blocks_of(model):
                fully_shard(block, mesh=shards)
            fully_shard(model, mesh=shards)
            if self.axes.context > 1:  # the forward and the loss take the rows' local tokens
                setattr(unwrapped(model), context.ATTRIBUTE, self.context_group())
        elif self.axes.split:  # an Engine made in a script without launch
            raise UserError(f"{self.axes.named()} needs as many workers or more: start them "
                            "with launch(..., num_processes=..., mesh=...)")
        if source is not None:
            self._fill(model, source, built)
        return model

    def _param_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards the parameters over and reduces their gradients on: `fsdp`, and
        with a `context` axis fsdp x context flattened (torchtitan's dp_shard_cp): context peers
        hold the same parameters and each computes a part of every row's gradient."""
        mesh = self.mesh()
        if self.axes.expert > 1:  # expert peers load different rows: each parameter split over both
            return mesh["fsdp", "expert"]._flatten()
        return mesh["fsdp", "context"]._flatten() if self.axes.context > 1 else mesh["fsdp"]

    def _split_experts(self, model: torch.nn.Module, mesh: DeviceMesh) -> None:
        """`model`'s experts split over the `expert` axis by its expert plan and transformers'
        styles, then each experts module sharded by FSDP2 over `fsdp` (its weights' other dimension
        of the mesh). An expert's gradient sums the tokens of every row its group sent it: FSDP2's
        sum over `fsdp` is divided by all the workers that load different rows, as the rest's is
        (transformers/distributed/fsdp.py does the same; summed, then divided: gloo has no PREMUL_SUM)."""
        from torch.distributed.fsdp import fully_shard
        from transformers.distributed import DistributedConfig
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        self.check_model(model.config, lora=hasattr(model, "peft_config"))  # job.prepare checked; a script has not
        pretrained = cast("PreTrainedModel", model)
        n = self.axes.expert
        _, plan, _ = pretrained._resolve_parallel_plans(DistributedConfig(ep_size=n, fsdp_size=self.layout().rows))
        apply_expert_parallelism(model, mesh["expert"], mesh[tensor_plan.TENSOR], plan, ep_implementation="all_to_all")
        for name, style in plan.items():
            if style == "ep_dispatch_experts":
                experts = fully_shard(model.get_submodule(name), mesh=mesh["fsdp"])
                experts.set_gradient_divide_factor(float(self.layout().rows))
                experts.set_force_sum_reduction_for_comms(True)

    def context_group(self) -> context.Context | None:
        """This worker's context group (kernels.context), or None without a `context` axis."""
        if self.axes.context == 1 or not dist.is_initialized():
            return None
        group = self.mesh()["context"]
        return context.Context(group.get_group(), self.axes.context, group.get_local_rank())

    def input_sharding(self) -> Any:
        """With a `context` axis: what cuts each batch's rows to this worker's tokens (the
        accelerator's loader calls it on every batch)."""
        split = self.context_group()
        return split.split_rows if split else None

    def _fill(self, model: torch.nn.Module, source: sharded_load.Checkpoint, built: dict[str, torch.Tensor]
              ) -> None:
        """`model`'s tensors made on the device (FSDP2: each worker's shards, `to_empty`), then
        filled: those it was built with from their copies, the checkpoint's from the slices this
        worker holds (each DTensor's local shape and offset in the whole tensor)."""
        from torch.distributed.tensor import DTensor, distribute_tensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        model.to_empty(device=self.accelerator.device)
        state = dict(model.named_parameters()) | dict(model.named_buffers())
        with torch.no_grad():
            for name, value in built.items():
                t = state[name]
                if isinstance(t, DTensor):
                    value = distribute_tensor(value.to(t.device), t.device_mesh, t.placements, src_data_rank=None)
                    t, value = t.to_local(), value.to_local()
                t.copy_(value)

        def parts() -> Iterator[tuple[str, torch.Tensor, tuple[slice, ...]]]:
            for name, p in state.items():
                if name in built:
                    continue
                shape, offset = tuple(p.shape), (0,) * p.dim()
                if isinstance(p, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                    p = p.to_local()
                yield name, p, tuple(slice(o, o + n) for o, n in zip(offset, shape))

        source.fill(parts())
        print(source.line(f"worker {self.rank}", "its shards"), flush=True)

    def _split(self, model: torch.nn.Module, mesh: DeviceMesh) -> None:
        """`model`'s projections split over the tensor axis, `mesh`, by transformers' plan and
        styles. Its ties kept: a style makes each weight a Parameter anew, and the plan names a tied
        head that `named_parameters` lists under its first name only."""
        from transformers.distributed import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        self.check_model(model.config, lora=hasattr(model, "peft_config"))  # job.prepare checked; a script has not
        pretrained = cast("PreTrainedModel", model)  # check_model refused a peft model
        plan, _, _ = pretrained._resolve_parallel_plans(DistributedConfig(tp_size=self.axes.tensor))
        present = dict(model.named_parameters()) | dict(model.named_modules())
        groups = ties(model)
        apply_tensor_parallelism(model, mesh, {name: style for name, style in plan.items() if name in present})
        retie(groups)

    def gather_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.axes.inner == 1:
            return self.gather(tensor)
        # this worker's tensor position in every row of the mesh
        return _all_gather(tensor, self.row_shares, self.mesh()["fsdp"].get_group())

    @contextmanager
    def _gradient_sync_off(self, model: Any) -> Iterator[None]:
        model.set_requires_gradient_sync(False)  # micro-steps keep unsharded gradients, unreduced
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        return self._gradient_sync_off(model) if hasattr(model, "set_requires_gradient_sync") else nullcontext()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None
                       ) -> torch.Tensor | None:
        params = optimizer_params(optimizer)
        norm = None
        if max_grad_norm:
            norm = self.grad_norm(params)
            for group in _by_mesh(params).values():
                torch.nn.utils.clip_grads_with_norm_(group, max_grad_norm, norm)
        optimizer.step()
        return norm

    def grad_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Over every shard, for gradients on several meshes too (the split projections' on both
        axes, the rest's on fsdp), which torch's one foreach norm refuses: each mesh's norm made
        whole, then their norm."""
        norms = [self.whole(torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None]))
                 for group in _by_mesh(params).values()]
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # a collective

    def to_host(self, tensors: Sequence[torch.Tensor], main_only: bool = False) -> list[torch.Tensor] | None:
        whole = [self.whole(t) for t in tensors]  # every worker takes part in the gathers
        return self.accelerator.to_host(whole) if not main_only or self.is_main else None

    def load_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        if not dist.is_initialized():
            return super().load_weights(model, weights)
        # torch's annotation asks for dict[str, ValueType], and dict is invariant: a dict[str, Tensor] is one
        set_model_state_dict(model, weights,  # type: ignore[arg-type]
                             options=StateDictOptions(full_state_dict=True, strict=False))

    def save_shards(self, tensors: dict[str, torch.Tensor], folder: PathLike) -> None:
        import torch.distributed.checkpoint as dcp

        with dcp_errors():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)

    def load_shards(self, tensors: dict[str, torch.Tensor], folder: PathLike) -> None:
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(str(folder))
        reader.read_metadata()  # its own error: dcp.load turns a damaged one into a bare AssertionError
        with dcp_errors():
            dcp.load(tensors, storage_reader=reader, no_dist=True)

    def zeros_like_param(self, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(param.detach())  # a DTensor's: sharded like it

    def place_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        # a checkpoint holds whole moments; each worker keeps its shard, laid out like the parameter
        for p in optimizer_params(optimizer):
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if isinstance(p, DTensor) and not isinstance(value, DTensor) and shaped_like(value, p):
                    state[key] = distribute_tensor(value.to(p.device), p.device_mesh, p.placements)


def _by_mesh(params: Sequence[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """The parameters that have gradients, by their gradients' mesh (None: plain tensors)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups


def _all_gather(tensor: torch.Tensor, size: int, group: Any = None) -> torch.Tensor:
    """`tensor` of each of the `size` processes of `group` (None: every one), concatenated on dim 0."""
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)
