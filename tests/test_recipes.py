"""Options in sections, recipes in YAML: `xla-train train --config recipe.yaml [--flag value ...]`.

Every option belongs to one section; a recipe's top-level keys are the sections, its inner keys
the options; flags given on the command line override it; a mistake in a recipe is one line and
exit code 2; the run folder records the resolved recipe (recipe.yaml), which runs the job again;
the recipes shipped in recipes/ validate and say what the docs' command lines say."""

import copy
import json
import os
import pickle
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, run_cli
from test_fallback import PINNED_LOSSES

from xla_train.commands import cli
from xla_train.commands.cli import main
from xla_train.options import (
    RUN_CONTROL,
    SECTIONS,
    TrainOptions,
    from_sections,
    option_fields,
    read_recipe,
    recipe_text,
    recipe_values,
    section_names,
    sections,
)

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


@pytest.fixture
def trained(monkeypatch):
    """`main` with the training itself replaced by a list that receives the TrainOptions it would
    run (the command line's own steps before it run: the options checked, USE_TORCH_XLA set)."""
    from xla_train.commands import train

    seen = []
    monkeypatch.setattr(train, "run", lambda options, started=None: seen.append(options))
    return seen


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


# --- sections ------------------------------------------------------------------------------------
def test_every_option_is_in_exactly_one_section():
    names = section_names()
    assert list(names) == list(SECTIONS) and all(names.values())
    placed = [n for keys in names.values() for n in keys]
    assert sorted(placed) == sorted(f.name for _, f in option_fields(TrainOptions)) and len(placed) == len(set(placed))
    assert "lr" in names["optimizer"] and "lora_r" in names["model"] and "output_dir" in names["checkpoints"]
    assert "backend" in names["system"] and "buckets" in names["shapes"] and "train_file" in names["data"]


