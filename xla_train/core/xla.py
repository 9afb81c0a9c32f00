"""torch_xla (PJRT): the XLA accelerator and the rules of its kernels (which Pallas kernel serves
which row). Its strategies are in `xla_train.parallel.xla_strategies` (XlaDdp: replicas under
xmp.spawn; XlaSpmd: one process shards each batch; XlaFsdp: FSDPv2, the model sharded too), its
launchers in `xla_train.parallel.launchers`; `xla_train.core.select` puts them together.

Launch commands these serve:
    xla-train train --backend xla                   # TPU VM: one replica per local chip
    xla-train train --backend xla --strategy spmd   # one process, batch sharded over every chip
    PJRT_DEVICE=CPU xla-train train --backend xla   # XLA on the CPU, one replica (tests)
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 xla-train train --backend xla --strategy spmd   # 4 CPU devices
    xla-train train --backend xla --strategy fsdp   # one process, the model sharded over every chip (FSDPv2)
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import importlib.util
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

import torch

from ..kernels.experts import static_experts
from .errors import UserError
from .roles import (
    Accelerator,
    Batch,
    Kernel,
    LayerPlan,
    PathLike,
    serve,
)

# Attention implementation registered below: transformers' own SDPA attention with a mask
# function that never asks whether the padding mask is all ones (stock "sdpa" evaluates
# `padding_mask.all()` on every forward, masking_utils._ignore_bidirectional_mask_sdpa, which
# on XLA is a device-to-host sync and cuts each step into two graphs), its q, k and v cast to
# autocast's dtype (torch_xla's autocast leaves sdpa's inputs apart). Packed documents on a TPU
# go through kernels.attention's "xla_train_documents" (Pallas flash attention with segment ids),
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
# torch_xla's call_jax by kernels.attention (`splash_forward`), not through torch_xla's wrapper
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
    # torchax would import jax, which may take the TPU the replicas need (kernels.megablox asks maybe_get_torchax
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
        return "xla-tpu" if pjrt_device() == "TPU" else "xla"  # as kernels.attention.kind_of names an XLA tensor

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
