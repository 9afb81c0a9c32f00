"""`xla-train` (also `python -m xla_train`): train, predict, report, env."""

import argparse
import functools
import os
import sys
import time
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from .. import STARTED
from ..core.errors import ExitError, Stopped, UserError, show_parameters
from ..core.signals import CtrlC

if TYPE_CHECKING:
    from ..options import TrainOptions


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


def build_parser(given_only: bool = False) -> argparse.ArgumentParser:
    """The parser of every command; `given_only`: train's options have no defaults, so that its
    namespace holds the flags given (which override a recipe)."""
    from ..options import PredictOptions, TrainOptions

    p = _Parser(prog="xla-train", description="Fine-tune Hugging Face transformers on TPU/XLA, GPU or CPU.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add = functools.partial(sub.add_parser, formatter_class=_Help)
    train = add("train", help="fine-tune on a GLUE task or own data (default: GLUE MRPC)",
                description="Options come from the flags below, over the YAML recipe of --config (docs/recipes.md).")
    _add_config_help(train)
    _add_options(train, TrainOptions, given_only)
    _add_kind_options(train)
    _add_options(add("predict", help="predict labels for a file with a fine-tuned classifier, or generate "
                                "completions with a fine-tuned causal LM"),
                 PredictOptions)
    r = add("report", help="write RUN_DIR/report/ (Markdown and PNG plots) from a run's --output-dir")
    r.add_argument("run_dir", help="the --output-dir of a training run")
    add("env", help="show the detected backend, devices and versions")
    return p


CONFIG = "--config"


def _add_config_help(parser: argparse.ArgumentParser) -> None:
    """--config in train's help, in a group of its own. It is read before argparse parses (main:
    `_take_configs`), since the flags given must override it, so it is no action of the parser."""
    from ..options import SECTIONS

    group = parser.add_argument_group("recipe")
    group._group_actions.append(argparse.Action(
        [CONFIG], dest="config", metavar="RECIPE.yaml",
        help=f"read options from a YAML recipe: sections {', '.join(SECTIONS)} (the groups below), each holding "
             "option: value lines (names with _ or -); a flag given here overrides the recipe; several: later "
             "ones override earlier ones. OUTPUT_DIR/recipe.yaml reruns a run"))


def _add_options(parser, options, given_only=False):
    """One argument per field of the `options` dataclass, with its default, help and type;
    training's in a group per section. `given_only`: no defaults (argparse.SUPPRESS)."""
    from ..options import SECTIONS, option_fields

    groups = {}
    for flag, f in option_fields(options):
        meta = f.metadata
        section = meta.get("section")
        if section and section not in groups:
            groups[section] = parser.add_argument_group(section, SECTIONS[section])
        where = groups[section] if section else parser
        default = argparse.SUPPRESS if given_only else f.default
        if f.type in (bool, "bool"):  # --name and --no-name: a recipe's `true` can be turned off here
            where.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=meta["help"])
            continue
        where.add_argument(flag, type=_type(f), default=default, required=meta["required"], help=meta["help"])


def _type(f):
    return {"int": int, "float": float}.get(f.type if isinstance(f.type, str) else f.type.__name__)


def _add_kind_options(parser):
    """The kinds' own options (a recipe's section named after the kind): one flag per name, which
    the chosen kind reads (TRL's `beta` is DPO's and GRPO's); none has a default here, so that the
    namespace holds those given (TrainOptions.own)."""
    from ..options import flag_name, kind_option_fields

    group = parser.add_argument_group("the kinds' own options", "each applies to the --problem it names (a recipe's "
                                      "section named after the kind)")
    for name, owners in kind_option_fields().items():
        f = owners[0][1]
        text = "; ".join(dict.fromkeys(kf.metadata["help"] for _, kf in owners))
        defaults = ", ".join(f"{kind} {kf.default}" for kind, kf in owners if kf.default not in (None, False))
        text += f" (default: {defaults})" if defaults and "default" not in text else ""
        if f.type in (bool, "bool"):
            group.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=text)
        elif f.metadata.get("repeat"):
            group.add_argument(flag_name(name), action="append", default=argparse.SUPPRESS, help=text)
        else:
            group.add_argument(flag_name(name), type=_type(f), default=argparse.SUPPRESS, help=text)


def _take_configs(argv: list[str]) -> tuple[list[str], list[str]]:
    """`xla-train train`'s arguments without its --config options, and their recipes' paths."""
    if not argv or argv[0] != "train":
        return argv, []
    rest, configs = argv[:1], []
    items = iter(argv[1:])
    for arg in items:
        if arg == CONFIG or arg.startswith(CONFIG + "="):
            path = arg.partition("=")[2] if "=" in arg else next(items, None)
            if not path or path.startswith("--"):
                raise UserError(f"argument {CONFIG}: expected one argument (a YAML recipe)")
            configs.append(path)
        else:
            rest.append(arg)
    return rest, configs


def _read_recipes(configs: list[str]) -> dict[str, Any]:
    """The options the recipes set, later ones over earlier ones ({name: value})."""
    from ..options import read_recipe

    values: dict[str, Any] = {}
    for path in configs:
        values.update(read_recipe(path))
    return values


