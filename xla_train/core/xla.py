"""torch_xla (PJRT): the XLA accelerator and its strategies (XlaDdp: replicas under xmp.spawn;
XlaSpmd: one process shards each batch; XlaFsdp: FSDPv2, the model sharded too). Their launchers
are in `xla_train.core.launchers`; `xla_train.core.select` puts them together.

Launch commands these serve:
    xla-train train --backend xla                   # TPU VM: one replica per local chip
    xla-train train --backend xla --strategy spmd   # one process, batch sharded over every chip
    PJRT_DEVICE=CPU xla-train train --backend xla   # XLA on the CPU, one replica (tests)
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 xla-train train --backend xla --strategy spmd   # 4 CPU devices
    xla-train train --backend xla --strategy fsdp   # one process, the model sharded over every chip (FSDPv2)
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.metadata
import importlib.util
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

import torch

from . import sharded_load
from . import tensor_parallel as tensor_plan
from .errors import UserError
from .experts import static_experts
from .roles import (
    Accelerator,
    Batch,
    Kernel,
    Launcher,
    LayerPlan,
    PathLike,
    Strategy,
    blocks_of,
    dcp_errors,
    optimizer_params,
    serve,
    shaped_like,
)

# Attention implementation registered below: transformers' own SDPA attention with a mask
# function that never asks whether the padding mask is all ones (stock "sdpa" evaluates
# `padding_mask.all()` on every forward, masking_utils._ignore_bidirectional_mask_sdpa, which
# on XLA is a device-to-host sync and cuts each step into two graphs), its q, k and v cast to
# autocast's dtype (torch_xla's autocast leaves sdpa's inputs apart). Packed documents on a TPU
# go through core.attention's "xla_train_documents" (Pallas flash attention with segment ids),
# which hands every call without documents back to this implementation.
XLA_ATTENTION = "xla_sdpa"


def _register_attention():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def always_materialised_mask(*args, **kwargs):
        kwargs["allow_is_bidirectional_skip"] = False
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    def one_dtype_sdpa(module, query, key, value, *args, **kwargs):
        # torch_xla's autocast casts linear, matmul and bmm, not scaled_dot_product_attention (CUDA's
        # casts all three of its inputs): the rotary embedding hands q and k back in fp32 beside a
        # bf16 v, which sdpa refuses. All three go in autocast's dtype, as CUDA's autocast does.
        device = query.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(XLA_ATTENTION, one_dtype_sdpa)
    AttentionMaskInterface.register(XLA_ATTENTION, always_materialised_mask)


# torch_xla 2.9's Pallas kernels for packed documents on a TPU, and which serves which layer: one rule,
# `pallas_layer`, declared below as the path "pallas" (roles.Kernel.layer). Both call private functions of
# jax 0.7.1 (torch_xla's flash wrapper: _flash_attention_impl, _flash_attention_bwd_dq, _dkv), so another jax
# is refused in one line (`_jax_refusal`).
#
# flash: torch_xla 2.9's flash attention, as its wrapper calls jax 0.7.1's kernel
# (torch_xla/experimental/custom_kernel.py: FlashAttention.DEFAULT_BLOCK_SIZES, block_q 512,
# block_k_major 512, block_k 512, block_q_dq 1024, block_k_major_dq 512, block_k_dq 256, each
# min(size, L) in _fa_custom_forward_single_device and _fa_custom_backward_single_device; k and v
# padded to the block, the segment ids not). jax's kernel (jax/experimental/pallas/ops/tpu/
# flash_attention.py: _verify_block, the kernels' block_k and head_dim checks) then serves,
# forward and backward with segment ids, rows of 128, 256 and 512 tokens and multiples of 1024,
# and heads wider than 128 only in multiples of 128 once a row spans several kv blocks (over 512).
# Checked on jax's traces for every multiple of 8 up to 2,048 and every multiple of 128 up to
# 8,192, and run in TPU interpret mode (tests/test_pallas.py). No window, soft-capping or sinks.
FLASH_SHORT_ROWS = (128, 256, 512)
FLASH_ROW_MULTIPLE = 1024
# splash: jax 0.7.1's splash attention (jax/experimental/pallas/ops/tpu/splash_attention), called through
# torch_xla's call_jax by core.attention (`splash_forward`), not through torch_xla's wrapper
# (torch_xla/experimental/splash_attention.py: its partition specs name mesh axes `data` and `fsdp`,
# `splash_attention_jax_wrapper` asserts mesh.shape["data"] and ["fsdp"], and SplashAttention.forward saves its
# soft-cap float with save_for_backward, which takes tensors only). A causal mask or a sliding window
# (LocalMask), segment ids, soft-capping (attn_logits_soft_cap), learned sinks and grouped-query heads
# (k and v not repeated). Its blocks are multiples of 128 (_splash_attention_forward: bkv_compute % NUM_LANES)
# that divide the row (splash_attention_mask_info.process_mask), so it serves rows of any multiple of 128,
# here with blocks of the largest multiple of 128 up to 512 (MaxText's sa_block default) that divides the row,
# and the fused backward. call_jax needs torchax, whose copy in torch_xla 2.9's wheel imports flax.
SPLASH_ROW_MULTIPLE = 128
SPLASH_MAX_BLOCK = 512


def _flash_rows(length: int) -> bool:
    return length in FLASH_SHORT_ROWS or length % FLASH_ROW_MULTIPLE == 0


def _flash_heads(length: int, head_dim: int | None) -> bool:
    return head_dim is None or length <= FLASH_SHORT_ROWS[-1] or head_dim <= 128 or head_dim % 128 == 0


def flash_serves(length: int, head_dim: int | None = None) -> bool:
    """Whether torch_xla 2.9's flash attention serves rows of `length` tokens with heads `head_dim` wide."""
    return _flash_rows(length) and _flash_heads(length, head_dim)


