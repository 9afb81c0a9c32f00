"""Loading a model's weights straight into their shards (`--strategy fsdp`: FSDPv2 on XLA, FSDP2): the
model is built without storage (the meta device), and each parameter the checkpoint holds is made
on the devices already sharded, from the slices of the checkpoint's safetensors that this host's
devices hold, one tensor at a time. No host ever holds the whole model (the way it loaded before:
the whole model in fp32 on the host, then moved and sharded, held twice at the peak).

Two steps, at the two places a run has them:
- `skeleton` (the job's preparation): the task's own loading (`from_pretrained`, with its new head
  and config options) runs with the checkpoint's tensors replaced by empty ones on the meta device
  (`meta_weights`): transformers does everything else as it always does (key renames, its report,
  the new head's seeded initialisation, the non-persistent buffers such as the rotary inv_freq
  recomputed, the ties), and the checkpoint's parameters are left on the meta device. The model
  carries a `Checkpoint` (its attribute `SOURCE`) that says where they are.
- `Checkpoint.materialise` (XlaFsdp.wrap_model, before FSDPv2 wraps): every meta parameter becomes
  an XLA tensor sharded as FSDPv2 shards it, made from this host's devices' slices only
  (`torch_xla._XLAC._global_tensor_from_cpu_shards`); FSDPv2 then leaves it as it is (it marks only
  parameters not sharded yet: torch_xla 2.9's experimental/spmd_fully_sharded_data_parallel.py,
  SpmdFullyShardedDataParallel.__init__).

A LoRA base held quantized (--load-in-8bit/4bit on XLA) is a skeleton too: its projections are made
QuantLinear on the meta device (kernels.quant_xla, whose every buffer is a function of its own output
rows), and `materialise` reads each device's rows of a projection's weight, quantizes them on the
host (the layer's `quantize_rows`) and makes its buffers sharded with their rows (`row_spec`): a host
reads and quantizes its devices' rows only. peft's layers may wrap the skeleton first: its tensors
are found by their checkpoint names (`checkpoint_key`).

FSDP2 (gpu_fallback.strategies.Fsdp2.wrap_model) shards the skeleton as it is, makes each worker's
shards empty (`to_empty`), then fills them in place from their slices (`Checkpoint.fill`).

Where it does not apply, the model loads whole as before (`skeleton` returns None): a model that
is no local folder of safetensors, or whose parameters are not the checkpoint's tensors by name and
shape (transformers converted them: stacked experts, renamed keys)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

SOURCE = "_xla_train_checkpoint"  # the attribute of a skeleton model that holds its Checkpoint
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
MIB = 2**20


def safetensors_files(folder: str | Path) -> list[Path] | None:
    """The safetensors files of a model folder (one `model.safetensors`, or those a sharded
    checkpoint's index names), or None where it has none (a hub name, .bin weights)."""
    folder = Path(folder).expanduser()
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if (folder / INDEX).is_file():
        names = json.loads((folder / INDEX).read_text())["weight_map"].values()
        return [folder / name for name in dict.fromkeys(names)]
    return None


class Checkpoint:
    """A model folder's safetensors tensors by name, read slice by slice (only the bytes of the
    slice asked for); counts the bytes it reads (`bytes_read`)."""

    def __init__(self, files: list[Path], name: str) -> None:
        self.name, self.files = name, files
        self.where: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}  # name: file, dtype, shape, offset
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.bytes: dict[str, int] = {}  # each tensor's bytes in the file
        for f in files:
            for key, (dtype, shape, offset, size) in _header(f).items():
                self.where[key], self.shapes[key], self.bytes[key] = (f, dtype, shape, offset), shape, size
        self.bytes_read = 0
        self._open: dict[Path, int] = {}

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The slice `index` of tensor `key`, read from its file: only its bytes, with pread(2)
        into the tensor (no mapping of the file, whose pages would count as the process's). One
        read for a slice of the first dimension; otherwise one per row of the dimensions before the
        last split one (tensor parallelism splits two). (safetensors' own `get_slice` either maps
        the file, or with its "pread" backend, 0.8, reads the whole tensor for each slice: measured
        here with /proc/self/io.)"""
        f, dtype, shape, offset = self.where[key]
        if f not in self._open:
            self._open[f] = os.open(f, os.O_RDONLY)
        fd, item = self._open[f], _DTYPE_BYTES[dtype]
        if not shape:  # a scalar
            return self._rows(fd, 1, item, lambda row: offset).view(_DTYPES[dtype]).reshape(())
        cut = [d for d, (s, n) in enumerate(zip(index, shape)) if (s.start, s.stop) != (0, n)]
        d = cut[-1] if cut else 0  # runs along the last split dimension, for each row of the dimensions before
        start, stop = index[d].start, index[d].stop
        inner = math.prod(shape[d + 1:]) * item
        rows = torch.arange(math.prod(shape[:d])).reshape(shape[:d])[tuple(index[:d])].flatten().tolist()
        piece = self._rows(fd, len(rows), (stop - start) * inner,
                           lambda i: offset + (rows[i] * shape[d] + start) * inner)
        return piece.view(_DTYPES[dtype]).reshape(*(s.stop - s.start for s in index[:d]), stop - start, *shape[d + 1:])

    def _rows(self, fd: int, rows: int, size: int, where: Any) -> torch.Tensor:
        """`rows` runs of `size` bytes read from `fd` at `where(row)`, one after the other (bytes)."""
        out = torch.empty(rows * size, dtype=torch.uint8)
        view = out.numpy().data
        for row in range(rows):
            _pread_into(fd, view[row * size:(row + 1) * size], where(row))
        self.bytes_read += rows * size
        return out

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

    def local_shards(self, key: str, dtype: torch.dtype, places: list[tuple[slice, ...]],
                     shard_shape: tuple[int, ...]) -> list[torch.Tensor]:
        """Tensor `key`'s pieces at `places` (one per device), cast to `dtype` and padded with zeros
        to `shard_shape` (as torch_xla pads an uneven split: csrc/xla_sharding_util.cpp, ShardTensor)."""
        read: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}  # a replica's piece is read once
        shards = []
        for index in places:
            bounds = tuple((s.start, s.stop) for s in index)
            if bounds not in read:
                read[bounds] = self.read(key, index).to(dtype) if all(a < b for a, b in bounds) else \
                    torch.zeros([b - a for a, b in bounds], dtype=dtype)
            shards.append(_padded(read[bounds], shard_shape))
        return shards

    def host_shards(self, model: torch.nn.Module, mesh: Any, spec_of: Any, devices: list[int]) -> Iterator[Any]:
        """For each parameter of `model` left on the meta device, one at a time (a tied one once):
        (its holders [(module, attribute)], the parameter, the partition spec `spec_of(param)`, and
        its shards for `devices` (global device ordinals, this host's, in torch_xla's order of its
        local devices) read from the checkpoint, cast to the parameter's dtype, padded)."""
        holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None and p.is_meta:
                    holders.setdefault(id(p), []).append((module, attr))
        for name, p in model.named_parameters():  # each tensor by its first name (the checkpoint's)
            if not p.is_meta:
                continue
            spec = spec_of(p)
            places, shard_shape = shard_places(tuple(p.shape), mesh, spec, devices)
            key = self.checkpoint_key(name)
            yield holders[id(p)], p, spec, places, self.local_shards(key, p.dtype, places, shard_shape)

    def host_rows(self, model: torch.nn.Module, mesh: Any, row_spec: Any, devices: list[int]) -> Iterator[Any]:
        """For each module of `model` whose ROW_BUFFERS are on the meta device (a quantized
        projection: kernels.quant_xla.QuantLinear), one at a time: (the module, and for each of its
        row buffers (name, buffer, partition spec `row_spec(buffer)`, places, shards for `devices`)),
        the shards quantized from each device's rows of the checkpoint's weight, read once a piece
        (`quantize_rows`), padded."""
        for name, module in model.named_modules():
            buffers = {b: getattr(module, b) for b in getattr(module, "ROW_BUFFERS", ())}
            if not buffers or not all(t.is_meta for t in buffers.values()):
                continue
            key = self.checkpoint_key(f"{name}.weight")
            width = self.shapes[key][1]
            made: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
            out = []
            for b, buffer in buffers.items():
                spec = row_spec(buffer)
                places, shard_shape = shard_places(tuple(buffer.shape), mesh, spec, devices)
                shards = []
                for index in places:
                    rows = (index[0].start, index[0].stop)
                    if rows[0] < rows[1] and rows not in made:
                        made[rows] = module.quantize_rows(self.read(key, (slice(*rows), slice(0, width))))
                    # a device whose rows are all padding (an uneven split's last ones) gets zeros
                    piece = made[rows][b] if rows[0] < rows[1] else \
                        torch.zeros(0, *buffer.shape[1:], dtype=buffer.dtype)
                    shards.append(_padded(piece, shard_shape))
                out.append((b, buffer, spec, places, shards))
            yield module, out

    def materialise(self, model: torch.nn.Module, mesh: Any, spec_of: Any, row_spec: Any = None) -> None:
        """Every parameter of `model` left on the meta device made on this host's devices, sharded
        over `mesh` by `spec_of(param)` (a partition spec), from this host's devices' slices of the
        checkpoint (torch_xla's `_global_tensor_from_cpu_shards`, which takes one shard for each
        local device in the order of `_xla_get_runtime_devices`: csrc/init_python_bindings.cpp);
        one tensor at a time. Tied parameters stay one tensor. Then the row buffers of quantized
        projections left on the meta device, by `row_spec(buffer)` (`host_rows`)."""
        try:
            for holders, p, spec, places, shards in self.host_shards(model, mesh, spec_of, _local_devices()):
                tensor = _from_local_shards(shards, mesh, spec, p.shape)
                _check_places(tensor, places)
                made = torch.nn.Parameter(tensor, requires_grad=p.requires_grad)
                for module, attr in holders:
                    module._parameters[attr] = made
                del shards, tensor
                trim()
            for module, buffers in self.host_rows(model, mesh, row_spec, _local_devices()) if row_spec else ():
                for b, buffer, spec, places, shards in buffers:
                    tensor = _from_local_shards(shards, mesh, spec, buffer.shape)
                    _check_places(tensor, places)
                    module._buffers[b] = tensor
                del buffers
                trim()
        finally:
            self.close()

    def checkpoint_key(self, name: str) -> str:
        """The checkpoint's name of the model's tensor `name`, also where peft's LoRA wraps the model
        (peft 0.21.2: PeftModel.base_model, a LoraModel whose `model` is the one loaded; each
        adapted layer's `base_layer`; a trained head's ModulesToSaveWrapper, its `original_module`
        and its copy `modules_to_save.<adapter>`, both read from the head's tensors); a tensor the
        checkpoint lacks is a bug, said as one."""
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        key = re.sub(r"\.(original_module|modules_to_save\.[^.]+)(?=\.)", "", key)
        if key not in self.shapes:
            raise KeyError(f"{self.name}: no tensor {key!r} (the model's {name!r}) in its checkpoint")
        return key

    def fill(self, parts: Iterator[tuple[str, torch.Tensor, tuple[slice, ...]]]) -> None:
        """Each `(name, local, index)` of `parts`: `local` (a worker's part of the model's tensor
        `name`, made empty) filled in place with the checkpoint's slice `index`, cast to its dtype;
        one tensor at a time (FSDP2's shards: gpu_fallback.strategies.Fsdp2)."""
        try:
            with torch.no_grad():
                for name, local, index in parts:
                    if local.numel():
                        local.copy_(self.read(self.checkpoint_key(name), index).to(local.dtype))
        finally:
            self.close()

    def line(self, who: str = "this host", held: str = "its devices' shards") -> str:
        total = sum(self.bytes.values())
        return (f"loaded {self.name}: {who} read {self.bytes_read / MIB:.1f} MiB of {total / MIB:.1f} MiB, "
                f"{held} (the weights were never whole on the host)")


@functools.cache
def _libc() -> Any:
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl)
        return None


def trim() -> None:
    """The host memory freed by the last tensor's upload handed back to the system (glibc's
    malloc_trim; kernels.quant_load calls it too, after each tensor it quantizes). Without it,
    glibc kept the freed read buffers and torch_xla's upload copies in its arenas: measured here on
    XLA:CPU (4 devices, a 321 MiB Llama), the process's resident memory after the load was the
    model plus 180 MiB, its peak up to the model plus 180 MiB; with it, the model plus 10 MiB, its
    peak the model plus 40 MiB (tests/test_sharded_load.py)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """A safetensors file's tensors: name -> (dtype, shape, offset of its bytes in the file, bytes).
    The format (github.com/huggingface/safetensors, README "Format"): 8 bytes little-endian N, N
    bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}} (offsets from the end of
    the header), "__metadata__" aside, then the bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0],
                v["data_offsets"][1] - v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}


