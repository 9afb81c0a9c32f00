"""GLUE tasks besides MRPC and a user's own files: reading, labels, metrics, bad input, and short
real runs on the CPU and on XLA:CPU. Every file is written here from MRPC's real sentences."""

import csv
import json

import pytest
from conftest import run_cli

from xla_train.commands.cli import main
from xla_train.core.errors import UserError
from xla_train.tasks import (
    BUNDLED_MRPC,
    Source,
    check_choices,
    glue_columns,
    load_glue_hub,
    load_metric,
    load_mrpc,
    load_task,
    read_glue_tsv,
)

STSB_HEADER = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
               "score"]
MNLI_HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
               "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
NLI = ("entailment", "neutral", "contradiction")


def mrpc_pairs(n, offset=0):
    """(sentence1, sentence2, label) from the bundled MRPC training file, as GLUE's reader reads it."""
    rows = read_glue_tsv(BUNDLED_MRPC / "train.tsv")
    return list(zip(rows["text1"], rows["text2"], rows["label"]))[offset:offset + n]


def write_csv(path, header, rows, delimiter=","):
    with open(path, "w", newline="", encoding="utf-8") as f:  # the usual quoting: csv.QUOTE_MINIMAL
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_glue_tsv(path, header, rows):
    """GLUE's own layout: tabs, no quoting (its sentences hold bare quote characters)."""
    path.write_text("".join("\t".join(map(str, r)) + "\n" for r in [header, *rows]), encoding="utf-8")


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    """name: (data arguments, dev rows, expected task fields); 64 training rows, 20 dev rows each."""
    root = tmp_path_factory.mktemp("sources")
    train, dev = mrpc_pairs(64), mrpc_pairs(20, offset=64)
    out = {}
    # own CSV: a pair, three string classes, with commas and quotes in the text
    for split, rows in (("train", train), ("dev", dev)):
        write_csv(root / f"nli_{split}.csv", ["premise", "hypothesis", "label"],
                  [(a, b, NLI[i % 3]) for i, (a, b, _) in enumerate(rows)])
    out["csv 3 classes"] = (["--train-file", root / "nli_train.csv", "--validation-file", root / "nli_dev.csv"],
                            20, {"task": "custom", "problem": "classification",
                                 "labels": ["contradiction", "entailment", "neutral"], "num_labels": 3},
                            {"accuracy", "f1"})
    # own JSON lines: a regression on a column named score
    for split, rows in (("train", train), ("dev", dev)):
        (root / f"sim_{split}.jsonl").write_text("".join(
            json.dumps({"sentence1": a, "sentence2": b, "score": round(i % 6 * 0.8 + label * 0.5, 2)}) + "\n"
            for i, (a, b, label) in enumerate(rows)))
    out["jsonl regression"] = (["--train-file", root / "sim_train.jsonl", "--validation-file", root / "sim_dev.jsonl",
                                "--label-column", "score"], 20,
                               {"task": "custom", "problem": "regression", "labels": None, "num_labels": 1},
                               {"pearson", "spearmanr", "mse"})
    # own TSV: one sentence, integer labels
    for split, rows in (("train", train), ("dev", dev)):
        write_csv(root / f"single_{split}.tsv", ["sentence", "label"], [(a, label) for a, _, label in rows], "\t")
    out["tsv single sentence"] = (["--train-file", root / "single_train.tsv", "--validation-file",
                                   root / "single_dev.tsv"], 20,
                                  {"task": "custom", "problem": "classification", "labels": ["0", "1"],
                                   "num_labels": 2}, {"accuracy", "f1"})
    # GLUE layouts: SST-2 (one sentence), STS-B (a regression), MNLI (two dev sets)
    sst2, stsb, mnli = root / "SST-2", root / "STS-B", root / "MNLI"
    for folder in (sst2, stsb, mnli):
        folder.mkdir()
    for name, rows in (("train.tsv", train), ("dev.tsv", dev)):
        write_glue_tsv(sst2 / name, ["sentence", "label"], [(a, label) for a, _, label in rows])
        write_glue_tsv(stsb / name, STSB_HEADER, [(i, "main-news", "x", "2012", i, "none", "none", a, b,
                                                   f"{i % 6 * 0.8 + label * 0.5:.3f}")
                                                  for i, (a, b, label) in enumerate(rows)])
    for name, rows in (("train.tsv", train), ("dev_matched.tsv", dev), ("dev_mismatched.tsv", dev[:12])):
        write_glue_tsv(mnli / name, MNLI_HEADER, [(i, 0, 0, "fiction", "()", "()", "()", "()", a, b, NLI[i % 3],
                                                   NLI[i % 3]) for i, (a, b, _) in enumerate(rows)])
    out["glue sst2"] = (["--task", "sst2", "--data-dir", sst2], 20,
                        {"task": "sst2", "problem": "classification", "labels": ["negative", "positive"]},
                        {"accuracy"})
    out["glue stsb"] = (["--task", "stsb", "--data-dir", stsb], 20, {"task": "stsb", "problem": "regression",
                                                                      "num_labels": 1}, {"pearson", "spearmanr"})
    out["glue mnli"] = (["--task", "mnli", "--data-dir", mnli], 20,
                        {"task": "mnli", "labels": list(NLI), "num_labels": 3}, {"accuracy", "accuracy_mm"})
    return out


