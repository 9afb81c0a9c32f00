"""The README's table of bad inputs: each ends with one clear line on stderr and exit code 2, and
the previous run's checkpoints and model in the output folder stay byte for byte as they were."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli, write_slice
from xla_train.cli import main

HEADER = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"


@pytest.fixture(scope="module")
def previous_run(mrpc_slice, tiny_model, tmp_path_factory):
    """An output folder holding a finished 4-step run: checkpoints 2 and 4 and the final model."""
    out = tmp_path_factory.mktemp("previous") / "run"
    proc, _ = run_cli(["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 4,
                       "--save-every", 2, "--output-dir", out], out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def bad_data(tmp, train_body):
    folder = write_slice(tmp / "data", 16, 16)
    (folder / "train.tsv").write_text(train_body)
    return ["--data-dir", folder]


def checkpoint(out, step=4):
    return out / "checkpoints" / f"step-{step:08d}"


def corrupt(out):
    f = checkpoint(out) / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])  # a partial write that still carries the marker
    return ["--resume-from", checkpoint(out)]


def unmarked(out):
    (checkpoint(out) / "COMPLETE").unlink()  # as an interrupted upload leaves it
    return ["--resume-from", checkpoint(out)]


CASES = {  # name: (extra arguments, given the run's copy and a scratch folder; expected message)
    "missing data folder": (lambda out, tmp: ["--data-dir", tmp / "nope"], "data folder not found"),
    "empty data folder": (lambda out, tmp: ["--data-dir", tmp], "missing data file"),
    "missing column": (lambda out, tmp: bad_data(tmp, "Quality\t#1 ID\t#2 ID\t#1 String\n1\t1\t2\ta\n"),
                       "lacks column(s) #2 String"),
    "non-numeric label": (lambda out, tmp: bad_data(tmp, HEADER + "yes\t1\t2\ta\tb\n"),
                          "label must be 0 or 1, found 'yes'"),
    "label not 0/1": (lambda out, tmp: bad_data(tmp, HEADER + "2\t1\t2\ta\tb\n"), "label must be 0 or 1, found '2'"),
    "empty split": (lambda out, tmp: bad_data(tmp, HEADER), "no rows (empty split)"),
    "row longer than the longest bucket": (lambda out, tmp: ["--buckets", "32,48"],
                                           "do not fit the longest bucket 48"),
    "corrupt checkpoint": (lambda out, tmp: corrupt(out), "is corrupt: model.safetensors"),
    "partial checkpoint": (lambda out, tmp: unmarked(out), "is incomplete (no COMPLETE marker"),
    "resume with another batch size": (lambda out, tmp: ["--resume", "--batch-size", 16],
                                       "was made with --batch-size 8; this run has --batch-size 16"),
    "resume with another model": (lambda out, tmp: ["--resume", "--model", Path(out.parent / "other")],
                                  "was made with --model"),
    "resume from a missing checkpoint": (lambda out, tmp: ["--resume-from", checkpoint(out, 99)],
                                         "checkpoint not found"),
    "missing bucket": (lambda out, tmp: ["--output-dir", "gs://no-such-bucket/run"],
                       "bucket gs://no-such-bucket does not exist"),
    "unknown task": (lambda out, tmp: ["--task", "squad"], "--task must be one of cola, sst2, mrpc"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input(case, previous_run, mrpc_slice, tiny_model, gcs_emulator, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(previous_run, out)
    shutil.copytree(tiny_model, out.parent / "other")  # the same weights under another name
    make_args, message = CASES[case]
    extra = [str(a) for a in make_args(out, tmp_path / "scratch")]
    before = digest(out)
    args = ["train", "--backend", "cpu", "--model", str(tiny_model), "--data-dir", str(mrpc_slice), "--max-steps", "4",
            "--output-dir", str(out), *extra]  # the last of a repeated option wins
    (tmp_path / "scratch").mkdir(exist_ok=True)
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("xla-train: error: "), err
    assert message in err
    assert digest(out) == before  # nothing saved before was touched


def test_no_cloud_credentials(tmp_path):
    """Without the emulator, credentials or a metadata server: one line before any work."""
    proc, _ = run_cli(["--backend", "cpu", "--output-dir", "gs://some-bucket/run"], tmp_path,
                      env={"STORAGE_EMULATOR_HOST": "", "GOOGLE_APPLICATION_CREDENTIALS": "", "HOME": str(tmp_path),
                           "GCE_METADATA_IP": "127.0.0.1:9", "GCE_METADATA_HOST": "127.0.0.1:9"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "xla-train: error: no Google Cloud credentials for gs://some-bucket/run: run `gcloud auth "
        "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"]


def test_unknown_model_name_offline(tmp_path):
    proc, _ = run_cli(["--backend", "cpu", "--model", "no-such-org/no-such-model"], tmp_path,
                      env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "xla-train: error: cannot load model 'no-such-org/no-such-model': ")
    assert "Traceback" not in proc.stderr


def test_resuming_a_finished_run_trains_nothing_and_reports_it(previous_run, mrpc_slice, tiny_model, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(previous_run, out)
    metrics = tmp_path / "m.json"
    assert main(["train", "--backend", "cpu", "--model", str(tiny_model), "--data-dir", str(mrpc_slice),
                 "--max-steps", "4", "--save-every", "2", "--output-dir", str(out), "--resume",
                 "--metrics-out", str(metrics)]) == 0
    m = json.loads(metrics.read_text())
    assert m["first_step"] == m["steps"] == 4 and m["eval"]["n"] == 48
