"""An output folder holds one run.

The run records who it is in `OUTPUT_DIR/xla_train_run.json` (its id and config) before anything
else is written; once it has finished, the record also holds the final step and scores. A new run
into a folder that holds another run stops with one line unless `--overwrite` is given, which
removes the old run's files (checkpoints, model, logs) before the new run writes anything.
`--resume` continues only the recorded run; a finished run resumed with the same length does
nothing and says so. Beside the record, `OUTPUT_DIR/recipe.yaml` holds the run's options as a
sectioned recipe (every option, defaults included): `xla-train train --config OUTPUT_DIR/recipe.yaml`
runs the job again.
"""

import fnmatch
import json
import os
import uuid
from dataclasses import asdict

from ..core.errors import UserError
from ..io.files import atomic_write
from ..io.storage import complete_steps
from ..options import recipe_text
from ..tasks import scores

RECORD = "xla_train_run.json"
RECIPE = "recipe.yaml"  # the run's options, as `xla-train train --config` reads them
# What a run writes at the top of its folder: its own files and save_pretrained's (model and
# tokenizer files of any model family); --overwrite removes these and nothing else.
RUN_FILES = (RECORD, RECIPE, "checkpoints", "tensorboard", "report", "metrics.json", "compilations.json",
             "xla_train_task.json", "predictions.*", "config.json", "generation_config.json", "model*.safetensors",
             "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
             "merges.txt", "*.model", "chat_template.jinja", "xla_train_failed-*",
             "profile", "mlflow.db", "mlflow_artifacts", "wandb", "adapter_config.json", "adapter_model.safetensors")
# Settings that make a run what it is: a resumed run must have the same (the data order depends on them).
# A run id every host of a pod is given (scripts/tpu_pod.py sets it): the replica that writes the
# checkpoints (global ordinal 0) need not be on host 0, whose parent writes the record
# (pytorch/xla PR #4043), so the id cannot travel from one to the other inside the run.
RUN_ID_VARIABLE = "XLA_TRAIN_RUN_ID"
MUST_MATCH = ("model", "task", "train_file", "text_columns", "label_column", "problem", "batch_size", "grad_accum",
              "seed", "padding", "max_length", "lora", "lora_r", "lora_targets",
              # the base's quantization: the adapters trained against its rounding
              "load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant")


def mismatch(saved, cfg, where):
    """The first MUST_MATCH setting that differs between `saved` (a config dict) and `cfg`, as a
    UserError, or None. Keys an older record lacks match."""
    for key in MUST_MATCH:
        if saved.get(key, getattr(cfg, key)) != getattr(cfg, key):
            flag = "--" + key.replace("_", "-")
            return UserError(f"{where} was made with {flag} {saved[key]}; this run has {flag} {getattr(cfg, key)}: "
                             "resume with the same value")
    return None


def _run_files(names):
    return sorted(n for n in names if any(fnmatch.fnmatch(n, p) for p in RUN_FILES))