def test_a_kinds_own_options_are_its_section(tmp_path, capsys, trained):
    """DPO's beta lives in the `dpo:` section (TRL's DPOConfig), flat or as a flag too; another
    kind's options are refused by one rule, and a recorded recipe writes the chosen kind's section."""
    cfg = TrainOptions(**recipe_values({"problem": "dpo", "dpo": {"beta": 0.3}, "rpo_alpha": 1}))
    assert cfg.kind_options().beta == 0.3 and cfg.kind_options().rpo_alpha == 1.0
    assert cfg.kind_options().dpo_loss == "sigmoid" and cfg.own == {"beta": 0.3, "rpo_alpha": 1.0}
    text = recipe_text(cfg)
    assert "\n# dpo's own options\ndpo:\n  beta: 0.3\n  dpo_loss: sigmoid\n  rpo_alpha: 1.0\n" in text
    assert TrainOptions(**recipe_values(__import__("yaml").safe_load(text))) == cfg
    assert "dpo" not in sections(TrainOptions())  # a kind without options of its own writes no section
    recipe = write(tmp_path / "r.yaml", "problem: dpo\ntrain_file: p.jsonl\ndpo:\n  beta: 0.3\n")
    assert main(["train", "--config", recipe, "--beta", "0.7"]) == 0  # the flag over the recipe
    assert trained[-1].kind_options().beta == 0.7
    for argv, message in [
        (["--beta", "0.5"], "--beta applies to --problem dpo or grpo"),
        (["--problem", "causal-lm", "--rpo-alpha", "1"], "--rpo-alpha applies to --problem dpo"),
        (["--config", write(tmp_path / "d.yaml", "dpo:\n  beta: 0.2\n")],
         "the recipe's dpo section applies to --problem dpo"),
        (["--config", write(tmp_path / "o.yaml", "optimizer:\n  beta: 0.2\n")],
         "no option 'optimizer.beta'; beta is in the dpo or grpo section"),
        (["--config", write(tmp_path / "t.yaml", "dpo:\n  betta: 0.2\n")], "did you mean 'beta'?"),
        (["--config", write(tmp_path / "w.yaml", "beta: 0.2\ndpo:\n  beta: 0.3\n")], "beta is given twice"),
        (["--problem", "dpo", "--beta", "0"], "--beta must be a positive number, not 0.0"),
    ]:
        assert main(["train", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)


def test_sections_and_back():
    cfg = TrainOptions(lr=1e-3, lora=True, lora_r=4, output_dir="out", backend="cpu", buckets="32,64")
    by_section = sections(cfg)
    assert by_section["optimizer"]["lr"] == 1e-3 and by_section["model"]["lora_r"] == 4
    assert by_section["system"]["backend"] == "cpu" and by_section["checkpoints"]["output_dir"] == "out"
    assert from_sections(by_section) == cfg
    view = cfg.section("optimizer")
    assert dict(view) == by_section["optimizer"] and view["lr"] == view.lr == 1e-3
    assert pickle.loads(pickle.dumps(view)) == view and copy.deepcopy(view).lr == 1e-3
    with pytest.raises(TypeError):
        view["lr"] = 1.0  # read-only
    with pytest.raises(KeyError, match="no section 'optimiser'"):
        cfg.section("optimiser")


def test_the_help_groups_options_by_section(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--config RECIPE.yaml" in out
    positions = [out.index(f"\n{name}:\n") for name in SECTIONS]
    assert positions == sorted(positions)
    assert out.index("\n  --lr LR") > out.index("\noptimizer:\n") > out.index("\n  --lora-r LORA_R") > \
        out.index("\nmodel:\n")


def test_help_with_a_recipe_reads_no_recipe_nor_yaml():
    """`--help` stays fast: the recipe is not read and PyYAML not imported (tests/test_cli.py
    checks torch and the other libraries)."""
    code = ("import sys\nfrom xla_train.commands.cli import main\n"
            "try:\n    main(['train', '--config', 'no-such-recipe.yaml', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('yaml loaded:', 'yaml' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--config RECIPE.yaml" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "yaml loaded: False"


# --- reading recipes, and flags over them --------------------------------------------------------
def test_a_flag_given_overrides_the_recipe(tmp_path, trained):
    recipe = write(tmp_path / "r.yaml", "data:\n  problem: causal-lm\n"  # --packing is causal-lm's
                   "optimizer:\n  lr: 1e-3\n  batch-size: 4\n  epochs: 2\n"
                   "shapes:\n  packing: true\n  buckets: [32, 64]\nsystem:\n  backend: cpu\n  profile_steps: 12:16\n"
                   f"checkpoints:\n  output_dir: {tmp_path / 'out'}\n")  # --profile-steps writes there
    assert main(["train", "--config", recipe, "--lr", "2e-3", "--batch-size", "8", "--no-packing"]) == 0
    cfg = trained[-1]
    assert cfg.lr == 2e-3  # the flag
    assert cfg.batch_size == 8  # a flag given with the default's value still overrides
    assert cfg.packing is False and cfg.epochs == 2 and cfg.backend == "cpu"  # --no-packing; the recipe's
    assert cfg.buckets == "32,64" and cfg.profile_steps == "12:16"  # a list; A:B stays a string (not 736)
    assert cfg.seed == 42 and cfg.max_length == 128  # in neither: the defaults
    assert main(["train", f"--config={recipe}", "--no-packing"]) == 0
    assert trained[-1].lr == 1e-3 and trained[-1].batch_size == 4


def test_a_flat_recipe_is_read_as_its_sections(tmp_path, trained):
    """TRL's config files are flat: the same options at the top level (dashes or underscores), mixed
    with sections or not, give the same run."""
    sectioned = write(tmp_path / "s.yaml", "optimizer:\n  lr: 2.0e-5\n  batch_size: 16\nmodel:\n  lora: true\n"
                      "system:\n  backend: cpu\n")
    flat = write(tmp_path / "f.yaml", "lr: 2.0e-5\nbatch-size: 16\nlora: true\nsystem:\n  backend: cpu\n")
    assert main(["train", "--config", sectioned]) == 0 and main(["train", "--config", flat]) == 0
    assert trained[-1] == trained[-2] == TrainOptions(lr=2e-5, batch_size=16, lora=True, backend="cpu")
    # `model` names a section and an option: a folder at the top level is the option
    folder = trained[-1].model  # the bundled model's folder
    assert main(["train", "--config", write(tmp_path / "m.yaml", f"model: {folder}\nlora: true\n")]) == 0
    assert trained[-1].model == folder and trained[-1].lora


def test_later_recipes_override_earlier_ones(tmp_path, trained):
    base = write(tmp_path / "base.yaml", "optimizer:\n  lr: 1.0e-3\n  epochs: 2\nmodel:\n  lora: true\n")
    tpu = write(tmp_path / "tpu.yaml", "optimizer:\n  lr: 3.0e-4\nsystem:\n  strategy: fsdp\n")
    assert main(["train", "--config", base, "--config", tpu, "--epochs", "5"]) == 0
    cfg = trained[-1]
    assert (cfg.lr, cfg.epochs, cfg.lora, cfg.strategy) == (3e-4, 5, True, "fsdp")
    # a recipe's `true` is turned off by the flag's --no- form (the shipped TPU recipes hold lora: true)
    assert main(["train", "--config", base, "--no-lora", "--no-save-best"]) == 0
    assert trained[-1].lora is False and trained[-1].save_best is False and trained[-1].lr == 1e-3


def test_a_recipes_backend_keeps_torch_xla_out(tmp_path, trained):
    """As `--backend cpu` does (cli._only_the_runtimes_used): transformers does not import torch_xla."""
    assert "USE_TORCH_XLA" not in os.environ  # conftest's fixture restores it after each test
    assert main(["train", "--config", write(tmp_path / "r.yaml", "system:\n  backend: cpu\n")]) == 0
    assert os.environ.get("USE_TORCH_XLA") == "0" and trained[-1].backend == "cpu"


def test_without_a_recipe_nothing_changes(trained):
    assert main(["train", "--backend", "cpu", "--lr", "1e-4"]) == 0
    assert trained[-1] == TrainOptions(backend="cpu", lr=1e-4)


@pytest.mark.parametrize("text, message", [
    ("data:\n  trian_file: train.jsonl\n",
     "r.yaml: no option 'data.trian_file' (did you mean 'train_file'?); the data section has: task, data_dir, "
     "train_file, validation_file, text_columns, label_column, problem, test_file"),
    ("data:\n  lr: 1.0e-3\n", "r.yaml: no option 'data.lr'; lr is in the optimizer section"),
    ("optimiser:\n  lr: 1.0e-3\n", "r.yaml: no section or option 'optimiser' (did you mean 'optimizer'?); a "
     "recipe's sections are: data, shapes, model, optimizer, evaluation, checkpoints, system"),
    ("learning_rate: 1.0e-3\n", "r.yaml: no section or option 'learning_rate'"),
    ("lr: 1.0e-3\noptimizer:\n  lr: 2.0e-3\n", "r.yaml: optimizer.lr is given twice"),
    ("lr: fast\n", "r.yaml: optimizer.lr must be a number, not 'fast'"),
    ("optimizer:\n  batch_size: eight\n", "r.yaml: optimizer.batch_size must be an integer, not 'eight'"),
    ("optimizer:\n  batch_size: 8.5\n", "r.yaml: optimizer.batch_size must be an integer, not 8.5"),
    ("optimizer:\n  lr: fast\n", "r.yaml: optimizer.lr must be a number, not 'fast'"),
    ("model:\n  lora: 1\n", "r.yaml: model.lora must be true or false, not 1"),
    ("model:\n  lora_r: true\n", "r.yaml: model.lora_r must be an integer, not true"),
    ("optimizer:\n  epochs: null\n", "r.yaml: optimizer.epochs must be an integer, not null (leave it out for its "
     "default, 3)"),
    ("model:\n  model: [a, b]\n", "r.yaml: model.model must be a string, not ['a', 'b']"),
    ("optimizer: 3\n", "r.yaml: section optimizer must hold 'option: value' lines, not 3"),
    ("optimizer:\n  lr: 1\n  grad_accum: 2\n  grad-accum: 3\n", "r.yaml: optimizer.grad_accum is given twice"),
    ("- data\n- shapes\n", "r.yaml: a recipe is a mapping of sections"),
    ("optimizer:\n  lr: 1\n  epochs: 2: 3\n", "r.yaml:3: not a YAML recipe (mapping values are not allowed here)"),
])
def test_a_mistake_in_a_recipe_is_one_line_and_exit_2(text, message, tmp_path, capsys, monkeypatch, trained):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "r.yaml", text)
    assert main(["train", "--config", "r.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("xla-train: error: "), err
    assert message in err
    assert not trained


@pytest.mark.parametrize("args, message", [
    (["--config", "missing.yaml"], "--config missing.yaml: no such file"),
    (["--config"], "argument --config: expected one argument"),
    (["--config", "--lr", "1"], "argument --config: expected one argument"),
    (["--config", "."], "--config . is a folder"),
    (["--config", "ok.yaml", "--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
])
def test_a_missing_recipe_is_one_line(args, message, tmp_path, capsys, monkeypatch, trained):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "ok.yaml", "optimizer:\n  lr: 1.0e-3\n")
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_recipe_on_cloud_storage(gcs_emulator, tmp_path, trained, capsys):
    from google.cloud import storage

    storage.Client().bucket("xla-train-test").blob(f"{tmp_path.name}/recipe.yaml").upload_from_string(
        "optimizer:\n  lr: 1.0e-3\n")
    assert main(["train", "--backend", "cpu", "--config", f"gs://xla-train-test/{tmp_path.name}/recipe.yaml"]) == 0
    assert trained[-1].lr == 1e-3
    missing = f"gs://xla-train-test/{tmp_path.name}/missing.yaml"
    assert main(["train", "--backend", "cpu", "--config", missing]) == 2
    assert capsys.readouterr().err == f"xla-train: error: --config {missing}: no such file\n"


# --- the recipes shipped, and the docs ----------------------------------------------------------
def test_the_shipped_recipes_validate():
    assert {p.name for p in RECIPES} >= {"mrpc.yaml", "tiny-causal-lm.yaml", "qwen2.5-0.5b-lora-tpu.yaml",
                                         "qwen2.5-7b-fsdp-tpu.yaml"}
    for path in RECIPES:
        text = path.read_text(encoding="utf-8")
        assert text.startswith("# "), f"{path.name}: a comment header says what it runs"
        assert f"xla-train train --config recipes/{path.name}" in text, f"{path.name}: its command"
        cfg = TrainOptions(**read_recipe(str(path)))
        cfg.validate()  # files are read when a run starts: none is needed here


def test_the_mrpc_recipe_is_the_defaults_written_out():
    path = ROOT / "recipes" / "mrpc.yaml"
    values = read_recipe(str(path))
    assert sorted(values) == sorted(f.name for _, f in option_fields(TrainOptions))  # every option
    cfg = TrainOptions(**values)
    assert cfg == TrainOptions()
    assert (cfg.lr, cfg.epochs, cfg.batch_size, cfg.task, cfg.data_dir) == (5e-5, 3, 8, None, None)


def doc_commands(page):
    """The `xla-train train ...` command lines of a docs page's code blocks, continuations joined."""
    text = (ROOT / page).read_text(encoding="utf-8").replace("\\\n", " ")
    return [shlex.split(line.strip()) for line in text.splitlines() if line.strip().startswith("xla-train train ")]


def test_the_recipes_are_the_command_lines_of_the_docs():
    """docs/causal-lm.md's train commands and the recipes made of them set the same options."""
    recipes = {read_recipe(str(p)).get("output_dir"): (p.name, read_recipe(str(p))) for p in RECIPES}
    commands = [c for c in doc_commands("docs/causal-lm.md") if "--config" not in c]
    assert len(commands) >= 3
    for command in commands:
        given = vars(cli.build_parser(given_only=True).parse_args(command[1:]))
        given.pop("command")
        name, recipe = recipes[given["output_dir"]]
        assert recipe == given, name


# --- the recipe the run folder records -----------------------------------------------------------
def test_the_recorded_recipe_runs_the_same_job(tmp_path, capsys):
    from xla_train.io.storage import open_store
    from xla_train.run.folder import RECIPE, RunFolder

    cfg = TrainOptions(output_dir=str(tmp_path / "run"), lr=3e-4, warmup_ratio=0.1, lora=True, lora_targets="query",
                       buckets="32,64", backend="cpu", profile_steps="3:5", report_to="none", max_steps=7,
                       resume=True)
    run_id = RunFolder(open_store(cfg.output_dir), cfg).claim()
    path = tmp_path / "run" / RECIPE
    text = path.read_text(encoding="utf-8")
    assert text.startswith(f"# xla-train's recipe of run {run_id}")
    assert f"xla-train train --config {path}" in text
    assert "model: null  # the bundled MiniLM-L6-H384" in text  # not this environment's path
    values = read_recipe(str(path))
    assert sorted(values) == sorted(f.name for _, f in option_fields(TrainOptions))  # every option, defaults included
    assert TrainOptions(**values) == replace(cfg, resume=False)  # the run-control options at their defaults
    assert set(RUN_CONTROL) == {"resume", "overwrite", "resume_from"}
    assert capsys.readouterr().out == ""  # a new run says nothing of it

    # resumed: the recipe says this run's options (a longer --max-steps), in one line
    longer = replace(cfg, max_steps=9)
    RunFolder(open_store(cfg.output_dir), longer).claim(SimpleNamespace(state={"run_id": run_id}))
    assert capsys.readouterr().out == f"resuming run {run_id} with the recipe {path}\n"
    assert TrainOptions(**read_recipe(str(path))).max_steps == 9


def test_a_folder_holding_only_a_recipe_holds_a_run(tmp_path):
    from xla_train.io.storage import open_store
    from xla_train.run.folder import RECIPE, RunFolder

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RECIPE).write_text(recipe_text(TrainOptions()))
    assert RunFolder(open_store(str(tmp_path / "run")), TrainOptions(output_dir=str(tmp_path / "run"))).found == \
        [RECIPE]  # --overwrite removes it with the rest


def test_the_report_shows_the_recipe(tmp_path):
    from xla_train.observe.report import _recipe_lines, load_recipe

    cfg = TrainOptions(lr=1e-3, lora=True, backend="cpu", output_dir=str(tmp_path))
    (tmp_path / "recipe.yaml").write_text(recipe_text(cfg, ["a header"]), encoding="utf-8")
    text = "\n".join(_recipe_lines(load_recipe(tmp_path)))
    assert "## Recipe" in text and "xla-train train --config RUN_DIR/recipe.yaml" in text
    for row in ("| optimizer | lr | 0.001 |", "| model | lora | true |", "| system | backend | cpu |",
                f"| checkpoints | output_dir | {tmp_path} |"):
        assert row in text
    assert "| optimizer | epochs |" not in text  # a default
    assert "```yaml\n# a header\n" in text  # the whole file, folded
    # an older run without recipe.yaml: from its record
    old = tmp_path / "old"
    old.mkdir()
    (old / "xla_train_run.json").write_text(json.dumps({"run_id": "x", "config": {"lr": 1e-3, "gone": 1}}))
    assert "| optimizer | lr | 0.001 |" in "\n".join(_recipe_lines(load_recipe(old)))
    # an edited recipe that no longer reads: said, and the report is still written
    (tmp_path / "recipe.yaml").write_text("optimizer:\n  lr: fast\n", encoding="utf-8")
    assert "It cannot be read: recipe.yaml: optimizer.lr must be a number" in "\n".join(
        _recipe_lines(load_recipe(tmp_path)))


@pytest.mark.torch_native
def test_the_mrpc_recipe_runs_with_flags_over_it(mrpc_slice, tmp_path):
    """The course's recipe, on the CPU for 6 steps of the MRPC slice: its first losses are the
    pinned ones (test_fallback.PINNED_LOSSES: the defaults' data order, padding, head, dropout and
    optimizer); the run folder's recipe.yaml holds the recipe with the flags over it, runs the same
    job again, and the report shows it."""
    out = tmp_path / "run"
    proc, m = run_cli(["--config", ROOT / "recipes" / "mrpc.yaml", "--backend", "cpu", "--max-steps", 6,
                       "--buckets", "64,128", "--log-every", 1, "--data-dir", mrpc_slice, "--output-dir", out],
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (m["backend"], m["steps"], m["task"], m["world_size"], m["xla"]) == ("cpu", 6, "mrpc", 1, None)
    assert m["train_samples"] == 48 and m["eval"]["n"] == 48
    assert [s for s, _, _ in m["train_loss"]] == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close([loss for _, loss, _ in m["train_loss"]], PINNED_LOSSES, atol=1e-4, rtol=0)
    values = read_recipe(str(out / "recipe.yaml"))
    expected = {**read_recipe(str(ROOT / "recipes" / "mrpc.yaml")), "backend": "cpu", "max_steps": 6,
                "buckets": "64,128", "log_every": 1, "data_dir": str(mrpc_slice), "output_dir": str(out),
                "metrics_out": values["metrics_out"]}
    assert values == expected
    record = json.loads((out / "xla_train_run.json").read_text())["config"]
    assert TrainOptions(**values) == TrainOptions(**record)  # the same job as the record's
    report = (out / "report" / "report.md").read_text()
    assert re.search(r"\| optimizer \| max_steps \| 6 \|", report) and "| system | backend | cpu |" in report