def _over_recipe(recipe: dict[str, Any], argv: list[str]) -> argparse.Namespace:
    """train's arguments: the recipe's options, and over them the flags given in `argv`."""
    given = vars(build_parser(given_only=True).parse_args(argv))
    return argparse.Namespace(**{**recipe, **given})


def train_options(args: argparse.Namespace) -> "TrainOptions":
    """train's options from its parsed arguments (options missing from `args` keep their defaults;
    the kinds' own, given as flags, over a recipe's, into `own`)."""
    from ..options import TrainOptions, kind_option_fields

    values = {k: v for k, v in vars(args).items() if k != "command"}
    own = dict(values.pop("own", None) or {})
    for name in kind_option_fields():
        if name in values:
            value = values.pop(name)
            own[name] = ",".join(value) if isinstance(value, list) else value  # a repeated flag's values
    return TrainOptions(**values, own=own)


def cmd_train(args, started=None):
    """`started`: when the command began (time.time()), where start-up is counted from; default:
    the package's import, the process's start near enough."""
    options = train_options(args)
    options.validate()  # a mistake the options show is one line before torch is imported
    _only_the_runtimes_used(options.backend)
    from .train import run

    run(options, started)


def cmd_predict(args):
    from ..options import PredictOptions

    options = PredictOptions(**{k: v for k, v in vars(args).items() if k != "command"})
    options.validate()
    _only_the_runtimes_used(options.backend)
    from .predict import run

    run(options)


def cmd_report(args):
    from ..observe.report import write_report

    print(write_report(args.run_dir))


def cmd_env(args):
    import torch
    import transformers

    from ..core.select import auto_choice, torch_accelerator, tpu_runtimes, xla_problem

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


def _only_the_runtimes_used(backend):
    """Before anything imports torch or transformers, keep the TPU runtimes this run (on `backend`)
    will not use from loading. transformers imports torch_xla at its own import whenever it is
    installed (slow, and it prints `Defaulting to PJRT_DEVICE=CPU`) unless USE_TORCH_XLA, read once
    then, says no; torch loads TorchTPU, a device extension, at its own import unless
    TORCH_DEVICE_BACKEND_AUTOLOAD says no (torch/__init__.py, _import_device_backends). `auto`
    needs torch to choose (and TorchTPU's device to see a TPU): only the first applies there."""
    if backend != "auto" and backend != "tpu" and "torch" not in sys.modules:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    if backend == "auto":
        from ..core.select import auto_choice

        backend, _ = auto_choice()
    if backend in ("cpu", "cuda", "tpu"):
        os.environ.setdefault("USE_TORCH_XLA", "0")


def as_flags(message: str) -> str:
    """The core's messages name its parameters in backticks (`num_processes`), as a user of the
    Engine passed them; on the command line each one is its flag (--num-processes)."""
    import re

    from ..options import PredictOptions, TrainOptions, flag_name, kind_option_fields

    names = {f.name for cls in (TrainOptions, PredictOptions) for f in fields(cls)} | set(kind_option_fields())
    return re.sub(r"`([a-z_][a-z0-9_]*)`", lambda m: flag_name(m[1]) if m[1] in names else m[0], message)


def main(argv=None):
    started = STARTED if argv is None else time.time()  # a command called again in one process starts anew
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    pjrt_device = os.environ.get("PJRT_DEVICE")  # as given: importing torch_xla sets a default
    show_parameters(as_flags)  # the core's `num_processes` is --num-processes here, in every error line
    # Ctrl-C at any moment: one line and exit 130 (in the training loop, a StopRequest's stop). CtrlC
    # notes it even where a library loading then swallows the exception or makes it another one.
    with CtrlC() as ctrl_c:
        failure = None
        try:
            argv, configs = _take_configs(argv)
            helping = {"-h", "--help"} & set(argv)
            recipe = _read_recipes(configs) if configs and not helping else {}  # --help reads no recipe (nor yaml)
            args = build_parser().parse_args(argv)  # every flag checked, with the defaults
            if configs:
                args = _over_recipe(recipe, argv)
            if args.command == "env":
                args.pjrt_device = pjrt_device
            if args.command == "train":
                cmd_train(args, started)
            else:
                {"predict": cmd_predict, "report": cmd_report, "env": cmd_env}[args.command](args)
        except ExitError as e:
            failure = e
        except KeyboardInterrupt:
            CtrlC.received = True  # raised by something else than the handler (a thread's interrupt_main())
        except BaseException:
            if not CtrlC.received:
                raise
        ctrl_c.ending()
        if CtrlC.received:
            print("xla-train: interrupted", file=sys.stderr)
            return 130
        if failure:
            # under torchrun every rank runs this; a stop (the same on every rank) is told once
            if str(failure) and not (isinstance(failure, Stopped) and os.environ.get("RANK", "0") != "0"):
                print(failure.line(), file=sys.stderr)
            return failure.exit_code
    return 0