RUNS = [("csv 3 classes", "cpu"), ("csv 3 classes", "xla"), ("jsonl regression", "cpu"), ("jsonl regression", "xla"),
        ("tsv single sentence", "cpu"), ("glue sst2", "cpu"), ("glue stsb", "cpu"), ("glue mnli", "xla")]


@pytest.fixture(scope="session")
def short_runs(sources, tiny_model, tmp_path_factory):
    """4 steps of the tiny BERT per (source, backend), with --buckets auto, run once and shared:
    (process, metrics, output folder)."""
    cache = {}

    def get(source, backend):
        if (source, backend) not in cache:
            tmp = tmp_path_factory.mktemp("run")
            proc, m = run_cli(["--backend", backend, "--model", tiny_model, *sources[source][0], "--max-steps", 4,
                               "--output-dir", tmp / "out"], tmp)
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[source, backend] = proc, m, tmp / "out"
        return cache[source, backend]

    return get


@pytest.mark.parametrize("source, backend", RUNS)
def test_short_run(source, backend, sources, short_runs):
    _, n_dev, expected, metric_keys = sources[source]
    proc, m, out = short_runs(source, backend)
    assert expected.items() <= m.items()
    assert set(m["eval"]) == metric_keys | {"n"} | ({"n_mm"} if "accuracy_mm" in metric_keys else set())
    assert m["eval"]["n"] == n_dev  # every dev row scored once (20 rows: the last batch of 8 is filled)
    if "n_mm" in m["eval"]:
        assert m["eval"]["n_mm"] == 12
    if backend == "xla":
        assert m["xla"]["aten_fallbacks"] == 0 and m["xla"]["compiles_after_first_epoch"] == 0
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == m["num_labels"]
    if m["labels"]:
        assert [model.config.id2label[i] for i in range(m["num_labels"])] == m["labels"]
    else:
        assert model.config.problem_type == "regression"
    line = next(ln for ln in proc.stderr.splitlines() + proc.stdout.splitlines() if ln.startswith("dev "))
    assert line.startswith(f"dev {next(iter(m['eval']))} ")


def test_pipeline_prints_the_label_names(short_runs):
    """A model trained on string labels: transformers' own pipeline names the classes."""
    from transformers import pipeline

    _, _, out = short_runs("csv 3 classes", "cpu")
    (prediction,) = pipeline("text-classification", model=str(out))("The cat sat on the mat.")
    assert prediction["label"] in ("contradiction", "entailment", "neutral")


