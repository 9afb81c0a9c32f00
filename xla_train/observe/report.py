"""`xla-train report RUN_DIR`: a Markdown summary and PNG plots of a run's output folder.

Rebuilt from what the run wrote: `metrics.json`, `compilations.json` and the TensorBoard events
in `tensorboard/` (read back with tensorboard's EventAccumulator). Writes `RUN_DIR/report/`:
    overview.png     the four panels below in one picture
    loss_lr.png      training loss and learning rate per step
    throughput.png   samples/s per log interval, compilations marked, and where the time went
    padding.png      padding efficiency per bucket (real tokens / padded tokens)
    report.md        the numbers, the run's recipe (the options that differ from the defaults, and
                     recipe.yaml whole), the explainer's warning and every compilation
"""

import json
from pathlib import Path
from typing import Any

from ..core.errors import UserError
from ..io.files import atomic_write
from ..models import shown_name

# TensorBoard tags the monitor writes and this module reads (the reader owns the names).
TAGS = {
    "loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
    "throughput": "train/samples_per_s", "accuracy": "eval/accuracy", "f1": "eval/f1",
    "compiles": "xla/compiles", "compile_seconds": "xla/compile_seconds", "host_syncs": "xla/host_syncs",
}


def tag(key):
    """The TensorBoard tag of a logged value; an evaluation metric not named above is `eval/KEY`."""
    return TAGS.get(key, f"eval/{key}")


def read_scalars(folder):
    """{tag: ([steps], [values])} from the TensorBoard event files in `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        out[tag] = ([e.step for e in events], [e.value for e in events])
    return out


def load_run(run_dir):
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.json").is_file():
        raise UserError(f"{run_dir} holds no run (no metrics.json); write one with "
                        f"xla-train train --output-dir {run_dir}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    log_file = run_dir / "compilations.json"
    log = json.loads(log_file.read_text()) if log_file.is_file() else {"compilations": [], "warning": None}
    scalars = read_scalars(run_dir / "tensorboard") if (run_dir / "tensorboard").is_dir() else {}
    return metrics, log, scalars


def time_split(metrics):
    """Seconds by where they went: the run's goodput phases (they add up to its wall time)."""
    return {GOODPUT_NAMES[k]: v for k, v in metrics["goodput"]["seconds"].items() if k != "wall"}


STARTUP_NAMES = {"imports": "imports", "data": "data (reading, tokenising)", "model": "model loading",
                 "device": "device set-up"}
GOODPUT_NAMES = {"startup": "start-up (imports, data, model, device set-up)", "compile": "compiling",
                 "train_steps": "training steps", "data": "waiting for data",
                 "rollout": "rollouts (generating, scoring)", "eval": "evaluation",
                 "checkpoint": "checkpoints", "other": "other"}


# --- panels: each draws on one matplotlib axis ---------------------------------------------------
def plot_loss_lr(ax, scalars):
    steps, loss = scalars.get(TAGS["loss"], ([], []))
    ax.plot(steps, loss, "o-", color="tab:blue", ms=3, label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean since last log point)", color="tab:blue")
    lr_ax = ax.twinx()
    lr_steps, lr = scalars.get(TAGS["lr"], ([], []))
    lr_ax.plot(lr_steps, lr, color="tab:orange", label="learning rate")
    lr_ax.set_ylabel("learning rate", color="tab:orange")
    ax.set_title("Loss and learning rate")


def plot_throughput(ax, scalars, log):
    steps, rate = scalars.get(TAGS["throughput"], ([], []))
    log_steps = [0] + scalars.get(TAGS["loss"], ([], []))[0]
    starts = [max((s for s in log_steps if s < step), default=0) for step in steps]  # each interval's start
    ax.hlines(rate, starts, steps, color="tab:green", label="samples/s over each log interval")
    ax.plot(steps, rate, "o", color="tab:green", ms=3)
    first = True
    for e in log["compilations"]:
        if e["phase"] != "train":
            continue
        ax.axvline(e["step"], color="tab:red", alpha=0.5, lw=1, label="compilation" if first else None)
        ax.annotate(f"{tuple(e['shape'])} {e['seconds']:.1f}s", (e["step"], 0), xycoords=("data", "axes fraction"),
                    rotation=90, fontsize=7, va="bottom", ha="right", color="tab:red")
        first = False
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Throughput, compilations marked")