class RunFolder:
    """The output folder's run: checked in the parent before any work, claimed just before the
    workers start."""

    def __init__(self, store, cfg, writer=True):
        self.store, self.cfg, self.writer = store, cfg, writer  # writer: one host of a pod writes the record
        self.pod_marker = None  # several hosts: where a failing host tells the others (job.open_output)
        self.found = _run_files(store.names())  # (first: a missing bucket is named here)
        text = store.read_text(RECORD) if RECORD in self.found else None
        try:
            self.record = json.loads(text) if text is not None else None
        except ValueError:
            self.record = None  # an unreadable record: the folder still holds a run (its files)
        self.run_id = None

    def describe(self):
        """What the folder holds, in a few words."""
        parts = []
        steps = complete_steps(self.store)
        if steps:
            parts.append(f"checkpoints at step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}")
        if "model.safetensors" in self.found or "config.json" in self.found:
            parts.append("a fine-tuned model")
        finished = (self.record or {}).get("finished")
        if finished:
            parts.append(f"finished at step {finished['step']}")
        return ", ".join(parts) or ", ".join(self.found)

    def finished_message(self):
        """With --resume: the line to print when the recorded run has finished and this run asks
        for no more steps than it had, else None."""
        finished = (self.record or {}).get("finished")
        if not (self.cfg.resume and finished):
            return None
        assert self.record is not None  # `finished` was read from it
        saved = self.record["config"]
        if (self.cfg.max_steps, self.cfg.epochs) != (saved.get("max_steps"), saved.get("epochs")):
            return None  # a longer (or shorter) run: continue from its checkpoint
        return (f"{self.store.url} holds a finished run ({self.record['run_id']}): step {finished['step']}, dev "
                f"{scores(finished['eval'])}; nothing to do (a larger --max-steps or --epochs trains on, "
                "--overwrite starts over)")

    def check(self):
        """Before any work: a new run needs an empty folder (or --overwrite); --resume needs the
        recorded run's settings."""
        cfg = self.cfg
        if cfg.overwrite and (cfg.resume or cfg.resume_from):
            raise UserError("--overwrite starts a new run; it cannot be used with --resume or --resume-from")
        if cfg.resume and self.record:
            error = mismatch(self.record["config"], cfg, f"the run in {self.store.url}")
            if error:
                raise UserError(f"{error}, or start over with --overwrite")
        if self.found and not (cfg.resume or cfg.resume_from or cfg.overwrite or self._started_by_host_0()):
            raise UserError(f"{self.store.url} already holds a run ({self.describe()}): continue it with --resume, "
                            "or replace it with --overwrite")

    def _started_by_host_0(self):
        """On another host of a pod: the record is this very run's, which host 0 claimed moments
        earlier (same id from the launcher, or the same config, not finished); refusing it would
        leave the hosts that went on waiting in the TPU's start-up."""
        record = self.record or {}
        if self.writer or not record or record.get("finished"):
            return False
        given = os.environ.get(RUN_ID_VARIABLE)
        return record.get("run_id") == given if given else record.get("config") == asdict(self.cfg)

    def check_checkpoint(self, resume):
        """A checkpoint this run resumes from belongs to the folder's run (if it records one)."""
        theirs = resume.state.get("run_id")
        mine = (self.record or {}).get("run_id")
        if mine and theirs and mine != theirs:
            raise UserError(f"checkpoint {resume.url} belongs to run {theirs}, not to {mine}, the run in "
                            f"{self.store.url}: resume into that run's folder, or start over with --overwrite")

    def claim(self, resume=None):
        """Just before the workers start: the folder is made; --overwrite removes the old
        run's files; the record names this run (a resumed run keeps its id). Returns the run id."""
        old = (resume.state.get("run_id") if resume else None) or (self.record or {}).get("run_id")
        given = os.environ.get(RUN_ID_VARIABLE)
        if not self.writer:  # another host of the pod: host 0's parent writes the record
            return old or given
        self.store.make()
        if self.cfg.overwrite and self.found:
            self.store.remove(self.found)
            print(f"--overwrite: removed the run in {self.store.url} ({', '.join(self.found)})")
            self.record, old = None, None
        self.run_id = old or given or uuid.uuid4().hex[:12]
        self.store.write_text(RECORD, json.dumps({"run_id": self.run_id, "config": asdict(self.cfg),
                                                  "finished": None}, indent=1) + "\n")
        recipe = self.write_recipe()
        if resume is not None:
            print(f"resuming run {self.run_id} with the recipe {recipe}")
        return self.run_id

    def write_recipe(self) -> str:
        """Writes the run's options as OUTPUT_DIR/recipe.yaml (a resumed run's: its longer
        --max-steps or --epochs too); returns its path or URL."""
        url = f"{self.store.url.rstrip('/')}/{RECIPE}"
        header = [f"xla-train's recipe of run {self.run_id}: every option, defaults included, by section.",
                  f"Run it again: xla-train train --config {url} --output-dir NEW_DIR",
                  "(into this folder: add --overwrite to start over, or --resume to go on; a flag given overrides",
                  "the recipe). resume, overwrite and resume_from say what a command does with the folder: they",
                  "are recorded at their defaults. Relative paths are relative to where the command runs."]
        self.store.write_text(RECIPE, recipe_text(self.cfg, header))
        return url


def write_finished(folder, run_id, cfg, step, results, best, stopped_early):
    """The record of a finished run, into the run's local folder (published with the model)."""
    record = {"run_id": run_id, "config": asdict(cfg),
              "finished": {"step": step, "eval": results, "best": best, "stopped_early": stopped_early}}
    atomic_write(folder / RECORD, json.dumps(record, indent=1) + "\n")
