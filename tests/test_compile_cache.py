"""--compile-cache with --compile on the torch-native backends: torch.compile's graphs kept in a folder
the user names (inductor's FX graph cache, AOTAutograd's cache), so that the same job run again in a
fresh process loads them; and --tf32, CUDA's TensorFloat-32 matmuls, refused elsewhere in one line.
The CUDA counterpart of the cache check is in tests/test_cuda.py."""

import warnings

import pytest
import torch
from conftest import run_cli

from gpu_fallback.device import TF32_WARNING, TorchAccelerator
from xla_train.core.errors import UserError


@pytest.mark.torch_native
@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 10),
                    reason="make test-torch runs it (the newest torch): torch 2.9's inductor takes 154 s for it here")
def test_a_second_compiled_run_takes_its_graphs_from_the_cache(mrpc_slice, tiny_model, tmp_path):
    """Two runs of the same compiled job, each in a fresh process, one cache folder: the first
    compiles every graph (the folder is new), the second loads every one of them, in less time,
    and trains the same losses. Measured here (2 CPU cores): torch 2.9 54 s, then 18 s; the
    whole test 154 s with torch 2.9 and 46 s with torch 2.13, which `make test-torch` runs it with."""
    cache = tmp_path / "cache"
    args = ["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, "--buckets", 128, "--max-steps", 3,
            "--log-every", 1, "--compile", "--compile-cache", cache]
    runs = []
    for _ in range(2):
        proc, m = run_cli(args, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append((proc, m))
    (_, first), (proc, second) = runs
    a, b = first["torch_compile"], second["torch_compile"]
    assert a["compiles"] == b["compiles"] == 2  # training's graph and evaluation's
    assert (a["cache_hits"], a["cache_misses"]) == (0, 2) and a["inductor_cache_hits"] == 0
    assert (b["cache_hits"], b["cache_misses"]) == (2, 0) and b["inductor_cache_misses"] == 0
    assert b["compile_seconds"] < a["compile_seconds"]
    assert any(cache.iterdir())  # inductor wrote there, not in /tmp/torchinductor_USER
    assert f"2 graphs, {b['compile_seconds']:.1f} s compiling; 2 of them from the cache ({cache})" in proc.stdout
    torch.testing.assert_close([x for _, x, _ in second["train_loss"]], [x for _, x, _ in first["train_loss"]],
                               atol=1e-6, rtol=0)


def test_the_cache_folder_is_set_before_the_first_compilation(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))  # restored after the test
    cpu = TorchAccelerator("cpu")
    with pytest.raises(UserError, match=r"`compile_cache` keeps torch.compile's graphs: .* needs `compile`"):
        cpu.use_compile_cache(tmp_path / "cache")  # without compile there is nothing to keep
    cpu.use_compile()
    cpu.use_compile_cache(tmp_path / "cache")
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()
    stats = cpu.compile_stats()
    assert {"cache_hits", "cache_misses", "inductor_cache_hits", "inductor_cache_misses"} <= set(stats)


def test_tf32_is_refused_off_cuda_in_one_line(tmp_path, capsys):
    from xla_train.commands.cli import main

    assert main(["train", "--backend", "cpu", "--tf32", "--max-steps", "1", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["xla-train: error: --tf32 applies to the cuda backend (TensorFloat-32 tensor cores), not cpu"]
    with pytest.raises(UserError, match="`tf32` applies to the cuda backend"):
        TorchAccelerator("cpu").use_tf32()


def test_inductors_tf32_advice_stays_off_the_console_without_tf32():
    cpu = TorchAccelerator("cpu")
    cpu.use_compile()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cpu.compile(torch.nn.Linear(2, 2))  # lazy: nothing compiles until it is called
        warnings.warn(f"{TF32_WARNING}. Consider setting `torch.set_float32_matmul_precision('high')`", stacklevel=1)
        warnings.warn("another warning", stacklevel=1)
    messages = [str(w.message) for w in seen]  # torch 2.13's imports add deprecations of their own
    assert "another warning" in messages and not any(TF32_WARNING in m for m in messages)