def plot_time(ax, metrics, log):
    parts = time_split(metrics)
    left = 0.0
    colors = ("tab:olive", "tab:red", "tab:green", "tab:cyan", "tab:pink", "tab:brown", "tab:gray") if len(parts) > 4 \
        else ("tab:red", "tab:green", "tab:pink", "tab:gray")
    for (name, seconds), color in zip(parts.items(), colors, strict=False):
        ax.barh(0, seconds, left=left, height=0.6, color=color, label=f"{name}: {seconds:.1f} s")
        left += seconds
    ax.set_ylim(-1.6, 0.5)
    ax.set_yticks([])
    ax.set_xlabel("seconds")
    ax.legend(loc="lower center", fontsize=9)
    goodput = metrics.get("goodput")
    ax.set_title("Where the time went" + (f" (goodput {goodput['ratio']:.2f} of {goodput['seconds']['wall']:.0f} s)"
                                          if goodput else ""))


def plot_evaluations(ax, metrics):
    main = metrics.get("main_metric") or "accuracy"
    steps = [s for s, r in metrics["evaluations"] if main in r]
    ax.plot(steps, [r[main] for _, r in metrics["evaluations"] if main in r], "o-", color="tab:purple")
    best = metrics.get("best")
    if best and best.get("metric") == main:
        ax.axvline(best["step"], color="tab:gray", ls="--", label=f"best: step {best['step']}")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel(main)
    ax.set_title(f"Evaluation: {main} over steps")


def plot_padding(ax, metrics):
    by_length = metrics.get("padding_by_bucket") or {}
    lengths = list(by_length)
    eff = [by_length[k]["efficiency"] for k in lengths]
    bars = ax.bar(range(len(lengths)), eff, color="tab:purple")
    for bar, k in zip(bars, lengths if len(lengths) <= 12 else [], strict=False):
        ax.annotate(f"{by_length[k]['batches']} batches", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(lengths)), lengths, fontsize=7 if len(lengths) > 12 else None,
                  rotation=90 if len(lengths) > 12 else 0)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("padded length (bucket)")
    ax.set_ylabel("real tokens / padded tokens")
    ax.set_title(f"Padding efficiency per bucket (overall {metrics.get('padding_efficiency', 0):.3f})")


# --- the report ------------------------------------------------------------------------------
def write_report(run_dir):
    """Writes RUN_DIR/report/ (PNGs and report.md); returns the path of report.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics, log, scalars = load_run(run_dir)
    out = Path(run_dir) / "report"
    out.mkdir(exist_ok=True)
    panels = {"loss_lr": lambda ax: plot_loss_lr(ax, scalars),
              "throughput": lambda ax: plot_throughput(ax, scalars, log),
              "padding": lambda ax: plot_padding(ax, metrics)}
    several = len(metrics.get("evaluations") or []) > 1  # --eval-every
    extra = {"eval": lambda ax: plot_evaluations(ax, metrics)} if several else {}
    for name, draw in {**panels, **extra}.items():
        fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
        draw(ax)
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(15, 9), layout="constrained")
    for ax, draw in zip(axes.flat, panels.values(), strict=False):
        draw(ax)
    plot_time(axes[1, 1], metrics, log)
    fig.suptitle(f"{shown_name(metrics['model'])} on {metrics['backend']} ({metrics['device']}): "
                 f"{metrics['steps']} steps")
    fig.savefig(out / "overview.png", dpi=100)
    plt.close(fig)
    path = out / "report.md"
    return atomic_write(path, markdown(metrics, log, load_recipe(run_dir)))


def load_recipe(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's recipe: {"text": recipe.yaml's text or None, "changed": {section: {option: value}}
    that differ from the defaults, "error": a line or None}; from the run's record where an older
    run has no recipe.yaml; None where the folder has neither."""
    from ..options import TrainOptions, non_defaults, parse_recipe, recipe_values
    from ..run.folder import RECIPE, RECORD

    run_dir = Path(run_dir)
    text, values, error = None, None, None
    try:
        if (run_dir / RECIPE).is_file():
            text = (run_dir / RECIPE).read_text(encoding="utf-8")
            values = recipe_values(parse_recipe(text, RECIPE), RECIPE)
        elif (run_dir / RECORD).is_file():
            config = json.loads((run_dir / RECORD).read_text(encoding="utf-8")).get("config") or {}
            known = {f for f in TrainOptions.__dataclass_fields__}
            values = {k: v for k, v in config.items() if k in known}
        else:
            return None
    except (UserError, ValueError, OSError) as e:  # an edited or older file: the report still gets written
        error = str(e)
    return {"text": text, "changed": non_defaults(values) if values is not None else {}, "error": error}


