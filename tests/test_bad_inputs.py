"""The table of bad inputs in docs/bad-inputs.md: each ends with one clear line on stderr and exit
code 2, and the previous run's checkpoints and model in the output folder stay byte for byte as
they were."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import run_cli, write_slice

from xla_train.commands.cli import main

HEADER = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"


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


def damaged(out, name):
    f = checkpoint(out) / name
    f.write_bytes(f.read_bytes()[:200])  # cut short: torch.load finds no zip archive
    return ["--resume-from", checkpoint(out)]


def unmarked(out):
    (checkpoint(out) / "COMPLETE").unlink()  # as an interrupted upload leaves it
    return ["--resume-from", checkpoint(out)]


def bytes_data(tmp, body):
    folder = write_slice(tmp / "data", 16, 16)
    (folder / "train.tsv").write_bytes(body)
    return ["--data-dir", folder]


def no_model(tmp):
    (tmp / "notes.txt").write_text("a folder without a model")
    return ["--model", tmp]


ROW = b"1\t1\t2\tOne sentence.\tAnother sentence.\r\n"
# name: (extra arguments, given the run's copy and a scratch folder; expected message). Cases
# without --resume pass --overwrite: a failed check must not remove the folder's run either.
CASES = {
    "missing data folder": (lambda out, tmp: ["--data-dir", tmp / "nope"], "data folder not found"),
    "empty data folder": (lambda out, tmp: ["--data-dir", tmp], "missing data file"),
    "missing column": (lambda out, tmp: bad_data(tmp, "Quality\t#1 ID\t#2 ID\t#1 String\n1\t1\t2\ta\n"),
                       "lacks column(s) #2 String"),
    "non-numeric label": (lambda out, tmp: bad_data(tmp, HEADER + "yes\t1\t2\ta\tb\n"),
                          "label must be 0 or 1, found 'yes'"),
    "label not 0/1": (lambda out, tmp: bad_data(tmp, HEADER + "2\t1\t2\ta\tb\n"), "label must be 0 or 1, found '2'"),
    "empty split": (lambda out, tmp: bad_data(tmp, HEADER), "no rows (empty split)"),
    "a Latin-1 byte on line 3": (lambda out, tmp: bytes_data(tmp, HEADER.encode() + ROW + b"0\t3\t4\tCaf\xe9.\tx\n"),
                                 "train.tsv:3: not UTF-8 text (byte 0xe9); save the file as UTF-8"),
    "UTF-16 file": (lambda out, tmp: bytes_data(tmp, (HEADER + "1\t1\t2\ta\tb\n").encode("utf-16")),
                    "train.tsv: UTF-16 text; save it as UTF-8"),
    "fewer rows than one optimizer step": (lambda out, tmp: [*bad_data(tmp, HEADER + "1\t1\t2\ta\tb\n" * 9),
                                                             "--grad-accum", 3],
                                           "9 training rows make 2 batch(es) of 8 x 1 device(s), fewer than one "
                                           "optimizer step takes (--grad-accum 3)"),
    "longer than the model's positions": (lambda out, tmp: ["--max-length", 1024],
                                          "--max-length 1024 is longer than model"),
    "row longer than the longest bucket": (lambda out, tmp: ["--buckets", "32,48"],
                                           "do not fit the longest bucket 48"),
    "metrics file that is a folder": (lambda out, tmp: ["--metrics-out", tmp], "is a folder; name a file"),
    "model folder without a model": (lambda out, tmp: no_model(tmp), "not a model folder (no config.json in it)"),
    "corrupt checkpoint": (lambda out, tmp: corrupt(out), "is corrupt: model.safetensors"),
    "damaged optimizer state": (lambda out, tmp: damaged(out, "optimizer.pt"),
                                "is corrupt: PytorchStreamReader failed reading zip archive"),
    "a blank line among the rows": (lambda out, tmp: bad_data(tmp, HEADER + "1\t1\t2\ta\tb\n\n1\t1\t2\tc\td\n"),
                                    "train.tsv:3: expected 5 tab-separated fields, found 0"),
    "partial checkpoint": (lambda out, tmp: unmarked(out), "is incomplete (no COMPLETE marker"),
    "resume with another batch size": (lambda out, tmp: ["--resume", "--batch-size", 16],
                                       "was made with --batch-size 8; this run has --batch-size 16"),
    "resume with another model": (lambda out, tmp: ["--resume", "--model", Path(out.parent / "other")],
                                  "was made with --model"),
    "resume from a missing checkpoint": (lambda out, tmp: ["--resume-from", checkpoint(out, 99)],
                                         "checkpoint not found"),
    "resume and overwrite": (lambda out, tmp: ["--resume", "--overwrite"], "--overwrite starts a new run"),
    "a checkpoint of another run": (lambda out, tmp: other_run(out), "belongs to run "),
    "a new run into a folder holding one": (lambda out, tmp: ["--no-overwrite"],
                                            "already holds a run (checkpoints at steps 2, 4, a fine-tuned model, "
                                            "finished at step 4): continue it with --resume, or replace it with "
                                            "--overwrite"),
    "missing bucket": (lambda out, tmp: ["--output-dir", "gs://no-such-bucket/run"],
                       "bucket gs://no-such-bucket does not exist"),
    "unknown task": (lambda out, tmp: ["--task", "squad"], "--task must be one of cola, sst2, mrpc"),
    "--compile on the xla backend": (lambda out, tmp: ["--backend", "xla", "--compile"],
                                     "--compile: the xla backend compiles every step already"),
    "--compile with fsdp": (lambda out, tmp: ["--strategy", "fsdp", "--compile"],
                            "--compile: not supported with --strategy fsdp yet; use --strategy ddp"),
    "--compile with dynamic padding": (lambda out, tmp: ["--padding", "dynamic", "--compile"],
                                       "--compile needs static shapes"),
    "--max-new-tokens on a classifier": (lambda out, tmp: ["--max-new-tokens", 8],
                                         "--max-new-tokens applies to a causal LM's --test-file"),
}


def other_run(out):
    """The folder's record names another run than its checkpoints do."""
    record = json.loads((out / "xla_train_run.json").read_text())
    (out / "xla_train_run.json").write_text(json.dumps({**record, "run_id": "someone-else"}))
    return ["--resume-from", checkpoint(out)]