def test_buckets_auto_follows_each_tasks_lengths(short_runs):
    """A single-sentence task gets shorter buckets than a sentence-pair one on the same rows."""
    single, pair = (short_runs(source, "cpu")[1] for source in ("tsv single sentence", "csv 3 classes"))
    assert single["buckets_auto"] and pair["buckets_auto"]
    assert max(single["buckets"]) < max(pair["buckets"])


def test_glue_metrics_match_their_definitions():
    cola = load_metric("cola").compute(predictions=[1, 1, 0, 0], references=[1, 0, 0, 0])
    assert cola == {"matthews_correlation": pytest.approx(0.5773503)}
    stsb = load_metric("stsb").compute(predictions=[0.1, 0.5, 0.9], references=[1.0, 2.0, 4.0])
    assert stsb["pearson"] == pytest.approx(1.2 / (0.32 * 42 / 9) ** 0.5) and stsb["spearmanr"] == pytest.approx(1.0)
    own = load_metric("classification").compute(predictions=[0, 1, 2, 2], references=[0, 1, 1, 2])
    assert own == {"accuracy": 0.75, "f1": pytest.approx((1 + 2 / 3 + 2 / 3) / 3)}
    reg = load_metric("regression").compute(predictions=[1.0, 2.0, 4.0], references=[1.0, 2.0, 3.0])
    assert reg["mse"] == pytest.approx(1 / 3)
    assert set(load_metric("mrpc").compute(predictions=[1, 0], references=[1, 1])) == {"accuracy", "f1"}


def test_own_csv_quoting_and_text_column_rule(tmp_path):
    rows = [("a, \"quoted\" text", "x", "b"), ("plain", "y", "a"), ("third", "z", "b")]
    train = write_csv(tmp_path / "t.csv", ["review", "other", "label"], rows)
    task, splits = load_task(Source(train_file=train, validation_file=train))
    assert splits["train"]["text1"][0] == 'a, "quoted" text'
    assert task.text_columns == ["review", "other"] and task.labels == ["a", "b"]
    _, splits = load_task(Source(train_file=train, validation_file=train, text_columns="review"))
    assert "text2" not in splits["train"].column_names


