"""`xla-train predict`, --test-file, and model selection (--eval-every, --save-best, early stopping,
resume), for real on the CPU, two gloo workers, and XLA:CPU (one device and SPMD over four)."""

import csv
import json

import pytest
import torch
from conftest import assert_same_weights, cli, run_cli

from xla_train.commands.cli import main
from xla_train.tasks import BUNDLED_MRPC, read_glue_tsv

# A regression on MRPC's sentences whose dev MSE, at --lr 5e-2 with the tiny BERT, falls to its
# best at step 3 and rises after it (seeded, so the same on every run): the case where the last
# evaluation is worse than an earlier one.
SELECT = ["--label-column", "score", "--eval-every", 1, "--metric-for-best", "mse", "--lr", 5e-2]


def run_predict(args, env=None):
    return cli("predict", args, env=env)


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    rows = read_glue_tsv(BUNDLED_MRPC / "train.tsv")
    pairs = list(zip(rows["text1"], rows["text2"], rows["label"]))
    for name, part in (("train", pairs[:64]), ("dev", pairs[64:84])):
        with open(root / f"sim_{name}.jsonl", "w") as f:
            for i, (a, b, label) in enumerate(part):
                score = round(i % 6 * 0.8 + label * 0.5, 2)
                f.write(json.dumps({"sentence1": a, "sentence2": b, "score": score}) + "\n")
    with open(root / "pairs.csv", "w", newline="") as f:  # 21 rows: the last batch of 8 (or 2 x 8) is filled
        writer = csv.writer(f)
        writer.writerow(["id", "sentence1", "sentence2"])
        writer.writerows((i, a, b) for i, (a, b, _) in enumerate(pairs[100:121]))
    test = (BUNDLED_MRPC / "test.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    (root / "test.tsv").write_text("".join(test[:31]), encoding="utf-8")  # GLUE's own test layout, 30 rows
    return root


@pytest.fixture(scope="session")
def selected(files, tiny_model, tmp_path_factory):
    """--save-best and early stopping in one run: evaluations every step, patience 2."""
    tmp = tmp_path_factory.mktemp("selected")
    proc, m = run_cli(["--backend", "cpu", "--model", tiny_model, "--train-file", files / "sim_train.jsonl",
                       "--validation-file", files / "sim_dev.jsonl", *SELECT, "--save-best",
                       "--early-stopping-patience", 2, "--max-steps", 30, "--output-dir", tmp / "out"], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, m, tmp / "out"


@pytest.fixture(scope="session")
def classifier(mrpc_slice, tiny_model, files, tmp_path_factory):
    """A classifier fine-tuned on MRPC rows, with predictions for 30 rows of MRPC's test.tsv."""
    tmp = tmp_path_factory.mktemp("classifier")
    proc, m = run_cli(["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 6,
                       "--lr", 1e-3, "--output-dir", tmp / "out", "--test-file", files / "test.tsv"], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return m, tmp / "out"


def test_save_best_keeps_the_better_of_two_evaluations(selected):
    _, m, out = selected
    mse = {step: r["mse"] for step, r in m["evaluations"]}
    best_step = min(mse, key=mse.get)
    assert m["evaluations"][-1][1]["mse"] > mse[best_step]  # the case: the last evaluation is worse
    assert m["best"] == {"step": best_step, "metric": "mse", "value": mse[best_step]}
    assert m["eval"]["mse"] == mse[best_step]  # the saved model is the best one
    assert_same_weights(out, out / "checkpoints" / "best")


@pytest.mark.torch_native
def test_save_best_with_lora_keeps_the_trained_tensors_only(files, tiny_model, tmp_path):
    """--lora --save-best: the best evaluation's weights are the adapters and the head, not the
    frozen base, and the adapter the run ends with is the best one (put back from them)."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    proc, m = run_cli(["--backend", "cpu", "--model", tiny_model, "--train-file", files / "sim_train.jsonl",
                       "--validation-file", files / "sim_dev.jsonl", *SELECT, "--lora", "--save-best",
                       "--lr", 0.3, "--max-steps", 8, "--output-dir", out], tmp_path)  # best at step 6 (seeded)
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = load_file(str(out / "checkpoints" / "best" / "model.safetensors"))
    assert sum(t.numel() for t in best.values()) == m["trainable_params"] < 0.1 * m["total_params"]
    mse = {step: r["mse"] for step, r in m["evaluations"]}
    assert m["evaluations"][-1][1]["mse"] > min(mse.values())  # the case: the last evaluation is worse
    assert m["eval"]["mse"] == min(mse.values())
    adapter = load_file(str(out / "adapter_model.safetensors"))

    def peft_name(key):  # peft saves without the adapter's name and the head's copy's prefix
        return key.replace(".modules_to_save.default", "").replace(".default", "")

    assert {peft_name(k) for k in best} == set(adapter)
    for k, v in best.items():
        torch.testing.assert_close(adapter[peft_name(k)], v, atol=0, rtol=0)


def test_early_stopping_stops(selected):
    proc, m, _ = selected
    steps = [s for s, _ in m["evaluations"]]
    assert m["stopped_early"] and m["steps"] == steps[-1] < 30
    assert steps[-1] - m["best"]["step"] == 2  # two evaluations without improvement
    assert f"early stopping at step {m['steps']}: mse has not improved in 2 evaluation(s)" in proc.stdout + proc.stderr


def test_resume_keeps_the_best_and_the_patience_count(files, tiny_model, tmp_path):
    common = ["--backend", "cpu", "--model", tiny_model, "--train-file", files / "sim_train.jsonl",
              "--validation-file", files / "sim_dev.jsonl", *SELECT, "--save-best", "--save-every", 2,
              "--output-dir", tmp_path / "out"]
    proc, first = run_cli([*common, "--max-steps", 4], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, resumed = run_cli([*common, "--max-steps", 12, "--resume", "--early-stopping-patience", 2], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed["first_step"] == 4 and resumed["evaluations"][:4] == first["evaluations"]
    # the rule applied to every evaluation, the ones before the resume included
    best, bad, stop = None, 0, None
    for step, r in resumed["evaluations"]:
        if best is None or r["mse"] < best[1]:
            best, bad = (step, r["mse"]), 0
        else:
            bad += 1
        if bad == 2:
            stop = step
            break
    assert resumed["best"] == {"step": best[0], "metric": "mse", "value": best[1]}
    assert resumed["steps"] == (stop or 12) and resumed["stopped_early"] == bool(stop)
    assert_same_weights(tmp_path / "out", tmp_path / "out" / "checkpoints" / "best")


def test_eval_every_compiles_nothing_new_after_the_first_evaluation(mrpc_slice, tiny_model, tmp_path):
    out = tmp_path / "out"
    proc, m = run_cli(["--backend", "xla", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 9,
                       "--eval-every", 3, "--buckets", "128", "--output-dir", out], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s for s, _ in m["evaluations"]] == [3, 6, 9]
    events = json.loads((out / "compilations.json").read_text())["compilations"]
    assert any(e["phase"] == "eval" and e["step"] == 3 for e in events)
    assert [e for e in events if e["step"] > 3] == []  # later evaluations and the steps between them
    assert m["xla"]["aten_fallbacks"] == 0


def test_train_test_file_writes_glue_submission_rows(classifier, files):
    m, out = classifier
    lines = (out / "predictions.tsv").read_text().splitlines()
    assert m["predictions"] == str(out / "predictions.tsv")
    assert lines[0] == "index\tprediction" and len(lines) == 31
    assert [ln.split("\t")[0] for ln in lines[1:]] == [str(i) for i in range(30)]
    assert {ln.split("\t")[1] for ln in lines[1:]} <= {"0", "1"}


def reference(model_dir, csv_path):
    """Plain transformers on the same rows: the probabilities of each class."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForSequenceClassification.from_pretrained(model_dir)
    enc = tok([r["sentence1"] for r in rows], [r["sentence2"] for r in rows], padding=True, truncation=True,
              max_length=128, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.softmax(-1)


def read_predictions(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="session")
def single_process(classifier, files, tmp_path_factory):
    _, model = classifier
    out = tmp_path_factory.mktemp("pred") / "pred.csv"
    proc = run_predict(["--model", model, "--input", files / "pairs.csv", "--output", out, "--backend", "cpu"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_predictions(out)


@pytest.mark.torch_native
def test_predictions_equal_plain_transformers(classifier, files, single_process):
    _, model = classifier
    probs = reference(model, files / "pairs.csv")
    labels = ["not_equivalent", "equivalent"]
    assert [r["id"] for r in single_process] == [str(i) for i in range(21)]  # input order, each row once
    assert [r["prediction"] for r in single_process] == [labels[i] for i in probs.argmax(-1).tolist()]
    torch.testing.assert_close(torch.tensor([float(r["score"]) for r in single_process]), probs.max(-1).values,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("args, env", [
    (["--backend", "cpu", "--num-processes", 2], {}),  # two gloo workers, each predicting a shard
    (["--backend", "xla", "--strategy", "spmd"], {"CPU_NUM_DEVICES": "4"}),  # one batch sharded over 4 devices
])
def test_replicas_predict_each_row_once_in_input_order(args, env, classifier, files, single_process, tmp_path):
    _, model = classifier
    out = tmp_path / "pred.jsonl"
    proc = run_predict(["--model", model, "--input", files / "pairs.csv", "--output", out, *args], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(21))
    assert [r["prediction"] for r in rows] == [r["prediction"] for r in single_process]
    torch.testing.assert_close(torch.tensor([r["score"] for r in rows]),
                               torch.tensor([float(r["score"]) for r in single_process]), atol=1e-4, rtol=0)
    if "xla" in args:
        line = next(ln for ln in (proc.stdout + proc.stderr).splitlines() if "graphs compiled for buckets" in ln)
        compiled, buckets = int(line.split("; ")[1].split()[0]), json.loads(line.split("for buckets ")[1])
        assert 1 <= compiled <= len(buckets)


BAD = {  # name: (arguments, given the classifier folder and a scratch folder; expected message)
    "not a classifier": (lambda model, tmp: ["--model", _bundled(), "--input", tmp / "in.csv", "--output",
                                             tmp / "o.csv"],
                         "neither a fine-tuned sequence classifier nor a causal LM"),
    "input without the trained text columns": (lambda model, tmp: ["--model", model,
                                                                   "--input", _write(tmp, "x,y\n1,2\n"),
                                                                   "--output", tmp / "o.csv"],
                                               "no column 'sentence1', 'sentence2', which the model was trained on"),
    "output is a folder": (lambda model, tmp: ["--model", model, "--input", _write(tmp), "--output", tmp],
                           "unknown file type"),
    "output is a folder named like a file": (lambda model, tmp: ["--model", model, "--input", _write(tmp), "--output",
                                                                 _folder(tmp / "o.csv")], "is a folder"),
    "input with zero rows": (lambda model, tmp: ["--model", model, "--input", _write(tmp, "sentence1,sentence2\n"),
                                                 "--output", tmp / "o.csv"], "no rows"),
}


def _bundled():
    from xla_train.models import bundled_model_path

    return bundled_model_path()


def _write(tmp, body="sentence1,sentence2\na,b\n"):
    (tmp / "in.csv").write_text(body)
    return tmp / "in.csv"


def _folder(path):
    path.mkdir()
    return path


@pytest.mark.parametrize("case", BAD)
def test_bad_predict_input(case, classifier, tmp_path, capsys):
    _, model = classifier
    make, message = BAD[case]
    _write(tmp_path)
    args = [str(a) for a in make(model, tmp_path)]
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["predict", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("xla-train: error: "), err
    assert message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_predict_makes_the_output_files_missing_folders(classifier, tmp_path):
    """One policy for files a command writes (--output, --metrics-out): missing folders are made."""
    _, model = classifier
    out = tmp_path / "new" / "folder" / "o.csv"
    assert main(["predict", "--backend", "cpu", "--model", str(model), "--input", str(_write(tmp_path)),
                 "--output", str(out)]) == 0
    assert out.read_text().splitlines()[0] == "sentence1,sentence2,prediction,score"



def test_the_report_plots_the_evaluations_of_eval_every(selected):
    _, m, out = selected
    assert len(m["evaluations"]) > 1
    png = out / "report" / "eval.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "![evaluations](eval.png)" in (out / "report" / "report.md").read_text()