def _local_devices() -> list[int]:
    """This host's devices as global ordinals, in torch_xla's order of them ("CPU:0": 0)."""
    import torch_xla

    return [int(d.split(":")[-1]) for d in torch_xla._XLAC._xla_get_runtime_devices()]


def _padded(piece: torch.Tensor, shard_shape: tuple[int, ...]) -> torch.Tensor:
    """A device's piece padded with zeros to the shard's shape, as torch_xla pads an uneven split
    (csrc/xla_sharding_util.cpp, ShardTensor)."""
    pad = [p for size, full in zip(reversed(piece.shape), reversed(shard_shape)) for p in (0, full - size)]
    return torch.nn.functional.pad(piece, pad) if any(pad) else piece.contiguous()


def _from_local_shards(shards: list[torch.Tensor], mesh: Any, spec: tuple[Any, ...], shape: Any) -> torch.Tensor:
    """One tensor of `shape` over the mesh from this host's devices' `shards`, in the order of
    `_local_devices` (csrc/init_python_bindings.cpp, _global_tensor_from_cpu_shards)."""
    import torch_xla

    return torch_xla._XLAC._global_tensor_from_cpu_shards(shards, mesh.get_op_sharding(spec), list(shape))


def place(tensor: torch.Tensor, mesh: Any, spec: tuple[Any, ...]) -> torch.Tensor:
    """A host tensor on this host's devices, split over `mesh` by `spec`: each device gets its
    piece only, never the whole tensor (any spec of one axis or none per dimension, over a mesh
    of several axes too, where torch_xla's ShardingSpec tiles only specs that name every axis)."""
    places, shard_shape = shard_places(tuple(tensor.shape), mesh, spec, _local_devices())
    return _from_local_shards([_padded(tensor[index], shard_shape) for index in places], mesh, spec, tensor.shape)


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"a safetensors file ends before its tensor (offset {offset})")
        view, offset = view[n:], offset + n