def bad(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


BAD = {  # name: (the Source's fields given a scratch folder, expected message)
    "missing named column": (lambda t: dict(train_file=bad(t, "a.csv", "text,label\nx,1\ny,0\n"),
                                            validation_file=bad(t, "b.csv", "text,label\nx,1\n"),
                                            text_columns="review"),
                             "no column 'review' (columns: text, label)"),
    "missing label column": (lambda t: dict(train_file=bad(t, "a.csv", "text,y\nx,1\ny,0\n"),
                                            validation_file=bad(t, "b.csv", "text,y\nx,1\n")),
                             "no label column 'label' (columns: text, y)"),
    "unknown extension": (lambda t: dict(train_file=bad(t, "a.xlsx", "x"), validation_file=bad(t, "b.csv", "x\n")),
                          "unknown file type '.xlsx'"),
    "empty file": (lambda t: dict(train_file=bad(t, "a.csv", ""), validation_file=bad(t, "b.csv", "text,label\n")),
                   "a.csv"),
    "empty label": (lambda t: dict(train_file=bad(t, "a.csv", "text,label\nx,pos\ny,\nz,neg\n"),
                                   validation_file=bad(t, "b.csv", "text,label\nx,pos\n")),
                    "a.csv: line 3 has an empty label"),
    "validation label never trained": (lambda t: dict(train_file=bad(t, "a.csv", "text,label\nx,pos\ny,neg\n"),
                                                      validation_file=bad(t, "b.csv", "text,label\nx,meh\n")),
                                       "label 'meh' never occurs in"),
    "one class": (lambda t: dict(train_file=bad(t, "a.csv", "text,label\nx,pos\ny,pos\n"),
                                 validation_file=bad(t, "b.csv", "text,label\nx,pos\n")),
                  "every row has label 'pos'"),
    "regression on words": (lambda t: dict(train_file=bad(t, "a.jsonl", '{"text": "x", "label": 1.5}\n'
                                                                        '{"text": "y", "label": "high"}\n'),
                                           validation_file=bad(t, "b.jsonl", '{"text": "x", "label": 1.5}\n'),
                                           problem="regression"),
                            "a.jsonl: row 2: a regression needs a number, found 'high'"),
    "unknown task": (lambda t: dict(task="squad", data_dir=t), "--task must be one of cola, sst2, mrpc"),
    "glue folder missing a file": (lambda t: dict(task="sst2", data_dir=t), "missing data file"),
    "glue task without data": (lambda t: dict(task="rte"), "the bundled data is MRPC only"),
    "glue file with a foreign label": (lambda t: dict(task="rte", data_dir=_rte(t)),
                                       "label must be entailment or not_entailment, found 'maybe'"),
    "csv row with more fields": (lambda t: dict(train_file=bad(t, "a.csv", "text,label\nx,1\ny,0,3,4\nz,0\n"),
                                                validation_file=bad(t, "b.csv", "text,label\nx,1\n")),
                                 "a.csv: cannot read it as CSV: Error tokenizing data. C error: Expected 2 fields in "
                                 "line 3, saw 4"),
    "csv of blank lines": (lambda t: dict(train_file=bad(t, "a.csv", "\n\n\n"),
                                          validation_file=bad(t, "b.csv", "text,label\nx,1\n")),
                           "a.csv: cannot read it as CSV: No columns to parse from file"),
    "jsonl that is not JSON": (lambda t: dict(train_file=bad(t, "a.jsonl",
                                                             '{"text": "x", "label": 1}\n{"text": oops}\n'),
                                              validation_file=bad(t, "b.jsonl", '{"text": "x", "label": 1}\n')),
                               "a.jsonl: cannot read it as JSONL: "),
    "json that is a number": (lambda t: dict(train_file=bad(t, "a.json", "42"),
                                             validation_file=bad(t, "b.json", '[{"text": "x", "label": 1}]')),
                              "a.json: cannot read it as JSON: "),
    "unknown problem": (lambda t: dict(train_file=t / "a.csv", validation_file=t / "b.csv", problem="ranking"),
                        "--problem must be one of classification, regression, causal-lm, dpo, grpo, not 'ranking'"),
}


def _rte(folder):
    for name in ("train.tsv", "dev.tsv"):
        (folder / name).write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    return folder


@pytest.mark.parametrize("case", BAD)
def test_bad_data_is_one_clear_error(case, tmp_path):
    make, message = BAD[case]
    with pytest.raises(UserError) as e:
        load_task(Source(**make(tmp_path)))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_own_file_fails_before_the_model_loads(tmp_path, capsys):
    """From the command line: one line, exit 2, and the model (a hub name no hub has) is never reached."""
    train = bad(tmp_path, "a.csv", "text,label\nx,pos\ny,pos\n")
    code = main(["train", "--backend", "cpu", "--model", "no-such-org/no-such-model", "--train-file", str(train),
                 "--validation-file", str(train)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "every row has label 'pos'" in err


def test_a_bad_test_file_fails_before_the_model_loads(tiny_model, tmp_path, capsys, monkeypatch):
    """--test-file's rows are read and checked (by the task's prediction part) before the model
    loads: a file without the model's text columns is one line, exit 2, and no model was loaded."""
    from xla_train.tasks.sequence import SequenceModel

    loaded = []
    monkeypatch.setattr(SequenceModel, "load", lambda *args: loaded.append(args))
    rows = bad(tmp_path, "rows.csv", "text,label\na,pos\nb,neg\nc,pos\nd,neg\n" * 4)
    test = bad(tmp_path, "test.csv", "question\nwhy?\n")
    code = main(["train", "--backend", "cpu", "--model", tiny_model, "--train-file", str(rows), "--validation-file",
                 str(rows), "--test-file", str(test), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "test.csv: no column 'text'" in err, err
    assert loaded == []


def test_task_and_problem_names_have_one_check():
    """The rule the command line's validation and `load_task` both use."""
    check_choices()
    check_choices("stsb", None)
    check_choices(None, "regression")
    with pytest.raises(UserError, match=r"^--task must be one of cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli, "
                                        r"not 'squad'$"):
        check_choices(task="squad")
    expected = r"^--problem must be one of classification, regression, causal-lm, dpo, grpo, not 'ranking'$"
    with pytest.raises(UserError, match=expected):
        check_choices(problem="ranking")


def _lines(name, n):
    return (BUNDLED_MRPC / name).read_text(encoding="utf-8").splitlines(keepends=True)[:n]


def test_glue_tsv_ending_in_blank_lines_reads_the_same(tmp_path):
    """An editor's last newline (one or several, Windows' too) ends a GLUE file without an error,
    in training's reader, predict's reader and a file without a header (CoLA's layout)."""
    lines = _lines("dev.tsv", 7)
    (tmp_path / "plain.tsv").write_text("".join(lines), encoding="utf-8")
    (tmp_path / "blank.tsv").write_text("".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "blanks.tsv").write_bytes(("".join(lines) + "\n\r\n").encode())
    expected = read_glue_tsv(tmp_path / "plain.tsv")
    assert len(expected["label"]) == 6
    for name in ("blank.tsv", "blanks.tsv"):
        assert read_glue_tsv(tmp_path / name) == expected
        assert glue_columns(tmp_path / name) == glue_columns(tmp_path / "plain.tsv")
    cola = "".join(f"gj04\t{i % 2}\t\tSentence number {i}.\n" for i in range(4))
    (tmp_path / "cola.tsv").write_text(cola, encoding="utf-8")
    (tmp_path / "cola_blank.tsv").write_text(cola + "\n", encoding="utf-8")
    assert read_glue_tsv(tmp_path / "cola_blank.tsv", "cola") == read_glue_tsv(tmp_path / "cola.tsv", "cola")
    assert read_glue_tsv(tmp_path / "cola.tsv", "cola")["label"] == [0, 1, 0, 1]
    (tmp_path / "only_blank.tsv").write_text("\n\n", encoding="utf-8")
    with pytest.raises(UserError, match="^empty data file: "):
        read_glue_tsv(tmp_path / "only_blank.tsv")


def test_glue_tsv_blank_line_among_the_rows_names_its_line(tmp_path):
    lines = _lines("dev.tsv", 7)
    path = tmp_path / "gap.tsv"
    path.write_text("".join(lines[:3]) + "\n" + "".join(lines[3:]) + "\n", encoding="utf-8")
    for read in (read_glue_tsv, glue_columns):
        with pytest.raises(UserError) as e:
            read(path)
        assert str(e.value) == f"{path}:4: expected 5 tab-separated fields, found 0"
    cola = tmp_path / "cola_gap.tsv"
    cola.write_text("gj04\t1\t\tOne.\n\ngj04\t0\t\tTwo.\n", encoding="utf-8")
    with pytest.raises(UserError) as e:
        read_glue_tsv(cola, "cola")
    assert str(e.value) == f"{cola}:2: expected 4 tab-separated fields, found 0"


def test_glue_from_the_hub_offline_is_one_line(monkeypatch):
    """No hub (offline, as on this machine): one line naming the task, for both hub readers."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for load, name in ((lambda: load_glue_hub("rte"), "rte"), (lambda: load_mrpc("hub"), "mrpc")):
        with pytest.raises(UserError) as e:
            load()
        assert str(e.value).startswith(f"cannot load glue/{name} from the hub: ConnectionError: ")
        assert e.value.exit_code == 2 and "\n" not in str(e.value)