@pytest.mark.parametrize("case", CASES)
def test_bad_input(case, previous_run, mrpc_slice, tiny_model, tmp_path, capsys, request):
    if case == "missing bucket":
        request.getfixturevalue("gcs_emulator")  # the one case that talks to Cloud Storage
    out = tmp_path / "run"
    shutil.copytree(previous_run, out)
    shutil.copytree(tiny_model, out.parent / "other")  # the same weights under another name
    make_args, message = CASES[case]
    (tmp_path / "scratch").mkdir(exist_ok=True)
    extra = [str(a) for a in make_args(out, tmp_path / "scratch")]
    before = digest(out)
    if "--no-overwrite" in extra:
        extra.remove("--no-overwrite")
    elif not {"--resume", "--resume-from"} & set(extra):
        extra.append("--overwrite")
    args = ["train", "--backend", "cpu", "--model", str(tiny_model), "--data-dir", str(mrpc_slice), "--max-steps", "4",
            "--output-dir", str(out), *extra]  # the last of a repeated option wins
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


def test_a_name_that_is_no_folder_where_the_hub_cannot_be_reached(tmp_path):
    """An air-gapped host (the hub's address refuses here): one line at once, saying both, not
    huggingface_hub's five retries printed over half a minute."""
    proc, _ = run_cli(["--backend", "cpu", "--model", "some_name_that_is_no_folder"], tmp_path,
                      env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "xla-train: error: cannot load model 'some_name_that_is_no_folder': no such folder, and it is not in the "
        "hub's cache (http://127.0.0.1:9 cannot be reached from here)"]


def test_harmless_encodings_are_accepted(tmp_path):
    """A byte-order mark and Windows line endings, as spreadsheet programs save files, read the
    same rows as plain UTF-8 (GLUE's TSV and own CSV)."""
    from xla_train.tasks import BUNDLED_MRPC, read_glue_tsv, read_table

    plain = "".join((BUNDLED_MRPC / "train.tsv").read_text(encoding="utf-8").splitlines(keepends=True)[:9])
    (tmp_path / "plain.tsv").write_text(plain, encoding="utf-8")
    (tmp_path / "windows.tsv").write_bytes(b"\xef\xbb\xbf" + plain.replace("\n", "\r\n").encode())
    assert read_glue_tsv(tmp_path / "windows.tsv") == read_glue_tsv(tmp_path / "plain.tsv")
    (tmp_path / "plain.csv").write_text("label,sentence\n1,Déjà vu.\n0,\"a, b\"\n", encoding="utf-8")
    (tmp_path / "windows.csv").write_bytes(b"\xef\xbb\xbf" + "label,sentence\r\n1,Déjà vu.\r\n0,\"a, b\"\r\n".encode())
    assert read_table(tmp_path / "windows.csv")[:] == read_table(tmp_path / "plain.csv")[:]


