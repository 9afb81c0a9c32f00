"""Start-up: what a run imports, and the data cache (xla_train/data_cache.py) that lets a second
run of the same data start from its tokenised rows."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import tiny_decoders as td
from conftest import ROOT, assert_same_weights, run_cli
from test_dpo import pairs

from xla_train import data_cache
from xla_train.options import TrainOptions

# Never imported by a run on the CPU, whatever it trains: the TPU runtimes and what they bring.
NOT_ON_THE_CPU = ("torch_xla", "jax", "jaxlib", "torch_tpu", "libtpu", "tensorflow", "flax")


def test_a_cpu_run_of_each_kind_imports_no_tpu_runtime(mrpc_slice, tiny_model, tmp_path):
    """A causal-LM and a DPO run (--backend cpu) and a classification (--backend auto, which picks
    the CPU here) in one fresh process, torch_xla and jax installed beside them (make test's
    .venv): none of them imports a TPU runtime (TorchTPU is not installed here: the variable that
    keeps torch from loading it is checked instead)."""
    model = td.save("llama", tmp_path / "llama", letters=True)
    texts = td.write_jsonl(tmp_path / "texts.jsonl", [{"text": " ".join(r["prompt"].split()[1:4])}
                                                      for r in pairs(64, 1)])
    prefs = td.write_jsonl(tmp_path / "pairs.jsonl", pairs(64, 1))
    runs = [["--backend", "cpu", "--problem", "causal-lm", "--model", model, "--train-file", texts,
             "--validation-file", texts, "--max-length", 32],
            ["--backend", "cpu", "--problem", "dpo", "--model", model, "--train-file", prefs, "--validation-file",
             prefs, "--max-length", 32, "--buckets", 32],
            ["--model", tiny_model, "--data-dir", mrpc_slice]]
    runs = [[str(a) for a in run] for run in runs]
    code = ("import json, os, sys\nfrom xla_train.commands.cli import main\n"
            f"codes = [main(['train', *args, '--max-steps', '1', '--batch-size', '8']) for args in {runs!r}]\n"
            f"print(json.dumps([codes, [m for m in {NOT_ON_THE_CPU!r} if m in sys.modules], "
            "os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD'), os.environ.get('USE_TORCH_XLA')]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the first --backend cpu, before torch is imported, kept torch's device extensions (TorchTPU) unloaded
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[0, 0, 0], [], "0", "0"]


# ---------------------------------------------------------------------------------------------
# The data cache's key


@pytest.fixture
def sources(tmp_path):
    """A data file and a model folder of the bundled model's tokenizer and config (its weights
    linked, not copied), for keys to be taken of."""
    from xla_train.models import bundled_model_path

    model = tmp_path / "model"
    model.mkdir()
    for path in sorted(data_cache.Path(bundled_model_path()).iterdir()):
        if path.is_file():
            (model / path.name).symlink_to(path) if path.name.endswith(data_cache.WEIGHTS) else \
                shutil.copy(path, model / path.name)
    rows = td.write_jsonl(tmp_path / "train.jsonl", [{"text": f"row {i}"} for i in range(8)])
    return model, rows


def _key(model, rows, max_length=64, **options):
    cfg = TrainOptions(problem="causal-lm", model=str(model), train_file=str(rows), validation_file=str(rows),
                       **options)
    return data_cache.key(cfg, max_length)


def test_the_key_changes_with_what_shapes_the_rows_only(sources):
    model, rows = sources
    first = _key(model, rows)
    assert first == _key(model, rows) and len(first) == 32
    # what the rows do not depend on: the optimizer, the output, the checkpoints, the system
    assert _key(model, rows, lr=1e-3, epochs=7, output_dir="elsewhere", save_every=3, log_every=1) == first
    changed = {_key(model, rows, max_length=128), _key(model, rows, text_columns="text"),
               _key(model, rows, packing=False), _key(model, rows, seed=7)}
    assert first not in changed and len(changed) == 4
    rows.write_text(rows.read_text().replace("row 7", "row 8"))  # the data's bytes
    assert _key(model, rows) not in (first, *changed)
    after_data = _key(model, rows)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))  # the tokenizer
    assert _key(model, rows) not in (first, after_data, *changed)


def test_the_key_follows_the_tools_that_render_grpo_prompts(sources, tmp_path):
    """GRPO's --tools and --environment render the prompts with their schemas: another tool, or a
    docstring edited in its file, is another entry."""
    model, rows = sources
    tools = tmp_path / "tools.py"
    tools.write_text('def add(a: int) -> int:\n    """Adds.\n\n    Args:\n        a: A number.\n    """\n'
                     '    return a\n')

    def grpo(**own):
        cfg = TrainOptions(problem="grpo", model=str(model), train_file=str(rows), validation_file=str(rows), own=own)
        return data_cache.key(cfg, 64)

    plain, with_tool, with_environment = grpo(), grpo(tools=f"{tools}:add"), grpo(environment=f"{tools}:Env")
    assert len({plain, with_tool, with_environment}) == 3
    tools.write_text(tools.read_text().replace("Adds.", "Adds one."))
    named = grpo(environment=f"a={tools}:Env")
    assert grpo(tools=f"{tools}:add") != with_tool and grpo() == plain
    tools.write_text(tools.read_text().replace("Adds one.", "Adds two."))
    assert grpo(environment=f"a={tools}:Env") != named


def test_no_key_for_data_not_read_here(sources, tmp_path):
    model, rows = sources
    assert _key(model, tmp_path / "missing.jsonl") is None  # a hub dataset's name
    assert data_cache.key(TrainOptions(data_dir="hub", model=str(model)), 64) is None
    assert data_cache.key(TrainOptions(model="no-such-org/no-such-model"), 64) is None  # neither here nor cached


# ---------------------------------------------------------------------------------------------
# The cache in a run


def test_a_second_run_of_the_same_data_starts_from_the_cache(mrpc_slice, tiny_model, tmp_path, monkeypatch):
    """The same job twice: the second reads the first's entry (and says so) and trains the same
    weights; another --max-length is another entry; --no-data-cache reads and keeps nothing."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    said = "data: the tokenised rows from the cache"
    args = ["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 3]
    runs = []
    for name, extra in (("cold", []), ("warm", []), ("longer", ["--max-length", 96]), ("off", ["--no-data-cache"])):
        proc, m = run_cli([*args, *extra, "--output-dir", tmp_path / name], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append((said in proc.stdout, sorted(p.name for p in (tmp_path / "cache" / "xla_train").iterdir())))
    cold, warm, longer, off = runs
    assert not cold[0] and len(cold[1]) == 1
    assert warm == (True, cold[1])
    assert not longer[0] and len(longer[1]) == 2
    assert off == (False, longer[1])
    assert_same_weights(tmp_path / "cold", tmp_path / "warm", atol=0)


def test_an_entry_written_twice_keeps_one(tmp_path, monkeypatch):
    """Two runs that make the same entry at once: the second rename finds the first's in place and
    keeps it; both runs read their own rows."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    rows = lambda n: (datasets.DatasetDict(train=datasets.Dataset.from_dict({"length": list(range(n))})),  # noqa: E731
                      {"train": n})
    first = data_cache.tokenised("abc", lambda: rows(3))
    data_cache._write(data_cache.folder() / "abc", *rows(5))  # a second writer, after the first
    again = data_cache.tokenised("abc", lambda: rows(7))
    assert first[1:] == ({"train": 3}, False) and again[1:] == ({"train": 3}, True)
    assert again[0]["train"]["length"][:] == [0, 1, 2]
    assert [p.name for p in tmp_path.joinpath("xla_train").iterdir()] == ["abc"]  # no temporary folder left