def flash_round_up(length: int) -> int:
    """The shortest row length from `length` on that torch_xla 2.9's flash attention serves."""
    served = [n for n in FLASH_SHORT_ROWS if n >= length]
    return served[0] if served else -(-length // FLASH_ROW_MULTIPLE) * FLASH_ROW_MULTIPLE


def splash_block(length: int) -> int:
    """The splash kernel's blocks (queries and keys, forward and backward) for rows of `length` tokens."""
    return max(b for b in range(SPLASH_ROW_MULTIPLE, SPLASH_MAX_BLOCK + 1, SPLASH_ROW_MULTIPLE) if length % b == 0)


@functools.cache  # asked for every layer of every traced step (Documents.attend): the environment once
def _jax_refusal() -> str | None:
    """Why neither Pallas kernel can be called here (jax missing, or not the 0.7 its wrappers call), or None."""
    if importlib.util.find_spec("jax") is None:
        return ("it needs jax, which is not installed (pip install 'xla-train[tpu]' brings the jax that "
                "torch_xla 2.9's pallas extra pins)")
    version = importlib.metadata.version("jax")
    if not version.startswith("0.7."):
        return (f"torch_xla 2.9's Pallas kernels call private functions of jax 0.7.1, and jax {version} is installed "
                f"(pip install 'xla-train[tpu]' brings jax 0.7.1)")
    return None


def flash_refusal(length: int | None, head_dim: int | None) -> str | None:
    """Why flash attention cannot serve such rows, or None: jax (`_jax_refusal`), then its rows and heads
    (see `flash_serves`)."""
    reason = _jax_refusal()
    if reason or length is None:
        return reason
    if not _flash_rows(length):
        served = ", ".join(map(str, FLASH_SHORT_ROWS)) + f" or a multiple of {FLASH_ROW_MULTIPLE}"
        return f"flash's blocks (torch_xla 2.9's) serve rows of {served} tokens, not {length}"
    if not _flash_heads(length, head_dim):
        return f"flash's blocks take heads of up to 128 or multiples of 128 in rows over 512 tokens, not {head_dim}"
    return None


@functools.cache
def _flax_found() -> bool:
    # found, not imported: the rule runs in the launching process too (job.row_length), where importing
    # torchax would import jax, which may take the TPU the replicas need (core.megablox asks maybe_get_torchax
    # inside a replica)
    return importlib.util.find_spec("flax") is not None


def _splash_refusal(length: int) -> str | None:
    if not _flax_found():
        return ("splash goes through torch_xla's call_jax, which needs torchax, whose copy in torch_xla 2.9's wheel "
                "imports flax (pip install 'xla-train[tpu]')")
    if length % SPLASH_ROW_MULTIPLE:
        return f"splash's blocks serve rows of a multiple of {SPLASH_ROW_MULTIPLE} tokens, not {length}"
    return None


@functools.cache
def _entries(length: int, block_q: int, block_k: int, window: int | None) -> int:
    """Scores a kernel computes for one head of a row: the (block_q x block_k) blocks that hold a pair it
    keeps (k <= q, and q - k < window), each whole, as flash's `below_or_on_diag` and splash's mask info
    (block_mask: empty blocks skipped) choose them. Segment ids skip nothing (they are data)."""
    kept = 0
    for q0 in range(0, length, block_q):
        for k0 in range(0, length, block_k):
            if k0 <= q0 + block_q - 1 and (window is None or q0 - (k0 + block_k - 1) < window):
                kept += 1
    return kept * block_q * block_k


def attention_cost(kernel: str | None, length: int, window: int | None = None) -> int:
    """Matrix products (score entries times head_dim) one head of a row costs on `kernel`, forward and
    backward, as a first-order count, not a TPU measurement: the mask path (None) computes every score,
    2 products forward and 4 backward; flash its forward blocks (2), its dq pass's (3: the scores again,
    dp, dq) and its dk/dv pass's (4); splash its forward (2), and the backward that call_jax runs as
    jax.vjp, the forward again (2) and the fused dq/dk/dv pass (5)."""
    if kernel is None:
        return 6 * length * length
    if kernel == "flash":
        b, q_dq = min(512, length), min(1024, length)
        return 2 * _entries(length, b, b, None) + 3 * _entries(length, q_dq, b, None) + 4 * _entries(length, b, b, None)
    block = splash_block(length)
    return 9 * _entries(length, block, block, window)


@functools.cache
def pallas_layer(length: int, head_dim: int | None, window: int | None = None, softcap: float | None = None,
                 sinks: bool = False) -> LayerPlan:
    """The rule: which Pallas kernel serves one layer of rows of `length` tokens (heads `head_dim` wide, a
    sliding window shorter than the row or None, soft-capping or None, learned sinks): flash or splash,
    whichever costs fewer products (`attention_cost`; flash on a tie), or none, with the reasons."""
    reason = _jax_refusal()
    if reason:
        return LayerPlan(None, reason, attention_cost(None, length))
    refusals = {"flash": flash_refusal(length, head_dim) or (
        "flash has no sliding window" if window else "flash has no soft-capping" if softcap else
        "flash takes no attention sinks" if sinks else None), "splash": _splash_refusal(length)}
    served = [k for k, why in refusals.items() if why is None]
    if not served:
        return LayerPlan(None, "; ".join(why for why in refusals.values() if why), attention_cost(None, length))
    best = min(served, key=lambda k: attention_cost(k, length, window))  # flash first: it wins a tie
    return LayerPlan(best, None, attention_cost(best, length, window))


def pallas_round_up(length: int) -> int:
    """The shortest row length from `length` on that a Pallas kernel serves (splash: multiples of 128)."""
    if _splash_refusal(-(-length // SPLASH_ROW_MULTIPLE) * SPLASH_ROW_MULTIPLE) is None:
        return -(-length // SPLASH_ROW_MULTIPLE) * SPLASH_ROW_MULTIPLE
    return flash_round_up(length)


serve("xla-tpu", Kernel("pallas", auto=True, refusal=lambda length, head_dim: _jax_refusal(), round_up=pallas_round_up,
                        layer=pallas_layer))


def tpu_present(xla_problem: str | None = None) -> bool:
    """Whether this host has a TPU, checked without starting any runtime. `xla_problem`: why
    torch_xla cannot be imported here (select.xla_problem), raised as a UserError where the check
    takes torch_xla."""
    # PJRT_DEVICE=TPU set by the user counts; a TPU VM exposes its v4 chips as /dev/accel*. Its
    # v5e/v6e chips sit behind /dev/vfio, which any host passing a PCI device through has too, so
    # those are told by torch_xla's own PCI check (Google's vendor id and the TPU device ids:
    # torch_xla 2.9's _internal/tpu.py, num_available_chips), asked only on a host with
    # a Google PCI device, as importing torch_xla costs seconds.
    if os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    if os.path.exists("/dev/accel0"):
        return True
    google = any(_read(p) == "0x1ae0" for p in glob.glob("/sys/bus/pci/devices/*/vendor"))
    if not google or importlib.util.find_spec("torch_xla") is None:
        return False
    if xla_problem:  # importing torch_xla would fail (an undefined symbol), so its check cannot run
        raise UserError(xla_problem)
    from torch_xla._internal import tpu

    return tpu.num_available_chips() > 0


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def pjrt_device() -> str:
    """The PJRT device, picked before torch_xla starts its runtime: without a TPU, the CPU."""
    os.environ.setdefault("PJRT_DEVICE", "TPU" if tpu_present() else "CPU")
    return os.environ["PJRT_DEVICE"].upper()


GIB = 2**30
TPU_HBM = {  # device kind: HBM bytes per device as torch_xla counts devices (Google Cloud's TPU pages)
    "TPU v2": 8 * GIB,  # 16 GiB a chip, two devices (cores)
    "TPU v3": 16 * GIB,  # 32 GiB a chip, two devices
    "TPU v4": 32 * GIB,
    "TPU v5 lite": 16 * GIB,  # v5e
    "TPU v5p": 95 * GIB,
    "TPU v5": 95 * GIB,  # v5p's device kind
    "TPU v6 lite": 32 * GIB,  # v6e (Trillium)
    "TPU7x": 192 * GIB,  # v7 (Ironwood): its device kind as Google's TPU7x names it; not seen here
}
# A TPU VM's accelerator type (torch_xla's _internal/tpu.py, get_tpu_type: "v5litepod" of
# "v5litepod-8") -> PJRT's device kind, for SPMD's virtual device, which has no kind of its own
TPU_TYPE_KIND = {"v2": "TPU v2", "v3": "TPU v3", "v4": "TPU v4", "v5litepod": "TPU v5 lite", "v5e": "TPU v5 lite",
                 "v5p": "TPU v5p", "v6e": "TPU v6 lite", "tpu7x": "TPU7x", "v7x": "TPU7x"}


def device_hbm(kind):
    """A TPU's memory per device by its device kind, or None where not known."""
    return TPU_HBM.get(kind) if kind else None


# What the compilation cache does on torch_xla 2.9, said at the start of a run that asks for it
CACHE_UNLOADABLE = ("the compilation cache: torch_xla 2.9 writes its persistent cache but cannot load it on any device "
                    "(\"Deserializing serialized executable not supported\" on a TPU, pytorch/xla#9094); every run "
                    "compiles its graphs again, and the metrics count the loads the runtime reports (none)")


class XlaAccelerator(Accelerator):
    """An XLA device (a TPU chip's core, or XLA:CPU) through PJRT: lazy tensors, graphs compiled
    per input shape, transfers counted by torch_xla's metrics."""

    name = "xla"
    static_shapes = True
    compile_seconds = 12.0  # one training graph of the bundled model on XLA:CPU, measured here
    token_seconds = 2e-3  # XLA:CPU, training step, per padded token
    compile_refusal = f"the xla backend compiles every step already; {Accelerator.compile_refusal}"

    def __init__(self, virtual: bool = False) -> None:
        # virtual: SPMD's one device that stands for every device of the process
        self.virtual = virtual
        if pjrt_device() == "TPU":
            # Compile cost: Hugging Face's "Hugging Face on PyTorch / XLA TPUs" (huggingface.co/blog/
            # pytorch-xla, 2021) prints torch_xla's CompileTime for a run of its TPU example: 5
            # graphs in 28.9 s (0.43 to 11.1 s each, median 3.65 s), i.e. about 6 s a graph. The
            # post does not say which of its runs (bert-large MLM on a v3-8) printed it; not
            # measured here. The per-token cost is a rough figure for a v4 chip, not measured here.
            self.compile_seconds, self.token_seconds = 6.0, 2e-6
        _register_attention()

    @property
    def device(self) -> torch.device:
        import torch_xla

        return torch_xla.device()

    def describe(self) -> str:
        import torch_xla.runtime as xr

        return f"{self.device} ({xr.device_type()})"

    def kernel_kind(self) -> str:
        return "xla-tpu" if pjrt_device() == "TPU" else "xla"  # as core.attention.kind_of names an XLA tensor

    def adapt_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # Only where the model's own sdpa path computes what its eager one does: Gemma 2's eager
        # attention soft-caps the scores, which sdpa cannot (Gemma2PreTrainedModel._supports_sdpa is
        # False), so such a model keeps its eager attention (whose causal mask reads nothing on the host).
        hf: Any = model  # a transformers model, where it has set_attn_implementation
        if (hasattr(hf, "set_attn_implementation") and hf.config._attn_implementation in ("sdpa", "eager")
                and getattr(hf, "_supports_sdpa", True)):
            hf.set_attn_implementation(XLA_ATTENTION)
        static_experts(model)  # a mixture of experts with shapes that do not depend on the routing
        return model

    def use_compile_cache(self, path: PathLike) -> None:
        import torch_xla.runtime as xr

        # torch_xla 2.9 writes entries but no PJRT device of it loads them back: XLA:CPU counts
        # PersistentCacheDeserializeFailure, a TPU fails with "Deserializing serialized executable
        # not supported" (pytorch/xla#9094, open on 2.9.0; its fix, #9759, is an unreleased pull
        # request) and XLA:GPU the same way (#8930). The run says so once (CACHE_UNLOADABLE) and
        # counts loads as the runtime reports them (compile_stats: cache_hits, cache_load_failures).
        # The cache is the process's (environment variables), and a second call asserts that it
        # is not initialised yet (torch_xla 2.9's runtime.initialize_cache); on
        # Colab's TPU v2-8/v3-8 two replicas share a process as threads. So the first replica
        # of each process sets it. Each process gets a folder of its own, writable: shared, only
        # one process could write it, and graphs with collectives differ per ordinal, so the
        # others would find nothing of theirs (torch_xla's docs: a path per process).
        global _cache_set
        with _CACHE_LOCK:
            if not _cache_set:
                xr.initialize_cache(str(Path(path) / f"p{xr.process_index()}"), readonly=False)
                _cache_set = True
                if xr.global_ordinal() == 0:
                    print(f"xla-train: {CACHE_UNLOADABLE}", flush=True)

    def wrap_loader(self, loader: torch.utils.data.DataLoader, sharding: Any = None) -> Iterable[Batch]:
        import torch_xla.distributed.parallel_loader as pl

        # Uploads batches in a background thread and ends every step with a graph cut.
        return pl.MpDeviceLoader(loader, self.device, input_sharding=sharding)

    def activation_checkpoint(self) -> Callable[..., Any]:
        # torch_xla's checkpoint puts an optimization barrier on the saved inputs; plain
        # torch.utils.checkpoint is undone by XLA's common-subexpression pass and saves nothing
        # (pytorch/xla #1571, #3455). It takes only use_reentrant=True (torch_xla 2.9's
        # torch_xla.utils.checkpoint.checkpoint), and transformers passes it positional arguments only
        # (transformers 5.24's GradientCheckpointingLayer, the forward_with_checkpointing its
        # __init_subclass__ installs).
        from torch_xla.utils.checkpoint import checkpoint

        return checkpoint

    def inference_mode(self) -> AbstractContextManager[Any]:
        # inference tensors are a plain-torch optimisation; no_grad is what torch_xla's examples use
        return torch.no_grad()

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import torch_xla

        # Cut the graph first: the pending step runs once, with everything it computes, and the
        # copy below only transfers. Without the cut, .cpu() would run a pruned copy of it.
        torch_xla.sync()
        return self.read(tensors)  # one transfer for all (a .cpu() each was one transfer each)

    def read(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import torch_xla

        return torch_xla._XLAC._xla_get_cpu_tensors([t.detach() for t in tensors])  # one transfer for all

    def step_closure(self, fn: Callable[..., object], args: Sequence[Any] = ()) -> None:
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(fn, tuple(args))

    def synchronize(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def cut_graph(self) -> None:
        import torch_xla

        torch_xla.sync()  # asynchronous: queues the pending graph and returns

    def seed(self, seed: int, replica: int = 0) -> None:
        import torch_xla.core.xla_model as xm

        torch.manual_seed(seed)
        xm.set_rng_state(seed + replica)

    def seed_micro_batch(self, seed: int, epoch: int, batch: int, replica: int = 0) -> None:
        import torch_xla.core.xla_model as xm

        # Every sync advances the device seed, even with no graph to run (torch_xla's MarkStep:
        # seed = 1012031 + seed * 7012063; seen here: 5, then 36072346 after an empty sync). A
        # host-side setting: the seed reaches the step's graph as the parameter it always is, so no
        # graph and no transfer is added. One value for every process of one replica (an SPMD
        # program's hosts: replica 0), each ddp replica its own.
        xm.set_rng_state(hash((seed + replica, epoch, batch)) % 2**62)

    def rng_state(self) -> torch.Tensor:
        import numpy as np
        import torch_xla.core.xla_model as xm

        seed = np.array([xm.get_rng_state()], dtype=np.uint64).view(np.uint8)  # the device generator's seed
        return torch.cat([torch.get_rng_state(), torch.from_numpy(seed)])

    def set_rng_state(self, state: torch.Tensor) -> None:
        import numpy as np
        import torch_xla.core.xla_model as xm

        Accelerator.set_rng_state(self, state)
        xm.set_rng_state(int(state[-8:].numpy().view(np.uint64)[0]))

    def compile_stats(self) -> dict[str, Any]:
        import torch_xla.debug.metrics as met

        def metric(name):
            data = met.metric_data(name)
            return (data[0], data[1] / 1e9) if data else (0, 0.0)

        compiles, compile_seconds = metric("CompileTime")
        return {
            "compiles": compiles,
            "compile_seconds": compile_seconds,
            "executions": metric("ExecuteTime")[0] + metric("ExecuteReplicatedTime")[0],  # SPMD: replicated
            "transfers": metric("TransferFromDeviceTime")[0],
            "aten_fallbacks": sum(met.counter_value(c) or 0 for c in met.counter_names() if c.startswith("aten::")),
            "cache_hits": met.counter_value("PersistentCacheHit") or 0,
            "cache_misses": met.counter_value("PersistentCacheMiss") or 0,
            "cache_load_failures": met.counter_value("PersistentCacheDeserializeFailure") or 0,
        }

    def start_profile(self, folder: PathLike, run: str) -> tuple[PathLike, str]:
        import torch_xla.debug.profiler as xp

        # no profiler server needed: the session runs in this process and its export writes
        # FOLDER/plugins/profile/TIME/HOST.xplane.pb (torch_xla/debug/profiler.py, start_trace)
        xp.start_trace(str(folder))
        return folder, run

    def stop_profile(self, session: tuple[PathLike, str]) -> None:
        import torch_xla.debug.profiler as xp

        folder, run = session
        self.synchronize()
        xp.stop_trace()
        # TIME is each host's clock at its export: named `run` instead, every host of a pod
        # writes into one run of the profile plugin
        (exported,) = Path(folder, "plugins", "profile").iterdir()
        exported.rename(exported.with_name(run))

    def step_annotation(self, step: int) -> AbstractContextManager[Any]:
        import torch_xla.debug.profiler as xp

        # xp.StepTrace without its two side effects on the graphs: entering it sets the flag that makes
        # the loader's next `next()` skip its graph cut (torch_xla 2.9's StepTrace.__enter__ and
        # __exit__, and PerDeviceLoader.next; the flag is one per process, shared by Colab's
        # threaded replicas), and leaving it cuts the graph. The same event (`_r=1`, `step_num`)
        # around one micro-batch keeps every cut the loader's. Its IR scope must end before the
        # next cut: torch_xla.sync() checks that no scope is open (torch/csrc/lazy/core/ir_metadata.cpp,
        # ResetScopeContext), so an annotation spanning micro-batches would raise.
        return xp.Trace("train_step", _r=1, step_num=step)

    def device_memory(self) -> int | None:
        # SPMD's virtual device has no memory of its own to ask about: each TPU device's HBM by its kind
        return self._memory_info("bytes_limit") or (device_hbm(self.device_kind()) if self.virtual else None)

    def device_kind(self) -> str | None:
        import torch_xla.core.xla_model as xm

        try:
            kind = xm.xla_device_kind(self.device)  # PJRT's device kind: "TPU v4", "TPU v5 lite"; "cpu" here
        except RuntimeError:  # SPMD's virtual device ("Unknown device SPMD:0", seen here): the TPU VM's type
            return self._tpu_type_kind()
        return None if kind.lower() == "cpu" else kind

    def _tpu_type_kind(self) -> str | None:
        """The device kind of this host's TPU by the VM's accelerator type, or None off a TPU."""
        if pjrt_device() != "TPU":
            return None
        from torch_xla._internal import tpu

        try:
            return TPU_TYPE_KIND.get(tpu.get_tpu_type().lower())
        except (OSError, KeyError, TypeError, ValueError):  # no metadata server, no accelerator type
            return None

    def peak_memory(self) -> int | None:
        return self._memory_info("peak_bytes_used")

    def _memory_info(self, key: Literal["bytes_limit", "peak_bytes_used"]) -> int | None:
        import torch_xla.core.xla_model as xm

        if self.virtual:
            return None  # SPMD's one virtual device has no memory of its own to ask about
        # a TPU or GPU device says (torch_xla/core/xla_model.py, get_memory_info); XLA:CPU raises
        # "GetAllocatorStats is not supported" (seen here)
        try:
            # torch_xla 2.9's MemoryInfo TypedDict names bytes_used and bytes_limit only, while the
            # dict it returns (and its docstring's example) has peak_bytes_used too
            return xm.get_memory_info(self.device)[key]  # type: ignore[typeddict-item]
        except RuntimeError:
            return None

    def trace_compilations(self, path: PathLike) -> str | None:
        import torch_xla.debug.metrics as met

        # torch_xla's own compilation analysis (PT_XLA_DEBUG_LEVEL=1: cause and Python frames, one
        # block per compilation, nothing per execution). Both variables are read at the first
        # compilation of the process, so a user's own settings win and a late call does nothing.
        if os.environ.get("PT_XLA_DEBUG_LEVEL", "0") != "0":
            return os.environ.get("PT_XLA_DEBUG_FILE")  # None: the user sends it to stderr
        if met.metric_data("CompileTime"):
            return None
        os.environ["PT_XLA_DEBUG_LEVEL"], os.environ["PT_XLA_DEBUG_FILE"] = "1", str(path)
        return str(path)


_CACHE_LOCK = threading.Lock()
_cache_set = False


class XlaDdp(Strategy):
    """Data parallel: one replica per device under xmp.spawn, gradients all-reduced in
    `xm.optimizer_step`."""

    @property
    def world_size(self) -> int:
        import torch_xla.runtime as xr

        return xr.world_size()

    @property
    def rank(self) -> int:
        import torch_xla.runtime as xr

        return xr.global_ordinal()

    @property
    def is_host_main(self) -> bool:
        import torch_xla.runtime as xr

        # this host's first replica, thread or process (torch_xla 2.9's runtime.local_ordinal)
        return xr.local_ordinal() == 0

    @property
    def replicas_per_process(self) -> int:
        if self.world_size == 1:
            return 1
        import torch_xla.runtime as xr

        # xmp.spawn runs a thread per device the process addresses (torch_xla 2.9's _internal/pjrt.py,
        # _run_thread_per_device): two on Colab's TPU v2-8/v3-8, one on v4 and later
        return xr.addressable_device_count()

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        import torch_xla.core.xla_model as xm

        model = model.to(self.accelerator.device)
        if self.world_size > 1:
            xm.broadcast_master_param(model)  # every replica starts from replica 0's weights
        return model

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None
                       ) -> torch.Tensor | None:
        import torch_xla.core.xla_model as xm

        if not max_grad_norm:
            xm.optimizer_step(optimizer)  # all-reduces gradients, then steps
            return None
        xm.reduce_gradients(optimizer)  # clip the averaged gradients, not each replica's own
        norm = torch.nn.utils.clip_grad_norm_(optimizer_params(optimizer), max_grad_norm)
        optimizer.step()
        return norm

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch_xla.core.xla_model as xm

        return xm.all_gather(tensor, dim=0) if self.world_size > 1 else tensor

    def barrier(self) -> None:
        import torch_xla.core.xla_model as xm

        if self.world_size > 1:  # a rendezvous runs a small graph and reads it back (an aten fallback)
            xm.rendezvous("xla_train.barrier")


class XlaSpmd(XlaDdp):
    """SPMD: one process per host drives every device; each batch is split over the mesh's data
    axes (on one host 2-D inputs, 1-D labels being small and replicated; on several, each host
    loads its own rows and every tensor is split: `input_sharding`) and the partitioner inserts the
    collectives. The world size is 1, but every host has a process (`peers`). Its accelerator is
    virtual (one device for all of them)."""

    data_axes = ("data",)  # the mesh's one axis, over every device of every host

    def planned_data_parallel_size(self, launcher: Launcher) -> int:
        if os.environ["PJRT_DEVICE"].upper() == "TPU":
            from torch_xla._internal import tpu

            return tpu.num_expected_global_devices()  # every chip of every host (see XmpLauncher)
        # every device of the process: CPU_NUM_DEVICES / GPU_NUM_DEVICES (torch_xla/core/xla_env_vars.py),
        # one device when unset
        return int(os.environ.get(f"{os.environ['PJRT_DEVICE'].upper()}_NUM_DEVICES", 1))

    def setup(self) -> None:
        import torch_xla.runtime as xr

        xr.use_spmd()  # before any tensor reaches the device

    @property
    def devices_per_process(self) -> int:
        import torch_xla.runtime as xr

        return xr.global_runtime_device_count()

    @property
    def rank(self) -> int:
        import torch_xla.runtime as xr

        # one process per host drives all its devices: the main one is process 0. The default
        # device's global ordinal would be 0 on every host (torch_xla/runtime.py, process_index)
        return xr.process_index()

    @property
    def is_host_main(self) -> bool:
        return True  # one process per host

    @property
    def replicas_per_process(self) -> int:
        return 1

    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        return ((self.data_axes[0], self.devices_per_process),)

    def mesh(self) -> Any:
        import numpy as np
        import torch_xla.distributed.spmd as xs

        names, sizes = zip(*self.mesh_shape())
        return xs.Mesh(np.arange(math.prod(sizes)), sizes, names)

    def batch_spec(self, dims: int) -> tuple[str | tuple[str, ...] | None, ...]:
        """The partition spec of a tensor of `dims` dimensions split by rows over the data axes."""
        rows = self.data_axes[0] if len(self.data_axes) == 1 else self.data_axes
        return (rows,) + (None,) * (dims - 1)

    def input_sharding(self) -> Any:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        if xr.process_count() == 1:
            # One host: its batch is the global batch, 2-D inputs split by rows, the rest replicated
            return xs.ShardingSpec(self.mesh(), self.batch_spec(2))
        return _HostRows(self)

    @property
    def peers(self) -> int:  # one replica (world_size 1), but a process on every host
        import torch_xla.runtime as xr

        return xr.process_count()

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        # Each process gives its own rows (one per local device) of a tensor sharded over every
        # device: `minibatch` takes a process's data as its part of the global tensor
        # (torch_xla 2.9's xla_model.send_cpu_data_to_device, its convert_fn: "per-host").
        # They are then gathered across the hosts on the device (`gather`); each process alone
        # would give one host's view of a stop.
        local = row[None].expand(xr.addressable_runtime_device_count(), -1).contiguous()
        sharding = xs.ShardingSpec(self.mesh(), self.batch_spec(2), minibatch=True)
        # torch_xla 2.9 annotates send_cpu_data_to_device's result as ToXlaTensorArena; it returns
        # what ToXlaTensorArena.transfer returns: the list given, its tensors on the device
        sent: Any = xm.send_cpu_data_to_device([local], self.accelerator.device, sharding)
        (rows,) = sent
        return self.gather(rows)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch_xla.distributed.spmd as xs

        # One replica (world size 1): every row is here, split over the devices. The result is
        # made whole on every device inside the graph that computes it (the partitioner adds an
        # all-gather), so its copy to the host compiles nothing. The copy of a split tensor builds
        # and compiles an identity program of its own on every host at every copy, uncached
        # (torch_xla 2.9's PjRtComputationClient::ReplicateShardedData, csrc/runtime); a replicated
        # one is read from its first device. `+ 0` makes a result of the graph: a tensor that is
        # device data already would be copied to the host and back to be marked.
        whole = tensor + 0
        xs.mark_sharding(whole, self.mesh(), (None,) * whole.dim())
        return whole


class XlaFsdp(XlaSpmd):
    """FSDPv2: SPMD whose mesh axis is `fsdp`, with every parameter (and so its gradient and
    AdamW's moments) sharded over it, and each batch too. torch_xla's SpmdFullyShardedDataParallel
    wraps each transformer block the model declares (transformers' `_no_split_modules`), then the
    rest; the partitioner gathers a block's weights for its forward and backward only."""

    data_axes = ("fsdp",)  # the name FSDPv2 requires (spmd_fully_sharded_data_parallel.py, __init__)
    loads_shards = True  # job.prepare builds the model without its weights; wrap_model reads its shards

    def __init__(self, accelerator: XlaAccelerator, tensor_parallel: int = 1) -> None:
        """`tensor_parallel` > 1: a 2-D mesh, (fsdp, devices / N) x (tensor, N), each block's
        projections split over `tensor` by the model's tensor-parallel plan (core.tensor_parallel),
        every parameter over `fsdp` too; the batch is split over `fsdp` only, so the N devices of a
        tensor group see the same rows."""
        super().__init__(accelerator)
        self.tensor_parallel = tensor_parallel

    def planned_data_parallel_size(self, launcher: Launcher) -> int:
        devices = super().planned_data_parallel_size(launcher)
        hosts = launcher.host_position()[1]
        if self.tensor_parallel > 1 and hosts > 1:
            # Each host's rows go to torch_xla as its part of the batch (`_HostRows`, minibatch), by a
            # ShardingSpec per rank: a 1-D one, ("fsdp",), over a 2-D mesh comes out TILED with a 2-D
            # tile assignment (distributed/spmd/xla_sharding.py, ShardingSpec.__post_init__ and
            # _get_tile_assignment: unlike Mesh.get_op_sharding, it does not replicate over the axes
            # a spec leaves out), so 1-D labels would not be laid out; not built yet
            raise UserError(f"`tensor_parallel` {self.tensor_parallel} runs on one host only so far (this slice has "
                            f"{hosts} hosts); on a pod, `strategy` fsdp alone shards over every chip")
        self._check_devices(devices)
        return devices // self.tensor_parallel

    def _check_devices(self, devices: int) -> None:
        if devices % self.tensor_parallel:
            raise UserError(f"`tensor_parallel` {self.tensor_parallel} does not divide the {devices} devices")

    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        if self.tensor_parallel == 1:
            return super().mesh_shape()
        self._check_devices(self.devices_per_process)  # an Engine made in a script is not planned first
        # tensor peers are neighbouring devices (the mesh's last axis): on a TPU, chips of one host
        return (("fsdp", self.devices_per_process // self.tensor_parallel),
                (tensor_plan.TENSOR, self.tensor_parallel))

    def check_model(self, config: Any, lora: bool = False) -> None:
        line = tensor_plan.refusal(config, self.tensor_parallel)  # LoRA's layers split as their base's
        if line:
            raise UserError(line)

    @property
    def param_shards(self) -> int:
        return self.devices_per_process

    def param_spec(self, param: torch.Tensor) -> tuple[Any, ...]:
        """The partition spec of `param` over the mesh: FSDPv2's, or under tensor parallelism the
        plan's (which `_plan` gives the parameter itself) else tensor_plan.default_spec."""
        if self.tensor_parallel == 1:
            return _param_spec(param)
        return getattr(param, _PLANNED, None) or tensor_plan.default_spec(param.shape, tensor=True)

    def _plan(self, model: torch.nn.Module) -> None:
        """Each of `model`'s parameters that the plan splits given its spec, as they are now (a
        parameter made anew, on the devices from its shards or sent there, is given it again). On
        the parameter itself: every model a run prepares (a frozen reference too) keeps its own."""
        specs = tensor_plan.planned_specs(model, self.tensor_parallel)
        for name, p in model.named_parameters():
            if name in specs:
                setattr(p, _PLANNED, specs[name])

    def _place(self, model: torch.nn.Module) -> None:
        """Every parameter of `model` still on the host sent to the devices as `param_spec` splits
        it, one at a time (only this host's shards reach its devices); ties kept. FSDPv2's wrappers
        leave a parameter that is split already as it is."""
        placed: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            for attr, p in list(module._parameters.items()):
                if p is None or p.device.type == "xla":
                    continue
                if id(p) not in placed:
                    tensor = self._to_devices(p.detach(), self.param_spec(p))
                    placed[id(p)] = torch.nn.Parameter(tensor, requires_grad=p.requires_grad)
                module._parameters[attr] = placed[id(p)]

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        import functools
        import warnings

        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
            SpmdFullyShardedDataParallel,
        )

        classes = {type(m) for m in blocks_of(model)}
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes) if classes else None
        # its backward barrier hooks warn at every forward whose inputs need no grad (token ids)
        for message in ("For backward hooks to be called", "Full backward hook is firing"):
            warnings.filterwarnings("ignore", message=message)
        # A model built without its checkpoint's weights (job.prepare, core.sharded_load): they are
        # made on the devices already sharded as FSDPv2 shards them, which its wrappers then keep.
        source = getattr(model, sharded_load.SOURCE, None)
        if self.tensor_parallel > 1:
            self.check_model(model.config)  # job.prepare checked it already; an Engine in a script has not
            self._plan(model)  # the parameters as built: on the meta device, or whole on the host
        if source is not None:
            source.materialise(model, self.mesh(), self.param_spec)
            delattr(model, sharded_load.SOURCE)
            print(source.line(), flush=True)
        if self.tensor_parallel > 1:
            self._place(model)  # those on the host (a whole load: LoRA's base, a resumed run; a new head)
            self._plan(model)  # as they are now, made anew on the devices
        import torch_xla.distributed.spmd as xs

        xs.set_global_mesh(self.mesh())  # the Pallas call's layout: rows over fsdp, heads over tensor (core.attention)
        # No `.to(device)` first: each wrapper moves its own module and shards it at once, so the
        # device holds one block unsharded at a time, never the whole model.
        shard = functools.partial(_shard_output, strategy=self)  # outputs split by rows over the data axes
        wrapped = SpmdFullyShardedDataParallel(model, mesh=self.mesh(), shard_output=shard, auto_wrap_policy=policy)
        for m in wrapped.modules():
            if isinstance(m, SpmdFullyShardedDataParallel):
                m.register_state_dict_post_hook(_drop_wrapper_keys)
                m.register_load_state_dict_pre_hook(_add_wrapper_keys)
        return wrapped

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "module", model)  # the model itself; its blocks stay wrapped, keys read as plain

    @contextlib.contextmanager
    def plain_modules(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        # Each block's wrapper is swapped for the module it wraps, then put back: the same
        # parameters under the model's own names (peft finds an adapter's tensors by walking the
        # module names, which hold `_orig_module.` under the wrappers, while the state's keys do not).
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
            SpmdFullyShardedDataParallel,
        )

        wrapped = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
                   if isinstance(child, SpmdFullyShardedDataParallel)]
        for parent, name, child in wrapped:
            parent._modules[name] = child._orig_module
        try:
            yield model
        finally:
            for parent, name, child in reversed(wrapped):
                parent._modules[name] = child

    def to_host(self, tensors: Sequence[torch.Tensor], main_only: bool = False) -> list[torch.Tensor] | None:
        import torch_xla

        torch_xla.sync()
        # every host takes part: on several hosts the copies are collectives
        copies = self._host_copies(tensors, self.accelerator.read)  # the rest in one transfer
        return copies if not main_only or self.is_main else None

    def read(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self._host_copies(tensors, self.accelerator.read)

    def _host_copies(self, tensors: Sequence[torch.Tensor], copy: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
                     ) -> list[torch.Tensor]:
        """Host copies of `tensors`: those split over the devices (weights, AdamW's moments) shard
        by shard, put together here; the others by `copy`. A `.cpu()` of a split tensor compiles
        and runs a graph that replicates it, one per tensor at every copy: 380 compilations in a
        16-step run of the tiny BERT with two checkpoints. Shards compile nothing (how
        torch_xla's distributed checkpoint reads them: distributed_checkpoint/_helpers.py,
        _cpu_shards_from_tensors)."""
        import torch_xla
        import torch_xla.runtime as xr

        tensors = [t.detach() for t in tensors]
        split = [_is_split(t) for t in tensors]
        picked, rest = [t for t, s in zip(tensors, split) if s], [t for t, s in zip(tensors, split) if not s]
        wholes: list[torch.Tensor] = []
        if picked and xr.process_count() > 1:
            # Other hosts' shards cannot be read here. Each tensor is made whole on every device of
            # every host by a graph of its own (`gather`), one tensor at a time (never the whole
            # model on one device), so every host copies the same tensors in the same order
            # (`to_writer` too). Its graph is compiled once for each shape and layout, then
            # cached; a `.cpu()` of the split tensor would compile one at every copy (`gather`).
            wholes = [copy([self.gather(t)])[0] for t in picked]
        elif picked:
            # shards are read from the device data, which a queued graph may still be computing
            self.accelerator.synchronize()
            wholes = [_from_shards(t.shape, [data for data, _ in pieces], [index for _, index in places])
                      for t, pieces, places in zip(picked, torch_xla._XLAC._get_local_shards(picked),
                                                   torch_xla._XLAC._get_local_shard_replica_and_indices(picked))]
        made, copied = iter(wholes), iter(copy(rest) if rest else [])
        return [next(made) if s else next(copied) for s in split]

    def place_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        import torch_xla
        import torch_xla.distributed.spmd as xs

        # A loaded state comes to the device unsharded (Optimizer.load_state_dict casts each
        # tensor to its parameter's device); shard each moment like its parameter.
        for p in optimizer_params(optimizer):
            spec = self.param_spec(p) if torch_xla._XLAC._get_xla_sharding_spec(p) else None
            for value in optimizer.state.get(p, {}).values():
                if (spec and shaped_like(value, p)
                        and not torch_xla._XLAC._get_xla_sharding_spec(value)):  # loaded from shards: laid out already
                    xs.mark_sharding(value, self.mesh(), spec)

    # Checkpoints: each host writes and reads its own shards with torch.distributed.checkpoint and
    # torch_xla's SPMD planners, without a process group (no_dist): every host's folder holds its
    # own metadata, so no host reads another's files, and a resume needs the same hosts and mesh
    # (the devices and hosts are counted, and `load_shards` checks that every local shard was
    # read). torch_xla's CheckpointManager would need a process group.
    writes_shards = True

    def save_shards(self, tensors: dict[str, torch.Tensor], folder: PathLike) -> None:
        import torch.distributed.checkpoint as dcp

        # shards are read from the device data, which a queued graph may still be computing
        self.accelerator.synchronize()
        # per_thread_copy_ahead=0: the planner hands over host copies of the shards, so nothing is copied
        # ahead from a device stream. With it on, torch 2.9's writer (checkpoint/filesystem.py,
        # _write_files_from_queue) takes its stream loader wherever the PrivateUse1 device module says it is
        # available, which torchax's is (torch_xla's mark_sharding imports torchax where flax is installed:
        # the tpu extra), and stopped on "module 'torchax.device_module' has no attribute 'current_stream'"
        writer = dcp.FileSystemWriter(str(folder), per_thread_copy_ahead=0)
        with dcp_errors():
            dcp.save(tensors, storage_writer=writer, planner=_save_planner(), no_dist=True)

    def load_shards(self, tensors: dict[str, torch.Tensor], folder: PathLike) -> None:
        import torch.distributed.checkpoint as dcp
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        self.accelerator.synchronize()
        reader, planner = dcp.FileSystemReader(str(folder)), SPMDLoadPlanner()
        reader.read_metadata()  # its own error: dcp.load turns a damaged one into a bare AssertionError
        # A tensor of which this host's devices hold nothing was not saved by it, and has nothing
        # to load. FSDPv2 splits every parameter over every device, a classifier's bias of 2 too:
        # the devices past a tensor's end get empty ranges (csrc/xla_sharding_util.cpp,
        # GetShardReplicaAndIndicesForDevices clamps each slice to the tensor). SPMDSavePlanner's
        # dedup_tensors (torch_xla 2.9's experimental/distributed_checkpoint/_helpers.py) keys write items
        # by name and offset (torch's MetadataIndex), so the empty shards, which share one offset,
        # are all dropped, and on a host holding none of the tensor (host 1 of 2 x 4 devices) its
        # metadata lacks it: planners.py's _create_xla_read_items would raise a KeyError. A host whose one local shard
        # is empty wrote a chunk of 0 elements, which no read overlaps: the check below would
        # refuse it. The rest of the tensor is on other hosts, which load their shards of it.
        tensors = _held_here(tensors)
        with dcp_errors():
            dcp.load(tensors, storage_reader=reader, planner=planner, no_dist=True)
        # A local shard that no saved chunk overlaps gets no read at all, silently
        # (torch/distributed/checkpoint/planner_helpers.py, create_read_items_for_chunk_list); the
        # planner counts each sharded tensor's elements still to read once its first read comes
        # (torch_xla/experimental/distributed_checkpoint/planners.py, lookup_tensor, commit_tensor).
        unread = [k for k in planner.sharded_state_dict if planner._pending_elements.get(k) != 0]
        if unread:
            raise UserError(f"{folder} does not hold all of this host's shards ({unread[0]}, {len(unread)} "
                            "tensor(s) in all): resume on the hosts and devices that wrote it")

    def zeros_like_param(self, param: torch.Tensor) -> torch.Tensor:
        import torch_xla

        zeros = torch.zeros(param.shape, dtype=param.dtype)
        if not torch_xla._XLAC._get_xla_sharding_spec(param):
            return zeros.to(self.accelerator.device)
        return self._to_devices(zeros, self.param_spec(param))

    def _to_devices(self, tensor: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        """A host tensor on the devices, split over the mesh by `spec`: only this host's shards
        reach its devices (never the whole tensor on one device)."""
        return sharded_load.place(tensor, self.mesh(), spec)


_WRAPPED = "_orig_module."  # the attribute under which FSDPv2 keeps the module it wraps
_PLANNED = "_xla_train_tensor_spec"  # a parameter's partition spec from the tensor-parallel plan (XlaFsdp._plan)


def _drop_wrapper_keys(module, state_dict, prefix, local_metadata):
    """A wrapper's state_dict keys as the model's own (what save_pretrained and a checkpoint
    hold): `layer.0._orig_module.attention...` becomes `layer.0.attention...`."""
    for key in [k for k in state_dict if k.startswith(prefix + _WRAPPED)]:
        state_dict[prefix + key[len(prefix + _WRAPPED):]] = state_dict.pop(key)


def _add_wrapper_keys(module, state_dict, prefix, *args):
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _WRAPPED)]:
        state_dict[prefix + _WRAPPED + key[len(prefix):]] = state_dict.pop(key)


def _is_split(tensor):
    """Whether `tensor` is split over the devices (each holds a part), not whole on each."""
    import torch_xla
    from torch_xla.distributed.spmd import ShardingType

    return tensor.device.type == "xla" and torch_xla._XLAC._get_xla_sharding_type(tensor) in (
        ShardingType.TILED, ShardingType.PARTIAL)


def _held_here(tree):
    """`tree` (dicts of tensors) without the split tensors of which this host's devices hold
    nothing (every local shard an empty range), and without the dicts left empty
    (torch.distributed.checkpoint would look for an empty dict as an item of its own)."""
    import torch_xla

    def none_here(t):
        return _is_split(t) and all(any(s.start == s.stop for s in index) for _, index in
                                    torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0])

    kept = {k: _held_here(v) if isinstance(v, dict) else v for k, v in tree.items()
            if not (torch.is_tensor(v) and none_here(v))}
    return {k: v for k, v in kept.items() if not (isinstance(v, dict) and not v)}


def _save_planner():
    """torch_xla's SPMDSavePlanner writing each slice this host holds once. A tensor split over part
    of a 2-D mesh only (--tensor-parallel: the norms and a kept-whole key/value projection over
    `fsdp`, a column-parallel bias over `tensor`) has two replicas of each slice on the host's
    devices, one write item each under one (name, offset); torch_xla 2.9's dedup_tensors
    (experimental/distributed_checkpoint/_helpers.py), meant for duplicates across hosts' plans,
    keeps the first plan listing a key and drops it from every other listing, and a plan that lists
    it twice is its own other: every replicated tensor was left out of the checkpoint, weights and
    moments, and a resume stopped on its missing key. Only the first replica of a slice is planned
    here; empty slices (past a tensor's end) are left as torch_xla plans them (`_held_here`)."""
    import dataclasses

    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class FirstReplicas(SPMDSavePlanner):
        def create_local_plan(self):
            plan, seen, items = super().create_local_plan(), set(), []
            for item in plan.items:
                chunk = item.tensor_data.chunk if item.tensor_data is not None else None
                if chunk is not None and math.prod(chunk.sizes) > 0:
                    if item.index in seen:  # MetadataIndex compares name and offset only
                        continue
                    seen.add(item.index)
                items.append(item)
            return dataclasses.replace(plan, items=items)

    return FirstReplicas()


def _from_shards(shape, pieces, indices):
    """A tensor of `shape` on the host from its shards and their places in it (Ellipsis: a
    replica of the whole); a shard of an uneven split carries padding past its place."""
    if indices[0] is Ellipsis:
        return pieces[0]
    whole = torch.empty(shape, dtype=pieces[0].dtype)
    for piece, index in zip(pieces, indices):
        whole[tuple(index)] = piece[tuple(slice(0, s.stop - s.start) for s in index)]
    return whole


def _param_spec(param):
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        _prepare_spmd_partition_spec,
    )

    return _prepare_spmd_partition_spec(param, shard_maximal=True)  # how FSDPv2 shards a parameter