def test_tokenizer_without_a_padding_token(mrpc_slice, tmp_path, capsys):
    """A decoder (GPT-2) whose tokenizer has no padding token: padded with its end-of-sequence
    token, said in one line, and the model finds each row's last token by it."""
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    from xla_train.models import bundled_model_path

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    tok.eos_token, tok.pad_token = "[SEP]", None
    config = GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=128,
                        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=None)
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    assert AutoTokenizer.from_pretrained(tmp_path / "gpt2").pad_token is None
    assert main(["train", "--backend", "cpu", "--model", str(tmp_path / "gpt2"), "--data-dir", str(mrpc_slice),
                 "--max-steps", "2", "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer of {tmp_path / 'gpt2'}: no padding token; padding with its end-of-sequence token '[SEP]'" in out
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["pad_token_id"] == tok.eos_token_id
    assert AutoTokenizer.from_pretrained(tmp_path / "out").pad_token == "[SEP]"


# Each handler catches what a user's input makes the library raise (seen by damaging the files);
# anything else is a bug, which ends in a traceback and exit 1 rather than in a "user" error.


def _checkpoint_folder(folder):
    """The files of a checkpoint, real but small."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({"w": torch.ones(64, 64)}, str(folder / "model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt"):
        torch.save({"state": torch.arange(100)}, folder / name)
    (folder / "state.json").write_text(json.dumps({"run_id": "r"}))
    return folder


DAMAGE = {  # file: (new content given the old bytes, expected message)
    "state.json": (lambda b: b[:5], "is corrupt: Unterminated string"),
    "optimizer.pt": (lambda b: b[: len(b) // 2], "is corrupt: PytorchStreamReader failed"),
    "scheduler.pt": (lambda b: b"", "is corrupt: "),
    "rng.pt": (lambda b: b"not a tensor file\n" * 10, "is corrupt: "),
}


@pytest.mark.parametrize("name", DAMAGE)
def test_damaged_checkpoint_file_is_one_line(name, tmp_path):
    from xla_train.core.errors import UserError
    from xla_train.run.checkpoint import Resume

    folder = _checkpoint_folder(tmp_path / "step-00000002")
    damage, message = DAMAGE[name]
    (folder / name).write_bytes(damage((folder / name).read_bytes()))
    with pytest.raises(UserError) as e:
        Resume(folder, "URL")
    assert str(e.value).startswith("checkpoint URL is corrupt: ") and message in str(e.value)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_damaged_weights_are_one_line(tmp_path):
    from xla_train.core.errors import UserError
    from xla_train.run.checkpoint import Resume

    folder = _checkpoint_folder(tmp_path / "step-00000002")
    resume = Resume(folder, "URL")
    assert resume.model_weights()["w"].shape == (64, 64)
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:100])
    with pytest.raises(UserError, match="^checkpoint URL is corrupt: model.safetensors: Error while deserializing"):
        resume.model_weights()


class _Loader:
    """Stands for a transformers Auto class: from_pretrained raises what it is given."""

    def __init__(self, error):
        self.error = error

    def from_pretrained(self, name, **kwargs):
        raise self.error


def test_model_loading_tells_a_bad_model_from_a_bug(tmp_path):
    from xla_train.core.errors import UserError
    from xla_train.models import load_pretrained
    from xla_train.tasks import from_folder

    name = str(tmp_path)  # a folder: no question to the hub
    for error in (OSError("no file named model.safetensors"), ValueError("Unrecognized model")):
        with pytest.raises(UserError, match=f"^cannot load model {re.escape(repr(name))}: {error}$"):
            load_pretrained(_Loader(error), name)
    with pytest.raises(TypeError, match="unexpected keyword"):  # a bug: not a user's error
        load_pretrained(_Loader(TypeError("unexpected keyword argument 'num_label'")), name)
    (tmp_path / "config.json").write_text("{}")  # no model_type: transformers raises ValueError
    with pytest.raises(UserError, match="not a transformers model folder .Unrecognized model"):
        from_folder(tmp_path)
    (tmp_path / "config.json").write_text("{oops")  # not JSON: transformers raises OSError
    with pytest.raises(UserError, match="not a transformers model folder .It looks like the config file"):
        from_folder(tmp_path)


def test_main_replica_write_failing_by_a_bug_prints_its_traceback(capsys):
    """A full disk is one line and exit 2; a bug in the write prints its traceback on the main
    replica (before the line goes to every replica) and exits 1."""
    from xla_train import Engine
    from xla_train.core.errors import UserError

    engine = Engine(backend="cpu")

    def full_disk():
        raise OSError(28, "No space left on device")

    with pytest.raises(UserError) as e:
        engine.on_main(full_disk, "cannot write F")
    assert (str(e.value), e.value.exit_code) == ("cannot write F: No space left on device", 2)
    assert capsys.readouterr().err == ""

    def bug():
        return {}["missing key"]

    with pytest.raises(UserError) as e:
        engine.on_main(bug, "cannot write F")
    assert (str(e.value), e.value.exit_code) == ("cannot write F: KeyError: 'missing key'", 1)
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "in bug" in err and "KeyError: 'missing key'" in err