def shard_places(shape: tuple[int, ...], mesh: Any, spec: tuple[Any, ...], devices: list[int]
                 ) -> tuple[list[tuple[slice, ...]], tuple[int, ...]]:
    """Where in a tensor of `shape` each of `devices` (global device ordinals) holds its shard
    under `spec` over `mesh`, and the shard's padded shape. A dimension split over a mesh axis of
    n devices is cut into pieces of ceil(size / n), the last ones shorter or empty (XLA's tiling;
    torch_xla 2.9's csrc/xla_sharding_util.cpp, GetShardReplicaAndIndicesForDevices clamps each
    piece to the tensor); the mesh axes not named replicate. A dimension may name several axes (a
    tuple): split over all of them, the first the most significant (torch_xla's Mesh.get_op_sharding
    flattens them so)."""
    import numpy as np

    grid = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape)
    axes = [() if s is None else tuple(_axis(mesh, a) for a in (s if isinstance(s, tuple) else (s,))) for s in spec]
    counts = [math.prod(mesh.mesh_shape[a] for a in group) for group in axes]
    shard_shape = tuple(-(-n // c) for n, c in zip(shape, counts))
    places = []
    for device in devices:
        coords = [int(c[0]) for c in np.nonzero(grid == device)]
        index = []
        for n, group, size in zip(shape, axes, shard_shape):
            piece = 0
            for a in group:  # the piece's number over the axes of the group, the first most significant
                piece = piece * mesh.mesh_shape[a] + coords[a]
            start = min(piece * size, n)
            index.append(slice(start, min(start + size, n)))
        places.append(tuple(index))
    return places, shard_shape


def _axis(mesh: Any, axis: str | int) -> int:
    return mesh.get_axis_name_idx(axis) if isinstance(axis, str) else int(axis)


def _check_places(tensor: torch.Tensor, places: list[tuple[slice, ...]]) -> None:
    """The places computed here are the ones torch_xla gives the tensor's local shards."""
    import torch_xla

    (given,) = torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])
    for (_, index), ours in zip(given, places):
        theirs = [(s.start, s.stop) for s in index] if index is not Ellipsis else [(0, None)] * len(ours)
        assert index is Ellipsis or theirs == [(s.start, s.stop) for s in ours], (theirs, ours)


