"""Shared fixtures: a small slice of MRPC, a tiny BERT for shape-counting runs, a CLI runner.

Everything runs for real: XLA on PJRT's CPU device (in subprocesses, so compilation counters
and caches start empty), gloo processes on loopback, the bundled MiniLM checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import forked_run
import pytest

from xla_train.tasks import BUNDLED_MRPC

ROOT = Path(__file__).resolve().parents[1]

# A shell without job control starts background commands with SIGINT ignored, and processes keep
# an ignored signal across exec: the CLI runs that tests interrupt with SIGINT would never see it.
# A handler here (not inherited) gives them the default back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def write_slice(folder, train_rows, dev_rows):
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", train_rows), ("dev.tsv", dev_rows)):
        lines = (BUNDLED_MRPC / name).read_text(encoding="utf-8").splitlines(keepends=True)
        (folder / name).write_text("".join(lines[: n + 1]), encoding="utf-8")
    return folder


@pytest.fixture(autouse=True)
def _restore_environment():
    """The CPU backend sets USE_TORCH_XLA=0 for its process; keep that out of other tests, and out
    of the environment later fresh runs are forked in (transformers reads it at import). Not
    monkeypatch.delenv: where the variable is unset it records nothing to undo, and a test that
    calls the CLI's main itself left it set for the rest of the session."""
    os.environ.pop("USE_TORCH_XLA", None)
    yield
    os.environ.pop("USE_TORCH_XLA", None)


@pytest.fixture(scope="session")
def mrpc_slice(tmp_path_factory):
    """The first 160 training rows and 48 dev rows of the bundled MRPC."""
    return write_slice(tmp_path_factory.mktemp("data") / "mrpc", 160, 48)


def _tiny_bert(path, dropout):
    """A 2-layer, 32-wide BERT with the bundled tokenizer: the same kinds of graphs, cheap to run."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from xla_train.models import bundled_model_path

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, num_labels=2, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout)
    BertForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny BERT without dropout, so data-parallel runs can be compared with one process."""
    return _tiny_bert(tmp_path_factory.mktemp("tiny_bert"), dropout=0.0)


@pytest.fixture(scope="session")
def tiny_dropout_model(tmp_path_factory):
    """The tiny BERT with dropout 0.1: resumed runs must restore the random state exactly."""
    return _tiny_bert(tmp_path_factory.mktemp("tiny_bert_dropout"), dropout=0.1)


# The start of a script that evaluates in a subprocess (argv: the model's folder, the data's):
# an Engine("xla", {engine}), the dev split in batches of {batch} rows a device, the model prepared.
EVALUATION_SETUP = """
import json, sys, torch
import torch_xla.debug.metrics as met
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from xla_train.core.engine import Engine
from xla_train.core.batching import make_loader
from xla_train.tasks.sequence import tokenize
from xla_train.core.shapes import Padding
from xla_train.evaluation import evaluate_model
from xla_train.tasks import Source, load_task

engine = Engine("xla"{engine})
task, splits = load_task(Source(data_dir=sys.argv[2]))
tok = AutoTokenizer.from_pretrained(sys.argv[1])
data, _ = tokenize(splits, tok, 128)
loader = engine.prepare(make_loader(data["validation"].remove_columns("token_type_ids"), tok, {batch},
                                    Padding("buckets", [128], 128), shuffle=False, seed=0, fill="mask"))
model = engine.prepare(AutoModelForSequenceClassification.from_pretrained(sys.argv[1]))
"""


TINY = ["--max-steps", 16, "--buckets", "64,128", "--log-every", 1]


