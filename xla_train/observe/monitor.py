"""What the run is doing: TensorBoard scalars, a compilation log, and a recompilation explainer.

The trainer (train.Trainer) calls a few hooks at named points of its loop (`step`, `log`,
`evaluated`, `samples`, `close`). Nothing here reads the device inside a step: per-step hooks only
run host work in a step closure (compilation and transfer counters, the input shape); values that
live on the device (loss, gradient norm) are read by the trainer at `--log-every` points and
handed to `log`. The monitor owns the
`RunClock`, the one place that reads and diffs the compilation counters.

Files, on the main replica and only for a local --output-dir:
    OUTPUT_DIR/tensorboard/      event files (tags below)
    OUTPUT_DIR/metrics.json      the run's metrics dict
    OUTPUT_DIR/compilations.json every compilation (step, phase, input shape, seconds, cause)
    OUTPUT_DIR/xla_debug.log     torch_xla's own compilation analysis (PT_XLA_DEBUG_LEVEL=1)
    OUTPUT_DIR/report/           see xla_train.observe.report
"""

import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..core.clock import RunClock
from ..io.files import atomic_write
from ..io.storage import is_remote
from .report import tag, write_report
from .trackers import Trackers

ANALYSIS = re.compile(r"Compilation Cause\n\s*(.*?)\n.*?Python Frame Triggered Execution: *\n(.*?)\n-{10}", re.S)
LIBRARY_FRAME = re.compile(  # plumbing: a compilation's cause is named by the first frame outside it
    r"[/\\](torch|torch_xla)[/\\]|xla_train[/\\](core[/\\](engine|roles|xla|clock)|monitor|run_state)\.py")