def _shard_output(output, mesh, strategy):
    """Tells the partitioner that a block's or the model's output is split by rows over the
    strategy's data axes (FSDPv2: `fsdp`):
    a tensor, a tuple's first tensor, or a ModelOutput's logits, of any rank (the Trainer's
    FSDPv2 `shard_output` takes 3-D outputs only; a classifier's logits are 2-D)."""
    import torch_xla.distributed.spmd as xs

    if isinstance(output, torch.Tensor):
        tensor: torch.Tensor | None = output
    elif getattr(output, "logits", None) is not None:
        tensor = output.logits
    else:
        tensor = output[0] if isinstance(output, (tuple, list)) and isinstance(output[0], torch.Tensor) else None
    if tensor is not None and tensor.dim() > 0:
        xs.mark_sharding(tensor, mesh, strategy.batch_spec(tensor.dim()))


class _HostRows:
    """The input sharding under SPMD on several hosts: each host's process loads only its own
    rows of the global batch (Engine._prepare_loader), and torch_xla takes them as that host's
    part of it (`minibatch`: the global batch is the host's rows times the hosts; the host's
    devices take consecutive slices of them: csrc/init_python_bindings.cpp, XlaShardingSpec's
    constructor; csrc/xla_sharding_util.cpp, ShardTensor and GetShardIndicesForMinibatchTensor).
    Every tensor of the batch with rows is split by rows, whatever its rank: one left whole would
    be replicated from each host's own rows (a ShardingSpec applies only to tensors of its rank:
    distributed/spmd/xla_sharding.py, ShardingSpec.xla_spec and can_apply), so 1-D labels, the
    filler mask and row numbers would differ from host to host.

    It offers what torch_xla reads of a ShardingSpec here: MpDeviceLoader hands an input
    sharding that is not a dict to `xm.send_cpu_data_to_device` (distributed/parallel_loader.py,
    ParallelLoader.send_cpu_data_to_device), which reads `minibatch` and `xla_spec(tensor)` only
    (core/xla_model.py, send_cpu_data_to_device)."""

    minibatch = True

    def __init__(self, strategy):
        self.strategy, self.specs = strategy, {}

    def xla_spec(self, tensor):
        import torch_xla.distributed.spmd as xs

        if tensor.dim() == 0:  # no rows: replicated (the same on every host, or not its part of anything)
            return None
        if tensor.dim() not in self.specs:
            self.specs[tensor.dim()] = xs.ShardingSpec(self.strategy.mesh(), self.strategy.batch_spec(tensor.dim()),
                                                       minibatch=True)
        return self.specs[tensor.dim()].xla_spec(tensor)
