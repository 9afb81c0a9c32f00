"""Mistakes a user can make end with one clear line on stderr and exit code 2."""

import argparse
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from xla_train.commands.cli import main


@pytest.mark.parametrize("args, message", [
    (["--data-dir", "/no/such/folder"], "data folder not found: /no/such/folder"),
    (["--model", "/no/such/model"], "--model /no/such/model: no such folder"),
    (["--lr", "nan"], "--lr must be a positive number, not nan"),
    (["--lr", "inf"], "--lr must be a positive number, not inf"),
    (["--warmup-ratio", "1"], "--warmup-ratio must be in [0, 1), not 1.0"),
    (["--compile-seconds", "-1"], "--compile-seconds must be a number of seconds >= 0, not -1.0"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be a positive number, not 0.0"),
    (["--seed", "-1"], "--seed must be in [0, 2**32), not -1"),
    (["--num-processes", "0"], "--num-processes must be at least 1, not 0"),
    pytest.param(["--backend", "xla", "--num-processes", "2"],
                 "--num-processes 2: on XLA give 1 (one replica) or leave it out", marks=pytest.mark.xla),
    (["--padding", "ragged"], "--padding must be one of buckets, max_length, dynamic, not 'ragged'"),
    (["--backend", "gpu"], "--backend must be one of auto, xla, tpu, cuda, cpu, not 'gpu'"),
    (["--buckets", "32,x"], "--buckets must be 'auto' or lengths"),
    (["--buckets", "32,48"], "do not fit the longest bucket 48"),
    (["--precision", "fp8"], "--precision must be one of fp32, bf16"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--batch-size", "eight"], "argument --batch-size: invalid int value: 'eight'"),
    (["--unknown-flag"], "unrecognized arguments: --unknown-flag"),
    (["--resume"], "--resume needs --output-dir"),
    (["--save-every", "0"], "--save-every must be at least 1"),
    (["--eval-every", "0"], "--eval-every must be at least 1"),
    (["--test-file", "test.tsv"], "--test-file needs --output-dir"),
    (["--metric-for-best", "mcc"], "--metric-for-best must be one of mrpc's metrics: accuracy, f1; not 'mcc'"),
    (["--task", "cola"], "the bundled data is MRPC only"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    code = main(["train", "--backend", "cpu", *args] if "--backend" not in args else ["train", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("xla-train: error: ")
    assert message in err


def test_the_core_names_parameters_and_the_command_line_shows_flags(monkeypatch):
    """An error of the core names the parameter its caller passed (`num_processes`); once the
    command line has started, every error line shows it as the flag, wherever it is printed (a
    pod's failure line included), and names that are no option stay as written."""
    from xla_train.commands.cli import as_flags
    from xla_train.core import errors

    error = errors.UserError("`num_processes` 3: on XLA give 1, or use `strategy` spmd; `shards` stays")
    monkeypatch.setattr(errors, "_shown", None)  # a loop of one's own: no command line
    assert error.line() == "xla-train: error: `num_processes` 3: on XLA give 1, or use `strategy` spmd; `shards` stays"
    errors.show_parameters(as_flags)  # what cli.main does first
    assert error.line() == "xla-train: error: --num-processes 3: on XLA give 1, or use --strategy spmd; `shards` stays"
    assert str(error) == "`num_processes` 3: on XLA give 1, or use `strategy` spmd; `shards` stays"  # what pickles


def test_malformed_tsv_from_the_cli(tmp_path, capsys):
    (tmp_path / "train.tsv").write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\nx\t1\t2\ta\tb\n")
    (tmp_path / "dev.tsv").write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\ta\tb\n")
    assert main(["train", "--backend", "cpu", "--data-dir", str(tmp_path)]) == 2
    assert f"{tmp_path / 'train.tsv'}:2: label must be 0 or 1, found 'x'" in capsys.readouterr().err


def test_unwritable_output_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["train", "--backend", "cpu", "--output-dir", str(blocker / "sub")]) == 2
    assert "is not writable" in capsys.readouterr().err


def test_console_entry_point_prints_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "xla_train", "train", "--data-dir", "/no/such/folder"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "xla-train: error: data folder not found: /no/such/folder"


def test_env_and_a_default_run_print_no_library_warning(mrpc_slice, tmp_path):
    """On a machine without a TPU, with PJRT_DEVICE unset: no `WARNING:root:Defaulting to
    PJRT_DEVICE=CPU` from an import of torch_xla that nothing uses, no library warning or loading
    bar. The run is the default job (the bundled model, --backend auto) on the MRPC slice."""
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    proc = subprocess.run([sys.executable, "-m", "xla_train", "env"], cwd=ROOT, capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    proc = subprocess.run([sys.executable, "-m", "xla_train", "train", "--data-dir", str(mrpc_slice), "--max-steps",
                           "2"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "Training:" not in line]  # the job's bar
    noisy = [line for line in lines if any(w in line for w in ("Warning", "WARNING", "Loading"))]
    assert not noisy, noisy


def test_help_and_mistakes_of_the_options_start_no_library():
    """`--help` of the tool and of both commands, and a mistake the options show (exit 2), import
    neither torch, transformers, datasets nor torch_xla (--help printed in 4-12 s when the parser
    imported the training module; a wrong --backend waited for torch and transformers)."""
    code = ("import sys\nfrom xla_train.commands.cli import main\n"
            "codes = []\n"
            "for args in (['--help'], ['train', '--help'], ['predict', '--help'], ['train', '--lr', 'nan'],\n"
            "             ['train', '--backend', 'gpu'], ['train', '--strategy', 'zero'], ['train', '--epochs', '0'],\n"
            "             ['predict', '--backend', 'gpu', '--model', '.', '--input', 'a', '--output', 'b.jsonl'],\n"
            "             ['train', '--batch-size', 'eight']):\n"
            "    try:\n        codes.append(main(args))\n    except SystemExit as e:\n        codes.append(e.code)\n"
            "print('codes:', codes)\n"
            "print('loaded:', [m for m in ('torch', 'transformers', 'datasets', 'torch_xla') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-2:] == ["codes: [0, 0, 0, 2, 2, 2, 2, 2, 2]", "loaded: []"]
    assert "--early-stopping-patience" in proc.stdout and "--buckets BUCKETS" in proc.stdout
    assert proc.stderr.count("xla-train: error: ") == 6, proc.stderr



# What the libraries loading during a run's start-up may do with the KeyboardInterrupt of a Ctrl-C
# (each body runs in place of the training command; the signal comes from the process itself).
CTRL_C_IN_A_LIBRARY = {
    # in code run by exec() of a string (dataclasses' and namedtuple's methods, made at every
    # import): CPython then ended the process by SIGINT (-2) after main had returned 130
    "exec": 'exec("os.kill(os.getpid(), signal.SIGINT)\\nfor _ in range(10**7): pass")',
    # an extension module's initialisation (pybind11: scipy's highspy, imported by transformers)
    "extension init": ("try:\n    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
                       "except KeyboardInterrupt as e:\n    raise ImportError('initialization failed') from e"),
    # then an optional import's `except ImportError`: start-up carried on and trained the whole run
    "swallowed": ("try:\n    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\nexcept BaseException:\n    pass\n"
                  "from xla_train.core.signals import StopRequest\nwith StopRequest():\n    print('trained')"),
}


@pytest.mark.parametrize("where", list(CTRL_C_IN_A_LIBRARY))
def test_ctrl_c_whatever_a_library_does_with_it_is_one_line_and_130(where, tmp_path):
    """The same line and exit code as test_run_folder's Ctrl-C at any moment, made certain: the
    signal lands where that test's SIGINT landed now and then while transformers was importing.
    Run with -m, as `python -m xla_train`: CPython's exit by SIGINT is Py_RunMain's, which -c and a
    script (the console entry point) leave before."""
    body = "\n".join("    " + line for line in CTRL_C_IN_A_LIBRARY[where].splitlines())
    (tmp_path / "ctrl_c_run.py").write_text(
        "import os, signal, sys, time\nimport xla_train.commands.cli as cli\n"
        f"def cmd_train(args, started=None):\n{body}\n"
        "cli.cmd_train = cmd_train\nsys.exit(cli.main(['train']))\n")
    proc = subprocess.run([sys.executable, "-m", "ctrl_c_run"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "xla-train: interrupted\n", "")


@pytest.mark.parametrize("command", ["train", "predict"])
def test_every_option_is_declared_once(command):
    """The parser is built from the options' dataclass: the same names, defaults and help."""
    from dataclasses import MISSING

    from xla_train.commands.cli import build_parser
    from xla_train.options import PredictOptions, TrainOptions, kind_option_fields, option_fields

    parser = build_parser()._subparsers._group_actions[0].choices[command]
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    declared = [f for _, f in option_fields(TrainOptions if command == "train" else PredictOptions)]
    own = list(kind_option_fields()) if command == "train" else []  # each kind's own, one flag per name
    assert list(actions) == [f.name for f in declared] + own
    assert all(actions[name].default is argparse.SUPPRESS for name in own)  # given ones only: TrainOptions.own
    for f in declared:
        assert actions[f.name].default == (None if f.default is MISSING else f.default), f.name
        assert actions[f.name].help == f.metadata["help"]