@pytest.fixture(scope="session")
def tiny_bucketed_run(mrpc_slice, tiny_model, tmp_path_factory):
    """16 steps of the tiny BERT (no dropout) on one XLA:CPU device, two buckets, the loss read
    every step; the reference of the eager-CPU, dynamic-padding and SPMD tests. Returns the
    metrics and the output folder."""
    out = tmp_path_factory.mktemp("tiny_xla")
    proc, m = run_cli(["--backend", "xla", "--model", tiny_model, "--data-dir", mrpc_slice, *TINY,
                       "--output-dir", out / "run"], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return m, out / "run"


@pytest.fixture(scope="session")
def dynamic_run(mrpc_slice, tiny_model, tmp_path_factory):
    """The course's per-batch padding on one XLA:CPU device, 16 steps into an output folder: the
    graph count against buckets (test_xla) and the recompilation warning (test_monitor).
    Returns the completed process, the metrics and the output folder."""
    out = tmp_path_factory.mktemp("dynamic")
    proc, m = run_cli(["--backend", "xla", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 16,
                       "--padding", "dynamic", "--output-dir", out / "run"], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, m, out / "run"


@pytest.fixture(scope="session")
def previous_run(mrpc_slice, tiny_model, tmp_path_factory):
    """An output folder holding a finished 4-step run on the CPU: checkpoints 2 and 4, the final
    model and the run's record. Tests copy it before changing anything."""
    out = tmp_path_factory.mktemp("previous") / "run"
    proc, _ = run_cli(["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 4,
                       "--save-every", 2, "--output-dir", out], out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def reverse_task(tmp_path_factory):
    """The synthetic causal-LM task (tiny_decoders): a 2-layer, 64-wide random Llama over the
    task's 17 words with a chat template, 4,000 prompt/completion training rows, 64 validation
    rows and 24 held-out prompts. Returns {"model", "train", "validation", "held_out"} paths."""
    import tiny_decoders as td

    folder = tmp_path_factory.mktemp("reverse")
    return {"model": td.save("llama", folder / "llama", chat=True, letters=True),
            "train": td.write_jsonl(folder / "train.jsonl", td.reverse_rows(4000, 1)),
            "validation": td.write_jsonl(folder / "validation.jsonl", td.reverse_rows(64, 2)),
            "held_out": td.write_jsonl(folder / "held_out.jsonl", td.reverse_rows(24, 3))}


def reverse_args(task, *extra):
    """The synthetic task's training run: 3 packed epochs of 64-token rows, batch 8 (about 100
    steps an epoch), lr 3e-3."""
    return ["--problem", "causal-lm", "--model", task["model"], "--train-file", task["train"], "--validation-file",
            task["validation"], "--max-length", 64, "--lr", 3e-3, "--warmup-ratio", 0.05, "--log-every", 50, *extra]


@pytest.fixture(scope="session")
def learned_run(reverse_task, tmp_path_factory):
    """The synthetic task learned on the CPU (about 10 s of training), evaluated every 100 steps
    with 4 generated samples, reporting to MLflow; checkpoints every 50 steps; the held-out
    prompts completed at the end (--test-file). Returns (metrics, output folder)."""
    out = tmp_path_factory.mktemp("learned")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{out / 'tracking.db'}"}
    proc, m = run_cli(["--backend", "cpu", *reverse_args(reverse_task, "--eval-every", 100, "--save-every", 50,
                                                         "--eval-samples", 4, "--report-to", "tensorboard,mlflow",
                                                         "--test-file", reverse_task["held_out"],
                                                         "--max-new-tokens", 8),
                       "--output-dir", out / "run"], out, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return m, out / "run"


# Qwen3's tokens for tool calls and their results: added to its vocabulary, not special (Qwen3-0.6B's
# tokenizer_config.json: <tool_call> 151657, </tool_call> 151658, <tool_response> 151665, </tool_response> 151666)
QWEN3_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TOOL_SFT_STEPS = 60  # the fewest of a few tried after which greedy decoding calls the tool (test_tool_traces)


def save_tool_model(path):
    """A tiny random Qwen3 (64 wide, 2 layers) whose tokenizer is of Qwen3's kind, its merges learnt
    from the synthetic task and the tool task's traces (a trace is ~245 tokens, not ~840), with
    Qwen3's tool tokens and its real chat template (TRL 1.16's copy of Qwen3-0.6B's); returns the
    path."""
    import tiny_decoders as td
    import tool_task
    import torch
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, GenerationConfig
    from trl.chat_template_utils import qwen3_chat_template, qwen3_training_chat_template

    base = td.family_tokenizer("qwen3")
    base.chat_template = qwen3_training_chat_template
    traces = [base.apply_chat_template(r["messages"], tools=json.loads(r["tools"]), tokenize=False)
              for r in tool_task.tool_rows(64, 100)]
    tok = td.family_tokenizer("qwen3", traces)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_TOOL_TOKENS])
    tok.chat_template = qwen3_chat_template
    torch.manual_seed(0)
    ids = tok.get_vocab()
    model = AutoModelForCausalLM.from_config(td.config("qwen3", len(tok), token_ids=ids))
    model.generation_config = GenerationConfig(**td._token_ids(td.ZOO["qwen3"]["generation"], ids))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


def tool_sft_args(folder, steps=TOOL_SFT_STEPS):
    """The SFT run that teaches `save_tool_model` (written to `folder`/base) tests/tool_task.py's
    `multiply`: the package's own SFT on `steps` batches of 8 of the task's traces (written to
    `folder`), the CPU backend, lr 1e-2, into `folder`/run, the last evaluation completing two
    validation traces after their tool's result (--eval-samples). Returns the run's arguments."""
    import tiny_decoders as td
    import tool_task

    base = save_tool_model(folder / "base")
    train = td.write_jsonl(folder / "train.jsonl", tool_task.tool_rows(8 * steps, 1))
    validation = td.write_jsonl(folder / "validation.jsonl", tool_task.tool_rows(8, 2))
    return ["--backend", "cpu", "--problem", "causal-lm", "--model", base, "--train-file", train,
            "--validation-file", validation, "--max-length", 256, "--batch-size", 8, "--lr", 1e-2,
            "--warmup-ratio", 0.05, "--max-steps", steps, "--log-every", 10, "--eval-samples", 2,
            "--output-dir", folder / "run"]


@pytest.fixture(scope="session")
def tool_caller(tmp_path_factory):
    """A tiny Qwen3 that calls the tool (`tool_sft_args`: TOOL_SFT_STEPS steps of SFT on traces):
    the model GRPO with the tool starts from. Its calls parse; their arguments are mostly not the
    question's numbers yet (copying them takes some 300 steps). Returns {"model": the trained
    folder, "base": the random model's, "metrics", "seconds": the run's}."""
    pytest.importorskip("trl.chat_template_utils")  # Qwen3's real template (the dev extra)
    folder = tmp_path_factory.mktemp("tool_caller")
    args = tool_sft_args(folder)
    start = time.monotonic()
    proc, m = run_cli(args, folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"model": folder / "run", "base": folder / "base", "metrics": m, "seconds": time.monotonic() - start}


def run_cli(args, tmp_path, env=None, timeout=900, fresh=None):
    """Runs `xla-train train ARGS --metrics-out ...`: in a fresh process where the run needs one
    (`needs_fresh_process`, or `fresh=True`), else in this one through the command's entry
    function (`in_process`), which is what the command runs after its imports.

    Returns (completed process, metrics dict or None).
    """
    out = tmp_path / f"metrics-{len(list(tmp_path.glob('metrics-*.json')))}.json"
    proc = cli("train", [*args, "--metrics-out", out], env=env, timeout=timeout, fresh=fresh)
    metrics = json.loads(out.read_text()) if out.exists() else None
    return proc, metrics


# What a run may be given in its environment and still run in pytest's process: variables read
# when they are used. Others (XLA_FLAGS, CPU_NUM_DEVICES, HF_HUB_OFFLINE, PYTHONPATH, ...) are read
# once, at an import or at a runtime's start: those runs get a process of their own.
READ_WHEN_USED = {"MLFLOW_TRACKING_URI", "STORAGE_EMULATOR_HOST", "TOKENIZERS_PARALLELISM", "PJRT_DEVICE"}


def needs_fresh_process(command, args, env=None):
    """Why a command must run in a process of its own, or None. XLA (its compilation counters and
    caches are per process, and its runtime starts once), torch.compile (its caches too), worker
    processes and process groups (--num-processes, --strategy), and an environment read at import."""
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    for flag in ("--backend", "--num-processes", "--strategy", "--config"):
        pre.add_argument(flag)
    pre.add_argument("--compile", action="store_true")
    known, _ = pre.parse_known_args([str(a) for a in args])
    if command not in ("train", "predict"):
        return f"{command} is not a run"
    if known.config:
        return "a recipe may name any backend"
    if (known.backend or "auto") == "auto":
        from xla_train.core.select import auto_choice

        known.backend = auto_choice()[0]
    if known.backend != "cpu":
        return f"--backend {known.backend}"
    if known.num_processes not in (None, "1") or known.strategy not in (None, "ddp"):
        return "workers or a process group"
    if known.compile:
        return "torch.compile"
    if set(env or {}) - READ_WHEN_USED:
        return f"the environment's {sorted(set(env) - READ_WHEN_USED)}"
    return None


FRESH_DEFAULTS = {"PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"}  # what every fresh run is given
# The session's environment for forked runs (forked_run.py), set once pytest_configure has set it up;
# left empty (every fresh run a new interpreter) with XLA_TRAIN_TEST_FORK=0.
FORKED = []


def cli(command, args, env=None, timeout=900, fresh=None):
    """`xla-train COMMAND ARGS` as a completed process (returncode, stdout, stderr): a fresh
    process where `needs_fresh_process` says so or `fresh` is True (forked from the session's
    forkserver where forked_run.forkable allows, else a new interpreter), else `in_process`."""
    args = [str(a) for a in args]
    if fresh is None:
        fresh = needs_fresh_process(command, args, env) is not None
    if not fresh:
        return in_process([command, *args], env)
    return run_python(["-m", "xla_train", command, *args], {**os.environ, **FRESH_DEFAULTS, **(env or {})}, timeout)


def run_python(argv, env=None, timeout=900, cwd=ROOT):
    """`python ARGV` (`-m MODULE ...` or `-c CODE ...`) in a fresh process with environment `env`
    (None: this one's), as `subprocess.run(..., capture_output=True, text=True)` completes it:
    forked from the session's forkserver where forked_run.forkable allows, else a new interpreter."""
    argv, env = [str(a) for a in argv], dict(os.environ if env is None else env)
    if _forkable(env):
        return forked_run.run(argv, env, cwd, timeout, FORKED[0])
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _forkable(env):
    """Whether a run with environment `env` may be forked (forked_run.forkable). Warns where this
    process's own environment has moved from the session's in a variable outside
    forked_run.FORK_SAFE (a library set it): every later run would silently start a new interpreter."""
    if not FORKED:
        return False
    moved = sorted(k for k in forked_run.changed({**os.environ, **FRESH_DEFAULTS}, FORKED[0]) - forked_run.FORK_SAFE)
    if moved and tuple(moved) not in _MOVED:
        _MOVED.add(tuple(moved))
        warnings.warn(f"pytest's environment changed in {', '.join(moved)} (not in forked_run.FORK_SAFE): fresh runs "
                      "start new interpreters from here on", stacklevel=3)
    return forked_run.forkable(env, FORKED[0])


_MOVED = set()


def in_process(argv, env=None):
    """`xla_train.commands.cli.main(argv)` in this process, as `python -m xla_train ARGV` runs it
    after its imports: stdout and stderr captured (print, tqdm, the libraries' loggers, Python's
    warnings shown as a fresh interpreter shows them), the exit code returned, an exception that
    escapes shown as its traceback with code 1; os.environ and the working folder restored."""
    import contextlib
    import io
    import logging
    import traceback
    import warnings

    from xla_train.commands.cli import main

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    handlers = [h for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
                for h in getattr(lg, "handlers", []) if type(h) is logging.StreamHandler]
    streams = [h.stream for h in handlers]
    for once in ("warning_once", "info_once"):  # transformers' once-per-process messages: once per run here
        getattr(getattr(logging.Logger, once, None), "cache_clear", lambda: None)()
    os.environ.update({"PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    try:
        os.chdir(ROOT)
        for h in handlers:
            h.stream = err  # not setStream: it flushes the old stream, which a test's capsys may have closed
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.resetwarnings()  # a fresh interpreter's filters and display (pytest records them otherwise)
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
            warnings.showwarning = warnings._showwarning_orig
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's exit 2
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:  # what the interpreter would print, and its exit code
                traceback.print_exc()
                code = 1
    finally:
        for h, stream in zip(handlers, streams):
            h.stream = stream
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(argv, code or 0, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def gcs_emulator():
    """gcp-storage-emulator on loopback (in memory) with bucket `xla-train-test`; yields the
    environment that points google-cloud-storage at it."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("gcp-storage-emulator")
    proc = subprocess.Popen([str(exe), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory",
                             "--default-bucket", "xla-train-test", "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the storage emulator did not start"
            time.sleep(0.2)
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ.update(env)  # for the test process's own client too
    yield env
    proc.terminate()
    proc.wait()
    if old is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = old


def assert_same_weights(a, b, atol=1e-6, file="model.safetensors"):
    """The models (or adapters) saved in output folders `a` and `b` are equal within `atol`, tensor by tensor."""
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(Path(a) / file)), load_file(str(Path(b) / file))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=k)


# ---------------------------------------------------------------------------------------------
# Tiers: `make test` runs everything; `make test-fast` (-m "not slow") only the tests that run in
# this process. A test is slow when it, one of its fixtures, or a helper of its module starts a
# process (a CLI run, gloo workers, an XLA:CPU run with fresh counters, the storage emulator).

STARTS_PROCESSES = ("run_cli(", 'cli("', "start_cli(", "run_python(",
                    "subprocess.", "Popen(", "ProcessPoolExecutor", "gcs_emulator",
                    "NotebookClient(", "launch(")


def _source(obj):
    import inspect

    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _slow_names(module):
    """Names of the module's functions that start a process, directly or through one another."""
    import inspect

    funcs = {n: _source(f) for n, f in vars(module).items() if inspect.isfunction(f)}
    slow = {n for n, src in funcs.items() if any(m in src for m in STARTS_PROCESSES)}
    while True:
        more = {n for n, src in funcs.items() if n not in slow and any(f"{s}(" in src for s in slow)}
        if not more:
            return slow
        slow |= more


RUNS = ("run_cli(", 'cli("', "start_cli(", "run_python(",
        "subprocess.run(")  # a fixture that trains (or predicts) once for many tests


def _shared_runs(item):
    """The session- or module-scoped fixtures of `item` that make an expensive run (shared by
    several tests), on any backend: the CPU's learned_run took 90 s in each of the two test
    processes when they made it for themselves (2026-11-25)."""
    return {name for name, defs in item._fixtureinfo.name2fixturedefs.items() for d in defs
            if d.scope in ("session", "module") and any(m in _source(d.func) for m in RUNS)}


def _group_by_shared_runs(items):
    """With pytest-xdist (`make test`: -n 2 --dist loadgroup): tests that share an expensive run,
    directly or through another test, go to one process, so each run happens once."""
    parent = {}

    def root(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    runs = {item.nodeid: sorted(_shared_runs(item)) for item in items}
    for names in runs.values():
        for other in names[1:]:
            parent[root(other)] = root(names[0])
    for item in items:
        if runs[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group("run-" + root(runs[item.nodeid][0])))


# `make test-torch` runs the suite with the newest torch and no torch_xla (.venv-torch): the tests
# marked `xla` need torch_xla and skip there; `make test` (.venv, torch_xla installed) runs them.
NO_XLA = pytest.mark.skip(reason="needs torch_xla, which is not installed here: make test runs it")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        _group_by_shared_runs(items)
    import importlib.util

    xla_installed = importlib.util.find_spec("torch_xla") is not None
    cache = {}
    for item in items:
        if not xla_installed and item.get_closest_marker("xla"):
            item.add_marker(NO_XLA)
        module = item.module
        if module not in cache:
            cache[module] = _slow_names(module) | _slow_names(sys.modules[__name__])
        sources = [_source(item.function)] + [_source(d.func) for defs in item._fixtureinfo.name2fixturedefs.values()
                                              for d in defs]
        if any(m in src for src in sources for m in STARTS_PROCESSES) or \
                any(f"{n}(" in src for src in sources for n in cache[module]):
            item.add_marker(pytest.mark.slow)


def start_cli(args, env=None):
    """Starts `python -m xla_train train ARGS` in a fresh process (not waited for): forked from the
    session's forkserver where forked_run.forkable allows, else a new interpreter."""
    env = {**os.environ, **FRESH_DEFAULTS, **(env or {})}
    if _forkable(env):
        return forked_run.Forked(["-m", "xla_train", "train", *map(str, args)], env, ROOT, FORKED[0])
    return subprocess.Popen([sys.executable, "-m", "xla_train", "train", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc, timeout=300, every=0.005):
    """Polls `condition()` until it holds; fails if `proc` ends first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = condition()
        if found:
            return found
        assert proc.poll() is None, f"the run ended early:\n{proc.communicate()[1][-3000:]}"
        time.sleep(every)
    raise AssertionError("timed out")


def resume_midway(args, whole, out, tmp_path, env=None, step=4):
    """The uninterrupted run in `whole` continued from its own checkpoint `step` into a new folder
    `out` (`--resume-from`): the resumed run's metrics. What a feature's resume test needs (its
    state saved and read back mid-run) without a third run; the preemption protocol itself (a
    signal, the checkpoint it writes, `--resume`) is stop_and_resume's, in test_checkpoint and
    test_fsdp."""
    checkpoint = Path(whole) / "checkpoints" / f"step-{step:08d}"
    proc, resumed = run_cli([*args, "--output-dir", out, "--resume-from", checkpoint], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed["first_step"] == step, resumed.get("first_step")
    return resumed


def stop_and_resume(args, out, tmp_path, sig=signal.SIGTERM, env=None, stopped=None):
    """The preemption protocol: starts `args` into `out`, sends `sig` once checkpoint 4 is
    complete, checks the exit code (128 + signal), calls `stopped(last stderr line, step)` (the
    stopped run's checks, before the resumed run's --keep-last removes its checkpoint) and resumes
    with --resume. Returns (the stopped run's last stderr line, the step it stopped at, the
    resumed run's metrics)."""
    run = start_cli([*args, "--output-dir", out], env=env)
    wait_for(lambda: (Path(out) / "checkpoints" / "step-00000004" / "COMPLETE").exists(), run)
    run.send_signal(sig)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 128 + sig, err[-3000:]
    last = err.strip().splitlines()[-1]
    stopped_at = int(last.split("after step ")[1].split(":")[0])
    if stopped:
        stopped(last, stopped_at)
    proc, resumed = run_cli([*args, "--output-dir", out, "--resume"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last, stopped_at, resumed


# ---------------------------------------------------------------------------------------------
# XLA in pytest's own process (tests/test_matrix.py's XLA:CPU cells). torch's autograd engine sizes
# its per-device queues once, at the process's first backward pass, from the devices it sees then;
# XLA's count is 0 until its runtime has started, so an XLA backward after any CPU backward fails
# ("device_ready_queues_ ... INTERNAL ASSERT FAILED", engine.cpp). The runtime is therefore started
# right after collection, before any test runs, where tests that need it were collected.
IN_PROCESS_XLA = "xla_in_process"  # the marker of such tests (test_matrix.py adds it)
# LLVM -O0: the same graphs and counters, about 3x faster to compile (XLA_TRAIN_TEST_XLA_FLAGS
# replaces it). Set for the whole session, so the XLA:CPU runs tests start (CLI runs, workers)
# compile at -O0 too; a test that gives its own XLA_FLAGS (an HLO dump) replaces it.
XLA_COMPILE_FLAGS = os.environ.get("XLA_TRAIN_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")


_DATA_CACHE = []  # the session's data cache folder, where this process made it


def pytest_configure(config):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_COMPILE_FLAGS}".strip()
    # Several test processes (make test: -n 2): torch's intra-op threads split the cores between
    # them, inherited by every process a test starts. With each taking all the cores, OpenMP's
    # waiting threads spin against the other process's work: a CPU matrix cell took 7 s beside a
    # busy process instead of 0.7 s (2026-11-28). Set before torch is imported, which reads it once.
    workers = getattr(config.option, "numprocesses", None) or 0
    if isinstance(workers, int) and workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    # inductor's cache of compiled kernels (loaded back as extension modules) is one folder per user
    # by default, shared by .venv's torch 2.9 and .venv-torch's newest torch: after `make test-torch`,
    # a kernel the newer torch had cached aborted `make test-fast`'s process in test_attention's
    # compiled flex test (2026-12-02). One folder per torch version, kept between sessions.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        import getpass
        import tempfile
        from importlib.metadata import version

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_torch{version('torch')}")
    # The runs' data cache (xla_train/data_cache.py) in a folder of the session's own, shared by
    # pytest-xdist's workers (they inherit it), so that no entry outlives the session or comes
    # from an earlier one; a run that must start cold gives its own.
    if "HF_DATASETS_CACHE" not in os.environ:
        import tempfile

        _DATA_CACHE.append(tempfile.mkdtemp(prefix="xla-train-test-datasets-"))
        os.environ["HF_DATASETS_CACHE"] = _DATA_CACHE[0]
    if os.environ.get("XLA_TRAIN_TEST_FORK", "1") != "0":
        FORKED.append({**os.environ, **FRESH_DEFAULTS})
    config.addinivalue_line("markers", f"{IN_PROCESS_XLA}: runs torch_xla in pytest's own process (its runtime is "
                            "started after collection: conftest.start_xla_in_process)")


def pytest_unconfigure(config):
    import shutil

    for folder in _DATA_CACHE:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_finish(session):
    import importlib.util

    if importlib.util.find_spec("torch_xla") is None:
        return
    if any(item.get_closest_marker(IN_PROCESS_XLA) for item in session.items):
        start_xla_in_process()


def start_xla_in_process():
    """Starts XLA's runtime in this process on PJRT's CPU device, its compiler at -O0 (the
    session's XLA_FLAGS, pytest_configure). Idempotent."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch
    import torch_xla  # appends its default flags to XLA_FLAGS

    if torch_xla._XLAC._xla_runtime_is_initialized():
        return
    (torch.ones(2, device=torch_xla.device()) + 1).cpu()
