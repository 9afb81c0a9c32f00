"""`--report-to`: the run's scalars, at the monitor's log points, in the trackers users already
use (the Trainer's `report_to`, Accelerate's `log_with`). TensorBoard is the monitor's own writer;
MLflow and Weights & Biases are here. Only the main process logs; the config is logged once at the
start and the final metrics once at the end. A tracker that cannot start stops the run before
training (one line); one that fails mid-run is warned about once and dropped, and training goes on.
"""

import importlib
import json
import netrc
import os
import time
import warnings
from pathlib import Path

from ..core.errors import UserError


class MLflow:
    """MLFLOW_TRACKING_URI when set, else an sqlite store in the output folder (MLflow 3 refuses
    a plain file store unless told, and would put mlflow.db in the current folder), artifacts
    beside it."""

    def __init__(self, params, out, name):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri and out is None:
            raise UserError("--report-to mlflow needs MLFLOW_TRACKING_URI or a local --output-dir")
        _installed("mlflow")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=uri or f"sqlite:///{out.resolve() / 'mlflow.db'}")
        experiment = self.client.get_experiment_by_name("xla-train")
        artifacts = (out.resolve() / "mlflow_artifacts").as_uri() if out is not None else None
        experiment_id = (experiment.experiment_id if experiment else
                         self.client.create_experiment("xla-train", artifact_location=artifacts))
        self.run = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in params.items()]
        self.client.log_batch(self.run, params=params)

    def log(self, step, values):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def text(self, step, name, rows):
        self.client.log_text(self.run, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), name)

    def finish(self, final, step):
        self.log(step, final)
        self.client.set_terminated(self.run)


class Wandb:
    """Offline (WANDB_MODE=offline) when no key is configured, so it runs without a network; its
    folder (WANDB_DIR) in the output folder."""

    def __init__(self, params, out, name):
        wandb = _installed("wandb")

        if "WANDB_MODE" not in os.environ and not _wandb_key():
            os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")  # the run's own lines stay readable
        folder = os.environ.get("WANDB_DIR") or (str(out) if out is not None else None)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "xla-train"), name=name, config=dict(params),
                              dir=folder)

    def log(self, step, values):
        self.run.log(values, step=step)

    def text(self, step, name, rows):
        import wandb

        columns = list(rows[0])
        data = [[v if isinstance(v, str) else json.dumps(v) for v in row.values()] for row in rows]
        self.run.log({"eval/samples": wandb.Table(columns=columns, data=data)}, step=step)

    def finish(self, final, step):
        self.run.summary.update(final)
        folder = self.run.dir
        self.run.finish()
        if os.environ.get("WANDB_MODE") == "offline":
            print(f"wandb: offline run in {Path(folder).parent} (upload it with `wandb sync`)")


def _installed(module):
    """The tracker's module, or one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise UserError(f"--report-to {module} needs {module}, which is not installed: pip install "
                        "'xla-train[trackers]'") from None


def _wandb_key():
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


KINDS: dict[str, type[MLflow | Wandb]] = {"mlflow": MLflow, "wandb": Wandb}
# --report-to's names: TensorBoard is the monitor's own writer (always on where the output folder is
# local: the report reads its events), the others are KINDS
TRACKERS = ("tensorboard", *KINDS)


def trackers(spec):
    """The tracker names of a --report-to value ("none": none)."""
    names = [n.strip() for n in (spec or "").split(",") if n.strip()]
    return [] if names == ["none"] else names


class Trackers:
    """The external trackers of a run, started on the main process (`Engine.on_main`: every
    replica learns whether they started)."""

    def __init__(self, engine, report_to, params, out, name):
        """`report_to`: the trackers' names (the --report-to value); `params`: what they record
        as the run's hyperparameters (every option)."""
        self.active: dict[str, MLflow | Wandb] = {}
        names = [n for n in trackers(report_to) if n in KINDS]
        if not names:
            return

        def start():
            self.active = {n: KINDS[n](params, out, name) for n in names}

        engine.on_main(start, f"--report-to {report_to}: cannot start the tracker")

    def _each(self, call):
        for name, tracker in list(self.active.items()):
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001 - a tracker's failure must not end the training
                warnings.warn(f"--report-to {name} failed ({type(e).__name__}: {e}); it logs no more in this run",
                              stacklevel=2)
                del self.active[name]

    def log(self, step, values):
        values = {k: float(v) for k, v in values.items() if v is not None}
        self._each(lambda t: t.log(step, values))

    def text(self, step, name, rows):
        """Rows of text (--eval-samples): MLflow's artifact `name` (JSON lines), a W&B table."""
        self._each(lambda t: t.text(step, name, rows))

    def finish(self, metrics):
        final = {f"final/{k}": v for k, v in (metrics.get("eval") or {}).items() if isinstance(v, (int, float))}
        final.update({"final/train_samples_per_s": metrics["train_samples_per_s"],
                      "final/goodput": metrics["goodput"]["ratio"]})
        self._each(lambda t: t.finish(final, metrics["steps"]))