def _loading_internals_known() -> bool:
    """Whether this transformers (setup.py allows 5.24 to 6) still has the two places
    `meta_weights` takes over; where not, models load whole, as before."""
    from transformers import core_model_loading
    from transformers.modeling_utils import PreTrainedModel

    return callable(getattr(core_model_loading, "_materialize_copy", None)) and \
        isinstance(PreTrainedModel.__dict__.get("_load_pretrained_model"), staticmethod)


@contextlib.contextmanager
def meta_weights(checkpoint: Checkpoint):
    """transformers' `from_pretrained` of `checkpoint`'s folder with its tensors made as empty ones
    on the meta device: it reads no weight, and does the rest as always. Read in transformers 5.24:
    PreTrainedModel._load_pretrained_model (modeling_utils.py) opens the files and hands each
    tensor's safetensors slice to convert_and_load_state_dict_in_model, which reads it in one place,
    core_model_loading.py's `_materialize_copy` (`tensor[...]`, then `.to(device, dtype)`); that
    one gives an empty tensor here. Not where the model's conversion mapping holds a WeightConverter
    (a tensor made of others: stacked experts, fused projections): those load whole, as before."""
    from transformers import core_model_loading
    from transformers.core_model_loading import WeightConverter
    from transformers.modeling_utils import PreTrainedModel

    original_load = PreTrainedModel.__dict__["_load_pretrained_model"]
    original_copy = core_model_loading._materialize_copy
    ours = {f.resolve() for f in checkpoint.files}
    active = [False]

    def load(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        active[0] = (state_dict is None and bool(checkpoint_files)
                     and {Path(f).resolve() for f in checkpoint_files} == ours
                     and not any(isinstance(m, WeightConverter) for m in load_config.weight_mapping or ()))
        try:
            return original_load.__func__(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        finally:
            active[0] = False

    def empty(tensor, device=None, dtype=None):
        if not active[0] or not hasattr(tensor, "get_shape"):  # not a safetensors slice of ours
            return original_copy(tensor, device, dtype)
        return torch.empty(tensor.get_shape(), dtype=dtype or _DTYPES[tensor.get_dtype()], device="meta")

    PreTrainedModel._load_pretrained_model = staticmethod(load)  # type: ignore[method-assign]
    core_model_loading._materialize_copy = empty
    try:
        yield
    finally:
        PreTrainedModel._load_pretrained_model = original_load  # type: ignore[method-assign]
        core_model_loading._materialize_copy = original_copy


def converts(model_type: str) -> bool:
    """Whether transformers converts `model_type`'s checkpoint tensors as it loads them (a
    WeightConverter in its conversion mapping, transformers 5.24's conversion_mapping.py: a
    mixture's stacked experts, fused projections), which `skeleton` then loads whole (`meta_weights`)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    return any(isinstance(m, WeightConverter) for m in get_checkpoint_conversion_mapping(model_type) or ())


def take(model: torch.nn.Module) -> Checkpoint | None:
    """The Checkpoint a skeleton `model` carries (attribute SOURCE), removed from it; found inside
    the wrappers put around it since (peft's), or None for a model loaded whole."""
    for module in model.modules():
        if SOURCE in module.__dict__:
            return module.__dict__.pop(SOURCE)
    return None


def skeleton(load: Any, name: str) -> torch.nn.Module | None:
    """`load()` (the task's loading of model `name`) with the checkpoint's parameters left on the
    meta device, carrying its Checkpoint (attribute SOURCE); the model loaded whole where
    transformers converts its tensors (`meta_weights`); None where it has no local safetensors or
    a parameter is no checkpoint tensor of its name and shape (renamed: the caller loads it whole)."""
    files = safetensors_files(name)
    if files is None or not _loading_internals_known():
        return None
    from ..core.errors import UserError

    try:
        checkpoint = Checkpoint(files, name)
    except Exception as e:  # a damaged file: the whole load says so in its own words
        raise UserError(f"cannot load model {name!r}: {e}") from None
    with meta_weights(checkpoint):
        model = load()
    meta = {n: p for n, p in model.named_parameters() if p.is_meta}
    if not meta:
        return model  # loaded whole (a WeightConverter: see meta_weights)
    buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if buffers or any(checkpoint.shapes.get(n) != tuple(p.shape) for n, p in meta.items()):
        return None  # renamed tensors: loaded whole again by the caller
    setattr(model, SOURCE, checkpoint)
    return model


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