def _shown(key: str, value: Any) -> str:
    """A recipe's value as YAML writes it (the bundled model by its name)."""
    if key == "model":
        return shown_name(value)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _recipe_lines(recipe: dict[str, Any] | None) -> list[str]:
    if recipe is None:  # a folder with neither recipe.yaml nor a record
        return []
    lines = ["## Recipe", ""]
    if recipe["text"] is not None:
        lines += ["`recipe.yaml` in the run folder holds every option; `xla-train train --config RUN_DIR/recipe.yaml` "
                  "runs the job again.", ""]
    else:
        lines += ["From the run's record (a run from before recipe.yaml).", ""]
    if recipe["error"]:
        lines += [f"It cannot be read: {recipe['error']}", ""]
    lines += ["| section | option | value (others: the defaults) |", "| --- | --- | --- |"]
    changed = recipe["changed"]
    lines += [f"| {section} | {key} | {_shown(key, value)} |" for section, values in changed.items()
              for key, value in values.items()]
    if not changed:
        lines += ["| | | every option at its default |"]
    if recipe["text"] is not None:
        lines += ["", "<details><summary>recipe.yaml</summary>", "", "```yaml", recipe["text"].rstrip("\n"), "```", "",
                  "</details>"]
    return lines + [""]


def _token_rows(tokens):
    """Token throughput (metrics JSON `tokens`; runs before it had none): tokens/s, trained tokens
    where the task counts them, and MFU where the device's peak is known."""
    if not tokens:
        return []
    rows = [("tokens/s (padded)", tokens["per_s"])]
    if tokens.get("trained") is not None:
        rows.append(("trained tokens (in the loss) / per s", f"{tokens['trained']} / {tokens['trained_per_s']}"))
    if tokens.get("mfu") is not None:
        rows.append(("model FLOPs utilisation", f"{tokens['mfu']:.1%}"))
    return rows


def markdown(metrics, log, recipe=None):
    ev, xla = metrics.get("eval") or {}, metrics.get("xla")
    rows = [("backend / device", f"{metrics['backend']} / {metrics['device']} x {metrics['world_size']}"),
            ("model", shown_name(metrics["model"])), ("steps / epochs", f"{metrics['steps']} / {metrics['epochs']}"),
            ("training seconds", metrics["train_seconds"]),
            ("samples/s (all / after the last compilation)",
             f"{metrics['train_samples_per_s']} / {metrics['steady_samples_per_s']}"),
            ("padding efficiency", metrics["padding_efficiency"]),
            *_token_rows(metrics.get("tokens")),
            ("task", metrics.get("task", "mrpc") + (f" ({metrics['problem']})" if metrics.get("problem") else ""))]
    main = metrics.get("main_metric")
    rows += [(f"dev {k}" + (" (main metric)" if k == main else ""), v if k == "n" or k.startswith("n_") else
              f"{v:.4f}") for k, v in ev.items()]
    if xla:
        shared = xla.get("replicas_sharing_counters", 1)
        if shared > 1:
            rows += [("XLA counters below", f"this process's, which {shared} replicas (threads) share")]
        rows += [("compilations (seconds)", f"{xla['compiles']} ({xla['compile_seconds']} s)"),
                 ("compilations after the first epoch", xla["compiles_after_first_epoch"]),
                 ("host syncs per training step", xla["host_syncs_per_step"]),
                 ("CPU fallbacks (aten ops)", xla["aten_fallbacks"])]
    rows += [(f"time: {k}", f"{v:.1f} s") for k, v in time_split(metrics).items()]
    if (metrics.get("goodput") or {}).get("startup"):  # runs before the split have none
        rows += [("start-up by part", ", ".join(f"{STARTUP_NAMES[k]} {v:.1f} s"
                                                for k, v in metrics["goodput"]["startup"].items()))]
    if metrics.get("goodput"):
        rows += [("goodput (training steps / wall)", f"{metrics['goodput']['ratio']} of "
                                                    f"{metrics['goodput']['seconds']['wall']:.1f} s")]
    lines = ["# Run report", "", "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), ""]
    lines += _recipe_lines(recipe)
    lines += ["## Recompilation warning", "", log.get("warning") or "none: every graph was expected", ""]
    lines += ["## Pictures", "", "![overview](overview.png)", "", "![loss and learning rate](loss_lr.png)",
              "![throughput](throughput.png)", "![padding per bucket](padding.png)",
              *(["![evaluations](eval.png)"] if len(metrics.get("evaluations") or []) > 1 else []), ""]
    lines += ["## Compilations", "", "| step | phase | input shape | graphs | seconds | cause | Python frame |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for e in log["compilations"]:
        shape = tuple(e["shape"]) if e["shape"] else "(evaluation batches)"
        lines.append(f"| {e['step']} | {e['phase']} | {shape} | {e['graphs']} | {e['seconds']} | "
                     f"{e.get('cause') or ''} | {e.get('frame') or ''} |")
    lines += ["", "## Padding per bucket", "", "| length | batches | real tokens | padded tokens | efficiency |",
              "| --- | --- | --- | --- | --- |"]
    for length, b in (metrics.get("padding_by_bucket") or {}).items():
        lines.append(f"| {length} | {b['batches']} | {b['real_tokens']} | {b['padded_tokens']} | {b['efficiency']} |")
    return "\n".join(lines) + "\n"
