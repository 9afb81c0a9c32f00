"""TorchTPU's `tpu` device and the choice of backend, to the extent this machine can run them:
torch_tpu needs torch 2.11-2.15 and TPU chips, so what runs here is the choice (a pure function of
what a host has), the one-line refusal where TorchTPU is absent, `xla-train env`, and the
torch-native device class under the names torch_tpu registers (read in its wheel, docs/torchtpu.md)."""

import pytest
import torch
import torch.distributed as dist

from gpu_fallback import TorchAccelerator
from xla_train.cli import main
from xla_train.core import select

NONE = {"torch_xla": None, "torch_tpu": None, "libtpu": None}
XLA = {**NONE, "torch_xla": "2.9.0"}
TORCHTPU = {**NONE, "torch_tpu": "0.2.0", "libtpu": "0.0.50"}


@pytest.mark.parametrize("tpu_attached, accelerator, runtimes, backend, reason", [
    (True, "tpu", TORCHTPU, "tpu", "torch sees TorchTPU's tpu device (torch_tpu 0.2.0)"),
    (True, None, XLA, "xla", "a TPU is attached and torch_xla is installed"),
    # a TorchTPU host without torch's tpu device (no chip found, or autoload off): not silently the CPU's
    (True, None, TORCHTPU, "cpu", "a TPU is attached and torch_tpu is installed, but torch sees no tpu device"),
    (True, None, NONE, "cpu", "a TPU is attached but no TPU runtime is installed (pip install 'xla-train[tpu]' "
                              "for torch_xla, or 'xla-train[torchtpu]' for TorchTPU)"),
    (False, "cuda", XLA, "cuda", "torch sees CUDA devices"),  # torch_xla installed on a GPU host: CUDA
    (False, None, XLA, "cpu", "no TPU or CUDA device found"),
    (False, None, NONE, "cpu", "no TPU or CUDA device found"),
])
def test_auto_picks_the_tpu_runtime_that_is_installed(tpu_attached, accelerator, runtimes, backend, reason):
    assert select.auto_backend(tpu_attached, accelerator, runtimes) == (backend, reason)


def test_backend_tpu_without_torch_tpu_is_one_line_naming_the_extra():
    assert select.no_torchtpu_line(NONE) == \
        "--backend tpu is TorchTPU, which is not installed: pip install 'xla-train[torchtpu]'"
    assert select.no_torchtpu_line(XLA) == (
        "--backend tpu is TorchTPU, which is not installed: pip install 'xla-train[torchtpu]' (torch_xla 2.9.0 is "
        "installed here: --backend xla, or auto, runs the TPU through it)")


def test_torch_xla_beside_another_torch_is_one_line():
    assert select.xla_torch_mismatch("2.9.0+cpu", "2.9.0") is None
    assert select.xla_torch_mismatch("2.13.0", None) is None  # no torch_xla: nothing to say
    assert select.xla_torch_mismatch("2.13.0+cpu", "2.9.0") == (
        "torch_xla 2.9.0 needs torch 2.9, but this environment has torch 2.13.0+cpu: pip install "
        "'xla-train[xla]' (or [tpu]), which pins it")


def test_a_google_host_with_torch_xla_beside_another_torch_is_one_line(monkeypatch, capsys):
    """On a v5e/v6e host (a Google PCI device) the TPU check is torch_xla's own, which cannot
    import beside another torch: `train` with --backend auto stops with the mismatch line, and
    `env` still prints its report with the warning instead of a traceback; where torch sees CUDA
    the check is not asked."""
    import importlib.util

    from xla_train.core import xla

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torch_xla"
                        else find_spec(name, *a))
    monkeypatch.setattr(xla.glob, "glob", lambda pattern: ["/sys/bus/pci/devices/0000:00:04.0/vendor"])
    monkeypatch.setattr(xla, "_read", lambda path: "0x1ae0")  # Google's vendor id
    monkeypatch.setattr(select, "installed_version", lambda name: "2.8.0" if name == "torch_xla" else None)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    line = select.xla_torch_mismatch(torch.__version__, "2.8.0")
    with pytest.raises(select.UserError, match="needs torch 2.8"):
        xla.tpu_present(select.xla_problem())
    assert main(["train"]) == 2 and capsys.readouterr().err == f"xla-train: error: {line}\n"
    monkeypatch.setattr(select, "tpu_runtimes", lambda: {**NONE, "torch_xla": "2.8.0"})
    assert main(["env"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"warning       {line}" in out
    assert out[-1] == "--backend auto -> none: the TPU check needs torch_xla, which cannot import beside this torch"
    # a Google GPU host: torch sees CUDA, so no TPU check runs and auto picks CUDA (no TPU VM has CUDA)
    monkeypatch.setattr(select, "torch_accelerator", lambda: "cuda")
    assert select.auto_choice() == ("cuda", "torch sees CUDA devices")


def test_backend_tpu_from_the_cli_here(capsys):
    """Neither environment of the tests has torch_tpu: the line of this environment (with the
    torch_xla hint in .venv, without it in .venv-torch), exit 2, before any data or model is read."""
    assert main(["train", "--backend", "tpu"]) == 2
    assert capsys.readouterr().err == f"xla-train: error: {select.no_torchtpu_line(select.tpu_runtimes())}\n"


@pytest.fixture
def registry(monkeypatch):
    """torch.distributed's backend registry, restored after the test."""
    for name in ("backend_list", "backend_capability", "backend_type_map", "default_device_backend_map", "_plugins"):
        value = getattr(dist.Backend, name)
        monkeypatch.setattr(dist.Backend, name, type(value)(value))
    for attr in ("TPU_DIST", "TPU"):
        monkeypatch.setattr(dist.Backend, attr, None, raising=False)


def test_the_tpu_device_takes_the_process_group_torch_tpu_registers(registry):
    """torch_tpu's load registers two names for the tpu device, "tpu_dist" then "tpu"
    (torch_tpu/_loader.py:296-301); torch maps a device to the first registered for it, and
    TorchAccelerator("tpu") starts that group. Registered here as torch_tpu does it."""

    def create_process_group(*args):  # never called: the group is not started
        raise AssertionError

    for name in ("tpu_dist", "tpu"):
        dist.Backend.register_backend(name, create_process_group, devices=["tpu"])
    accelerator = TorchAccelerator("tpu")
    assert accelerator.process_group == "tpu_dist"
    assert accelerator.accelerated and accelerator.name == "tpu"
    assert (TorchAccelerator("cpu").process_group, TorchAccelerator("cuda").process_group) == ("gloo", "nccl")


def test_env_names_the_tpu_runtimes_and_autos_choice(capsys):
    """`xla-train env` in either environment: torch's version, each TPU runtime with its version or
    `not installed`, the accelerator torch sees, and auto's choice."""
    assert main(["env"]) == 0
    out = capsys.readouterr().out.splitlines()
    runtimes = select.tpu_runtimes()
    assert out[0] == f"torch         {torch.__version__}"
    assert out[1:4] == [f"{name:<14}{runtimes[name] or 'not installed'}" for name in select.TPU_RUNTIMES]
    assert (runtimes["torch_xla"] == "2.9.0") == (torch.__version__.split("+")[0] == "2.9.0")  # its pin
    assert any(line.startswith("PJRT_DEVICE ") for line in out) == bool(runtimes["torch_xla"])
    if not torch.cuda.is_available():  # CI's machines
        assert "accelerator   none (torch sees the CPU only)" in out
        assert out[-1] == "--backend auto -> cpu: no TPU or CUDA device found"
