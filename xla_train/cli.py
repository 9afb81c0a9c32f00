"""`xla-train` (also `python -m xla_train`): train, predict, report, env."""

import argparse
import functools
import os
import sys

from .core.errors import ExitError, Stopped, UserError


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
    from .options import PredictOptions, TrainOptions

    p = _Parser(prog="xla-train", description="Fine-tune Hugging Face transformers on TPU/XLA, GPU or CPU.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=_Help)
    _add_options(sub.add_parser("train", help="fine-tune on a GLUE task or own data (default: GLUE MRPC)"),
                 TrainOptions)
    _add_options(sub.add_parser("predict", help="predict labels for a file with a fine-tuned classifier, or generate "
                                           "completions with a fine-tuned causal LM"),
                 PredictOptions)
    r = sub.add_parser("report", help="write RUN_DIR/report/ (Markdown and PNG plots) from a run's --output-dir")
    r.add_argument("run_dir", help="the --output-dir of a training run")
    sub.add_parser("env", help="show the detected backend, devices and versions")
    return p


def _add_options(parser, options):
    """One argument per field of the `options` dataclass, with its default, help and type."""
    from .options import option_fields

    for flag, f in option_fields(options):
        meta = f.metadata
        if f.type in (bool, "bool"):  # a default of None: --name and --no-name, else not given
            action = "store_true" if f.default is not None else argparse.BooleanOptionalAction
            parser.add_argument(flag, action=action, default=f.default, help=meta["help"])
            continue
        kind = {"int": int, "float": float}.get(f.type if isinstance(f.type, str) else f.type.__name__)
        parser.add_argument(flag, type=kind, default=f.default, required=meta["required"], help=meta["help"])


def cmd_train(args):
    from .options import TrainOptions
    from .train import run

    run(TrainOptions(**{k: v for k, v in vars(args).items() if k != "command"}))


def cmd_predict(args):
    from .options import PredictOptions
    from .predict import run

    run(PredictOptions(**{k: v for k, v in vars(args).items() if k != "command"}))


def cmd_report(args):
    from .report import write_report

    print(write_report(args.run_dir))


def cmd_env(args):
    import torch
    import transformers

    from .core.select import auto_choice, torch_accelerator, tpu_runtimes, xla_problem

    runtimes, accelerator, mismatch = tpu_runtimes(), torch_accelerator(), xla_problem()
    try:
        choice, reason = auto_choice()
    except UserError:  # a Google host whose TPU check needs torch_xla, which cannot import: the warning says why
        choice, reason = "none", "the TPU check needs torch_xla, which cannot import beside this torch"
    print(f"torch         {torch.__version__}")
    for name, version in runtimes.items():  # the TPU runtimes, from their metadata: no runtime starts
        print(f"{name:<14}{version or 'not installed'}")
    print(f"transformers  {transformers.__version__}")
    if accelerator:
        print(f"accelerator   {accelerator} ({torch.accelerator.device_count()} device(s))")
    else:
        print("accelerator   none (torch sees the CPU only)")
    if mismatch:
        print(f"warning       {mismatch}")
    if runtimes["torch_xla"]:
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
    if known.command not in ("train", "predict") or {"-h", "--help"} & set(argv):
        return  # --help starts no library (a test checks)
    name = known.backend
    if name == "auto":
        from .core.select import auto_choice

        name, _ = auto_choice()
    if name in ("cpu", "cuda", "tpu"):
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