class Monitor:
    """One per worker; a no-op on replicas other than the main one."""

    def __init__(self, engine, output_dir, shapes, startup=None, run_id=None, report_to=None, params=None):
        """`output_dir`: where the run's files go (a local folder gets TensorBoard's and the
        compilation log); `report_to` and `params`: the trackers and what they record (Trackers)."""
        self.engine = engine
        self.on = engine.is_main_process
        local = bool(output_dir) and not is_remote(output_dir)
        self.out = Path(output_dir) if self.on and local else None
        self.buckets = shapes.padding.lengths  # None: dynamic padding, lengths unbounded
        # training graphs a healthy run compiles: one per bucket plus the first step's (no
        # optimizer state yet), and one spare; dynamic padding counts as one unbounded bucket
        self.threshold = (len(self.buckets) if self.buckets else 1) + 2
        # torch_xla's counters and debug file are the process's: with replicas as threads in one
        # process (Colab's TPU v2-8/v3-8) another replica's compilation shows up in this one's
        # steps, so a compilation cannot be pinned on a shape that already ran
        self.shared = engine.replicas_per_process
        self.threshold *= self.shared
        self.samples_per_step = shapes.rows_per_step
        self.recompiles_per_length = shapes.padding.recompiles_per_length
        self.compilations, self.warning = [], None
        self._seen, self._warm, self._eval_steps = set(), set(), []
        self._writer, self._debug, self._debug_offset, self._tmp = None, None, 0, None
        self._t_start = time.perf_counter()
        self._last, self._last_log = None, (0, self._t_start)
        if self.on:
            self._open_files()
        self.trackers = Trackers(engine, report_to, params or {}, self.out, run_id)  # --report-to: MLflow, W&B
        self.clock = RunClock(engine, startup)  # counters start here, once compilations are traced
        self._last = self.clock.delta()[1] if self.on and self.clock.counting else None

    def _open_files(self):
        if self.out:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.out / "tensorboard"))
            debug_path = self.out / "xla_debug.log"
        else:
            self._tmp = tempfile.mkdtemp(prefix="xla_train_")
            debug_path = Path(self._tmp) / "xla_debug.log"
        debug_path.unlink(missing_ok=True)
        debug = self.engine.trace_compilations(debug_path)  # before the first compilation
        if debug:
            self._debug = Path(debug)
            self._debug_offset = self._debug.stat().st_size if self._debug.exists() else 0

    # --- hooks --------------------------------------------------------------------------------
    def step(self, step, batch):
        """After each optimizer step: once the step's graph is cut, note any compilation."""
        if step == 1:
            self._last_log = (0, time.perf_counter())  # throughput counts from here
        if self.on and self._last is not None:
            inputs = batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()))
            self.engine.step_closure(self._after_step, (step, tuple(inputs.shape)))

    def log(self, step, loss, lr, grad_norm, extra=None):
        """At a log point (inside the step closure): scalars to TensorBoard; `extra`: the kind's
        own training metrics (Objective.step_metrics), {name: mean since the last log point}."""
        if not self.on:
            return
        now = time.perf_counter()
        (prev_step, prev_t), self._last_log = self._last_log, (step, now)
        values = {"loss": loss, "lr": lr, "grad_norm": grad_norm, **(extra or {})}
        # samples/s since the previous log point; skipped when an evaluation ran in between
        if not any(prev_step <= e < step for e in self._eval_steps):
            values["throughput"] = (step - prev_step) * self.samples_per_step / (now - prev_t)
        stats = self.clock.counters()
        if stats:
            values.update(compiles=stats["compiles"], compile_seconds=stats["compile_seconds"])
            if "transfers" in stats:  # XLA's (torch.compile counts graphs and seconds only)
                values["host_syncs"] = stats["transfers"]
        self._scalars(step, values)

    def evaluated(self, step, results):
        """After each evaluation: eval scalars; compilations since the last step are evaluation's."""
        if not self.on:
            return
        self._eval_steps.append(step)
        self._scalars(step, {k: v for k, v in results.items() if k != "n" and not k.startswith("n_")})
        if self._last is not None:
            self._note_compiles(step, "eval", None)

    def samples(self, step, rows):
        """After an evaluation with --eval-samples: the completions on the console, in
        OUTPUT_DIR/samples/step-K.jsonl, TensorBoard's text tab and the trackers."""
        if not self.on:
            return
        for row in rows:
            prompt = row["prompt"] if "prompt" in row else row["messages"]
            prompt = prompt[-1]["content"] if isinstance(prompt, list) else prompt  # chat turns: the last one's
            told = (f"reference: {_short(row['reference'])}" if "reference" in row else
                    f"reward {row['reward']:.3f}")  # a kind scored by rewards (GRPO) has none
            completion = row["completion"]
            if not isinstance(completion, str):  # a GRPO run with tools: its turns, calls and results
                completion = " / ".join(t.get("content") or json.dumps(t.get("tool_calls"), ensure_ascii=False)
                                        for t in completion)
            self.engine.print(f"  sample: {_short(prompt)} -> {_short(completion)} ({told})")
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        if self.out:
            atomic_write(self.out / "samples" / f"step-{step}.jsonl", lines)
        if self._writer:
            self._writer.add_text("eval/samples", _markdown(rows), step)
        self.trackers.text(step, f"samples/step-{step}.jsonl", rows)

    def close(self, metrics):
        """At the end of the run: the trackers' final metrics, metrics.json, compilations.json and
        the report."""
        if self.on:
            self.trackers.finish(metrics)
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
        if not self.out:
            return
        assert self._writer is not None  # opened with self.out (_open_files)
        self._writer.close()
        atomic_write(self.out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
        log = {"compilations": self.compilations, "warning": self.warning, "threshold": self.threshold,
               "wall_seconds": round(time.perf_counter() - self._t_start, 3)}
        atomic_write(self.out / "compilations.json", json.dumps(log, indent=2) + "\n")
        path = write_report(self.out)
        self.engine.print(f"report: {path}")

    # --- inside step closures ---------------------------------------------------------------
    def _scalars(self, step, values):
        self.trackers.log(step, {tag(k): v for k, v in values.items()})  # TensorBoard's names
        if self._writer:
            for key, value in values.items():
                if value is not None:
                    self._writer.add_scalar(tag(key), value, step)

    def _after_step(self, step, shape):
        new = self._note_compiles(step, "train", shape)
        if not new:
            self._warm.add(shape)
        elif self.warning is None:
            reason = self._explain(step, shape, new)
            if reason:
                self.warning = reason
                self.engine.print(f"xla-train: warning: recompilation: {reason}", file=sys.stderr)
        self._seen.add(shape)

    def _note_compiles(self, step, phase, shape):
        since, self._last = self.clock.delta(self._last)
        graphs, seconds, syncs = since["compiles"], since["compile_seconds"], since.get("transfers")
        if not graphs:
            return None
        # of several graphs in one step, name one not cut by the loader at the end of the step
        causes = self._analyses(graphs)
        cause, frame = next((c for c in causes if not _usual(c[0])), causes[-1]) if causes else (None, None)
        event = {"step": step, "phase": phase, "shape": list(shape) if shape else None, "graphs": graphs,
                 "seconds": round(seconds, 3), "host_syncs": syncs, "cause": cause, "frame": frame}
        self.compilations.append(event)
        return event

    def _analyses(self, count):
        """(cause, innermost frame outside torch) of the last `count` compilations, if traced."""
        if not self._debug or not self._debug.exists():
            return []
        with open(self._debug, encoding="utf-8", errors="replace") as f:
            f.seek(self._debug_offset)
            chunk = f.read()
        self._debug_offset += len(chunk.encode("utf-8"))
        text = re.sub(r"(?m)^Compilation Analysis: ?", "", chunk)
        out = []
        for cause, frames in ANALYSIS.findall(text):
            lines = [ln.strip() for ln in frames.splitlines() if ln.strip()]
            user = [ln for ln in lines if not LIBRARY_FRAME.search(ln)]
            out.append((cause.strip(), (user or lines or [None])[0]))
        return out[-count:]

    def _explain(self, step, shape, event):
        """The cause of an unexpected compilation in a training step, or None if it is expected."""
        length = shape[-1]
        where = f" ({event['cause']}, at {event['frame']})" if event["frame"] and not _usual(event["cause"]) else ""
        if "tensor value" in (event["cause"] or ""):  # torch_xla: "user code trying to access tensor value ..."
            return (f"step {step}: a device-to-host read inside the training step cut its graph, at "
                    f"{event['frame']} ({event['cause']}): the host waits for the device at every step that "
                    f"runs it; keep values on the device, or read them in a step closure")
        if self.buckets and shape not in self._seen and length not in self.buckets:
            fits = [b for b in self.buckets if b >= length]
            missed = f"it fits bucket {fits[0]}" if fits else "it is longer than every bucket"
            return (f"step {step} compiled a new graph for input shape {shape}: length {length} is not one "
                    f"of the buckets {self.buckets} ({missed}); pad every batch to a bucket length")
        if shape in self._warm and self.shared == 1:
            return (f"step {step} compiled input shape {shape} again, after steps of that shape ran "
                    f"without compiling: the graph changed{where}; {event['host_syncs']} device-to-host "
                    f"transfer(s) since the previous step. PT_XLA_DEBUG_LEVEL=2 prints every frame")
        train_graphs = sum(e["graphs"] for e in self.compilations if e["phase"] == "train")
        if train_graphs > self.threshold:
            hint = ("--padding dynamic compiles a graph for every batch length; --padding buckets bounds them"
                    if self.recompiles_per_length else "every new input shape or graph change compiles")
            return (f"{train_graphs} training graphs compiled by step {step} (more than {self.threshold}), "
                    f"the latest for new input shape {shape}{where}: {hint}")
        return None


def _usual(cause):
    """The loader's ordinary graph cut at the end of every step (torch_xla's wording)."""
    return "step end" in (cause or "")


def _short(text, width=60):
    text = " ".join(str(text).split())
    return repr(text if len(text) <= width else text[:width - 3] + "...")


def _markdown(rows):
    """Samples as a Markdown table (TensorBoard's text tab renders Markdown)."""
    def cell(value):
        value = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return value.replace("|", "\\|").replace("\n", " ")

    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows])
