"""One random stream per data-parallel replica (issue 61): where each replica samples its own rows
(ddp on XLA, DDP and FSDP2 on CUDA and gloo) its index is folded into the device's seed, as TRL's
set_seed(seed, device_specific=True) seeds each process; one seed under SPMD and FSDPv2 (one
program samples every row, each host's process must draw alike) and within a tensor-parallel group
(its processes hold the same rows). Two real gloo workers drawing different noise:
test_distributed.py's test_a_failure_in_any_process_reaches_every_one."""

import pytest
import torch

from gpu_fallback import Ddp, Fsdp2, TorchAccelerator
from xla_train.parallel.mesh import Mesh


def placed(cls, accelerator, world, rank, **options):
    """A strategy of `cls` as process `rank` of `world` sees itself (no process group started)."""
    return type(cls.__name__, (cls,), {"world_size": world, "rank": rank})(accelerator, **options)


def test_the_replica_folded_in_is_the_row_share_of_a_replica_of_its_own():
    from xla_train.parallel.xla_strategies import XlaDdp, XlaFsdp, XlaSpmd

    cpu = TorchAccelerator("cpu")
    xla = cpu  # the strategies only keep it here (an XlaAccelerator would start torch_xla: seconds)
    assert [placed(Ddp, cpu, 2, r).sampling_replica for r in (0, 1)] == [0, 1]
    assert [placed(Fsdp2, cpu, 4, r).sampling_replica for r in range(4)] == [0, 1, 2, 3]
    # fsdp 2 x tensor 2: a tensor group's two processes hold the same rows and draw alike
    assert [placed(Fsdp2, cpu, 4, r, mesh=Mesh(tensor=2)).sampling_replica for r in range(4)] == [0, 0, 1, 1]
    assert [placed(XlaDdp, xla, 4, r).sampling_replica for r in range(4)] == [0, 1, 2, 3]
    # SPMD and FSDPv2: one replica (world size 1), a process on every host (rank: its index)
    assert [placed(cls, xla, 1, r).sampling_replica for cls in (XlaSpmd, XlaFsdp) for r in (0, 3)] == [0] * 4
    assert placed(Ddp, cpu, 1, 0).sampling_replica == 0  # one process: the seed as given


def test_the_cpu_device_draws_per_replica():
    """On the CPU the host generator is the device's: seed + replica, as accelerate's
    set_seed(device_specific=True); replica 0 keeps the seed as given (single-process runs and
    their pinned losses unchanged)."""
    cpu = TorchAccelerator("cpu")
    draws = []
    for replica in (0, 1, 0):
        cpu.seed(42, replica)
        draws.append((torch.initial_seed(), torch.rand(4)))
    assert [seed for seed, _ in draws] == [42, 43, 42]
    assert torch.equal(draws[0][1], draws[2][1]) and not torch.equal(draws[0][1], draws[1][1])


@pytest.mark.xla
@pytest.mark.xla_in_process
@pytest.mark.slow
def test_the_xla_device_seed_per_replica():
    """XLA: the host generator keeps the seed (the data order and anything every replica must
    draw alike), the device's takes the replica; each micro-batch's seed too (seed_micro_batch),
    replica 0's unchanged from a run of one replica."""
    import torch_xla.core.xla_model as xm

    from xla_train.core.xla import XlaAccelerator

    xla = XlaAccelerator()
    xla.seed(42, 3)
    assert torch.initial_seed() == 42 and xm.get_rng_state() == 45
    states = []
    for replica in (0, 1):
        xla.seed_micro_batch(42, 1, 5, replica)
        states.append(xm.get_rng_state())
    assert states[0] == hash((42, 1, 5)) % 2**62 and states[1] != states[0]
