"""`xla-train` (also `python -m xla_train`): train, predict, report, env."""

import argparse
import functools
import os
import sys
from dataclasses import fields

from .errors import ExitError, Stopped, UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, instead of usage text
        raise UserError(message)


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default (unless it says it already, or it is a flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".strip()


def build_parser():
    from .tasks import PROBLEMS, TASKS
    from .train import PADDING_MODES, PRECISIONS, TrainConfig

    p = _Parser(prog="xla-train", description="Fine-tune Hugging Face transformers on TPU/XLA, GPU or CPU.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=_Help)
    t = sub.add_parser("train", help="fine-tune on a GLUE task or own data (default: GLUE MRPC)")
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    t.add_argument("--model", default=None, help="model folder or hub name (default: the bundled MiniLM-L6-H384)")
    t.add_argument("--task", default=None, help=f"GLUE task: {', '.join(TASKS)} (default: mrpc; with own "
                   "files: custom)")
    t.add_argument("--data-dir", default=None, help="the task's folder in GLUE's layout (train.tsv, dev.tsv; MNLI: "
                   "dev_matched.tsv, dev_mismatched.tsv); 'hub' for load_dataset('glue', TASK); default: the MRPC "
                   "copy bundled with the package")
    t.add_argument("--train-file", default=None, help="own training data: .csv, .tsv, .json or .jsonl")
    t.add_argument("--validation-file", default=None, help="own validation data, same columns")
    t.add_argument("--text-columns", default=None, help="own data: A or A,B (default: sentence1,sentence2 if "
                   "present, else the first two text columns, else the first)")
    t.add_argument("--label-column", default=defaults["label_column"], help="own data: the label's column "
                   "(default: label)")
    t.add_argument("--problem", default=None, help=f"own data: {' | '.join(PROBLEMS)} (default: float labels "
                   "make a regression, others a classification)")
    t.add_argument("--test-file", default=None, help="rows to predict with the final (or best) model, written to "
                   "OUTPUT_DIR/predictions.EXT (a GLUE test.tsv: GLUE's submission format)")
    t.add_argument("--backend", default=defaults["backend"], help="auto | xla | cuda | cpu (auto: TPU, then CUDA, then CPU)")
    t.add_argument("--num-processes", type=int, default=None, help="workers on this host (default: one per TPU "
                   "core or GPU; 1 on the CPU and on XLA:CPU)")
    t.add_argument("--strategy", default=defaults["strategy"], help="ddp (a replica per device) or spmd (XLA: one process "
                   "shards each batch over all devices)")
    t.add_argument("--epochs", type=int, default=defaults["epochs"], help="passes over the training data")
    t.add_argument("--batch-size", type=int, default=defaults["batch_size"], help="per replica")
    t.add_argument("--lr", type=float, default=defaults["lr"], help="AdamW's peak learning rate (linear decay to 0)")
    t.add_argument("--weight-decay", type=float, default=defaults["weight_decay"], help="AdamW's weight decay")
    t.add_argument("--warmup-ratio", type=float, default=defaults["warmup_ratio"], help="fraction of the steps "
                   "with a rising learning rate, in [0, 1)")
    t.add_argument("--seed", type=int, default=defaults["seed"], help="the new head's weights, dropout and the "
                   "data order")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps (default: "
                   "all epochs)")
    t.add_argument("--padding", default=defaults["padding"], help=" | ".join(PADDING_MODES) + " (dynamic: a new "
                   "graph per batch length on XLA)")
    t.add_argument("--buckets", default=defaults["buckets"], help="auto, or lengths like 32,64,96,128")
    t.add_argument("--max-length", type=int, default=defaults["max_length"], help="truncate rows to this length")
    t.add_argument("--compile-seconds", type=float, default=None,
                   help="cost of one compilation for --buckets auto (default: the backend's estimate)")
    t.add_argument("--precision", default=defaults["precision"], help=" | ".join(PRECISIONS))
    t.add_argument("--grad-accum", type=int, default=defaults["grad_accum"], help="micro-batches per optimizer "
                   "step")
    t.add_argument("--max-grad-norm", type=float, default=None, help="clip gradients to this norm (default: no "
                   "clipping)")
    t.add_argument("--log-every", type=int, default=defaults["log_every"], help="steps between reads of the loss "
                   "from the device")
    t.add_argument("--output-dir", default=None, help="local folder or gs://bucket/prefix for checkpoints and the "
                   "fine-tuned model and tokenizer; locally also TensorBoard events (tensorboard/), metrics.json, "
                   "compilations.json and report/")
    t.add_argument("--save-every", type=int, default=None, help="steps between checkpoints (default: every epoch)")
    t.add_argument("--keep-last", type=int, default=defaults["keep_last"], help="complete checkpoints to keep")
    t.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in "
                   "--output-dir (starts from the beginning when there is none)")
    t.add_argument("--overwrite", action="store_true", help="replace the run --output-dir holds: its checkpoints, "
                   "model and logs are removed once this run's checks pass (without it, a folder holding a run stops "
                   "a new one)")
    t.add_argument("--resume-from", default=None, help="continue from this checkpoint (OUTPUT_DIR/checkpoints/step-N)")
    t.add_argument("--compile-cache", default=None, help="persistent XLA compilation cache folder (default: none)")
    t.add_argument("--metrics-out", default=None, help="write the run's metrics JSON here (default: none; "
                   "OUTPUT_DIR/metrics.json is written in any case)")
    t.add_argument("--eval-every", type=int, default=None, help="evaluate every N optimizer steps (default: at the "
                   "end of each epoch)")
    t.add_argument("--metric-for-best", default=None, help="the evaluation metric that ranks models (default: the "
                   "task's main metric; mse is minimised, the others maximised)")
    t.add_argument("--save-best", action="store_true", help="keep the best evaluation's weights: the final model "
                   "(and --test-file's predictions) are the best one's")
    t.add_argument("--early-stopping-patience", type=int, default=None, help="stop after this many evaluations "
                   "without improvement")
    pr = sub.add_parser("predict", help="predict labels for a file with a fine-tuned classifier")
    pr.add_argument("--model", required=True, help="a folder written by xla-train train (or any fine-tuned "
                    "sequence-classification folder)")
    pr.add_argument("--input", required=True, help=".csv, .tsv, .json, .jsonl, or a GLUE .tsv file (test.tsv)")
    pr.add_argument("--output", required=True, help="file to write: GLUE's index<TAB>prediction for a GLUE file, "
                    "else the input's columns plus prediction and score, in the format of its extension")
    pr.add_argument("--backend", default="auto", help="auto | xla | cuda | cpu")
    pr.add_argument("--strategy", default="ddp", help="ddp or spmd (XLA)")
    pr.add_argument("--num-processes", type=int, default=None, help="workers on this host (default: one per TPU "
                    "core or GPU; 1 on the CPU)")
    pr.add_argument("--batch-size", type=int, default=8, help="rows per replica and batch (default: 8)")
    pr.add_argument("--text-columns", default=None, help="A or A,B (default: the columns the model was trained on)")
    pr.add_argument("--task", default=None, help="the GLUE task whose file layout --input has (default: the "
                    "model's own task)")
    pr.add_argument("--max-length", type=int, default=None, help="truncate rows (default: training's, else 128)")
    pr.add_argument("--buckets", default="auto", help="auto, or lengths like 32,64,96,128")
    r = sub.add_parser("report", help="write RUN_DIR/report/ (Markdown and PNG plots) from a run's --output-dir")
    r.add_argument("run_dir", help="the --output-dir of a training run")
    sub.add_parser("env", help="show the detected backend, devices and versions")
    return p


def cmd_train(args):
    from .train import TrainConfig, bundled_model_path, run

    opts = {k: v for k, v in vars(args).items() if k != "command"}
    opts["model"] = opts["model"] or bundled_model_path()
    run(TrainConfig(**opts))


def cmd_predict(args):
    from .predict import PredictConfig, run

    run(PredictConfig(**{k: v for k, v in vars(args).items() if k != "command"}))


def cmd_report(args):
    from .report import write_report

    print(write_report(args.run_dir))


def cmd_env(args):
    import torch
    import transformers

    from .selection import auto_choice, xla_available

    choice, reason = auto_choice()
    print(f"torch         {torch.__version__}")
    if xla_available():
        import torch_xla

        print(f"torch_xla     {torch_xla.__version__}")
    else:
        print("torch_xla     not installed")
    print(f"transformers  {transformers.__version__}")
    print(f"CUDA devices  {torch.cuda.device_count()}")
    print(f"PJRT_DEVICE   {args.pjrt_device or '(unset: torch_xla picks TPU if present, else CPU)'}")
    print(f"--backend auto -> {choice}: {reason}")


def _no_xla_unless_used(argv):
    """transformers imports torch_xla at its own import whenever it is installed (slow, and it
    prints `Defaulting to PJRT_DEVICE=CPU`) unless USE_TORCH_XLA, read once then, says no: say no
    before anything imports transformers when this run will not use XLA."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("command", nargs="?")
    pre.add_argument("--backend", default="auto")
    known, _ = pre.parse_known_args(argv)
    if known.command not in ("train", "predict"):
        return
    name = known.backend
    if name == "auto":
        from .selection import auto_choice

        name, _ = auto_choice()
    if name in ("cpu", "cuda"):
        os.environ.setdefault("USE_TORCH_XLA", "0")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    pjrt_device = os.environ.get("PJRT_DEVICE")  # as given: importing torch_xla sets a default
    try:
        _no_xla_unless_used(argv)
        args = build_parser().parse_args(argv)
        if args.command == "env":
            args.pjrt_device = pjrt_device
        {"train": cmd_train, "predict": cmd_predict, "report": cmd_report, "env": cmd_env}[args.command](args)
    except ExitError as e:
        # under torchrun every rank runs this; a stop (the same on every rank) is told once
        if str(e) and not (isinstance(e, Stopped) and os.environ.get("RANK", "0") != "0"):
            print(e.line(), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("xla-train: interrupted", file=sys.stderr)
        return 130
    return 0
