"""The job's device mesh as one value: the size of each named axis, validated once, handed to
everything that lays work out (the strategy, the loaders, the memory plan, MFU, the kernels'
partition specs, checkpoints). torchtitan's `ParallelDims` and Accelerate's `ParallelismConfig`
hold the same: one object for every axis.

The axes, outermost to innermost (neighbouring devices share the inner ones: on a TPU, the chips
of one host):

    data     replicas: different rows, every parameter whole (ddp, spmd)
    fsdp     different rows, every parameter split (FSDPv2 on XLA, FSDP2 on CUDA and the CPU)
    expert   different rows as fsdp's, and a mixture's experts split E/N a device: tokens travel
             to their experts' devices and back (MaxText's and torchtitan's `expert` shares the
             devices of the data axes)
    context  the same rows, each device 1/N of every row's tokens; attention still sees the whole
             row (keys and values gathered)
    tensor   the same rows and tokens, each block's heads and MLP columns split (Megatron's)

`pipeline` and `dcn` (the hosts' axis of a multi-slice job) are named so that a run asking for
them is refused in one line, not lost. A script gives the sizes it wants (`Mesh(tensor=2)`); the
strategy lays the devices out (`resolve`): what the named axes leave goes to `fsdp` where the
parameters are split, else to `data`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from ..core.errors import UserError

AXES = ("data", "fsdp", "expert", "context", "tensor")  # outermost to innermost
ROWS = ("data", "fsdp", "expert")  # the axes whose devices load different rows
FILLED = AXES[:2]  # the axes `resolve` sizes: what the named ones leave
PARAMS = ("fsdp", "expert", "context")  # the axes FSDP splits every parameter over (ZeRO-3 over them all)
Spec = tuple[str | tuple[str, ...] | None, ...]


def rows_entry(axis_names: tuple[str, ...] | list[str]) -> str | tuple[str, ...]:
    """The partition spec entry of a batch's rows on a mesh of these axis names (a torch_xla
    Mesh's `axis_names`): every row axis it has, else its first axis (XlaSpmd's one `data`)."""
    names = tuple(a for a in axis_names if a in ROWS) or tuple(axis_names[:1])
    return names[0] if len(names) == 1 else names


def tokens_entry(axis_names: tuple[str, ...] | list[str], but: str = "") -> str | tuple[str, ...] | None:
    """The entry of a dimension of a batch's tokens flattened (rows x length, as a mixture's
    experts take them): the row axes and `context` that the mesh has, except `but`."""
    names = tuple(a for a in axis_names if a in (*ROWS, "context") and a != but)
    return names[0] if len(names) == 1 else (names or None)


@dataclass(frozen=True)
class Mesh:
    """The size of each axis (see the module's docstring); 0 for `data` and `fsdp`: what the
    other axes leave of the devices, known once the strategy knows its devices (`resolve`)."""

    data: int = 0
    fsdp: int = 0
    expert: int = 1
    context: int = 1
    tensor: int = 1
    pipeline: int = 1  # not built: refused above 1
    dcn: int = 1  # not built: refused above 1

    def __post_init__(self) -> None:
        for f in fields(self):
            size = getattr(self, f.name)
            least = 0 if f.name in FILLED else 1
            if not isinstance(size, int) or size < least:
                raise UserError(f"`{f.name}_parallel` must be a whole number of at least {least}, not {size!r}")
        for axis in ("pipeline", "dcn"):
            if getattr(self, axis) > 1:
                raise UserError(f"`{axis}_parallel` {getattr(self, axis)}: not built yet (one slice, no pipeline)")

    # --- what the run asked for -------------------------------------------------------------
    @property
    def split(self) -> dict[str, int]:
        """The axes named above 1 besides the data axes: {name: size}."""
        return {a: getattr(self, a) for a in ("expert", "context", "tensor") if getattr(self, a) > 1}

    @property
    def inner(self) -> int:
        """Devices of one group of the axes that see the same rows (context x tensor)."""
        return self.context * self.tensor

    def named(self) -> str:
        """The axes named above 1, as an error names them: "`tensor_parallel` 2, `context_parallel` 2"."""
        return ", ".join(f"`{a}_parallel` {n}" for a, n in self.split.items())

    # --- laid out over the devices ----------------------------------------------------------
    def resolve(self, devices: int, sharded: bool, what: str = "devices") -> Mesh:
        """Every axis sized for `devices` (`what`: how the count is named in an error): what the
        named axes leave goes to fsdp where `sharded`, else to data. Refused in one line where
        they do not divide it."""
        named = self.expert * self.context * self.tensor
        if devices % named:
            label = self.named() if len(self.split) == 1 else f"{self.named()} ({named} devices a group)"
            raise UserError(f"{label} does not divide the {devices} {what}")
        rest = devices // named
        given, other = (self.fsdp, self.data) if sharded else (self.data, self.fsdp)
        if other > 1:
            raise UserError(f"`{'data' if sharded else 'fsdp'}_parallel` {other}: this strategy lays the devices the "
                            f"named axes leave out over `{'fsdp' if sharded else 'data'}`")
        if given and given != rest:
            raise UserError(f"`{'fsdp' if sharded else 'data'}_parallel` {given} is not the {rest} {what} left")
        return replace(self, data=1 if sharded else rest, fsdp=rest if sharded else 1)

    @property
    def devices(self) -> int:
        return math.prod(getattr(self, a) or 1 for a in AXES)

    def shape(self, main: str, keep: tuple[str, ...] = ()) -> tuple[tuple[str, int], ...]:
        """((axis, size), ...) of the axes above 1, and always `main` (the strategy's first axis,
        which torch_xla's FSDPv2 and the loaders name) and those in `keep` (a library that asks for
        an axis's group even of one device): what torch_xla's Mesh and torch's DeviceMesh are
        built with."""
        return tuple((a, getattr(self, a)) for a in AXES if a == main or a in keep or getattr(self, a) > 1)

    @property
    def rows(self) -> int:
        """Devices that load different rows of a batch (the data-parallel size)."""
        return math.prod(getattr(self, a) or 1 for a in ROWS)

    @property
    def param_shards(self) -> int:
        """Devices each parameter is split over besides `tensor` (FSDP's, every axis in PARAMS)."""
        return math.prod(getattr(self, a) or 1 for a in PARAMS)

    def row_share(self, rank: int) -> int:
        """Which rows the worker of `rank` loads: ranks run innermost fastest (tensor, then
        context peers are neighbouring ranks and load the same rows)."""
        return rank // self.inner

    # --- partition specs by axis name (XLA's SPMD) ------------------------------------------
    def _present(self, axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
        # axes of one device split nothing: left out
        names = tuple(a for a in AXES if a in axes and getattr(self, a) > 1)
        return names[0] if len(names) == 1 else (names or None)

    def row_axes(self) -> str | tuple[str, ...] | None:
        """The spec entry of a batch's first dimension: its rows over every row axis."""
        return self._present(ROWS)

    def param_axes(self, but: tuple[str, ...] = ()) -> str | tuple[str, ...] | None:
        """The spec entry of a parameter's dimension that FSDP splits: every axis of PARAMS present
        (except `but`, the axes another dimension of the same parameter takes)."""
        return self._present(tuple(a for a in PARAMS if a not in but))

    def batch_spec(self, dims: int, tokens: bool = False) -> Spec:
        """The partition spec of a batch's tensor of `dims` dimensions: rows over the row axes,
        and where `tokens` (a [rows, length, ...] tensor of a causal LM) its tokens over `context`."""
        spec: list[Any] = [self.row_axes()] + [None] * (dims - 1)
        if tokens and dims > 1 and self.context > 1:
            spec[1] = "context"
        return tuple(spec)

    def xla(self, main: str) -> Any:
        """torch_xla's Mesh of these axes over the devices in order (innermost neighbouring)."""
        import numpy as np
        import torch_xla.distributed.spmd as xs

        names, sizes = zip(*self.shape(main))
        return xs.Mesh(np.arange(math.prod(sizes)), sizes, names)

    def device_mesh(self, device_type: str, main: str, keep: tuple[str, ...] = ()) -> Any:
        """torch's DeviceMesh of the same axes (each sub-mesh a process group of its own)."""
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = zip(*self.shape(main, keep))
        return init_device_mesh(device_type, sizes, mesh_dim_names=names)
