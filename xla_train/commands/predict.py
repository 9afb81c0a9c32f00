"""Predictions from a fine-tuned classifier, or completions from a causal LM, with static shapes
on XLA.

    xla-train predict --model runs/mrpc --input test.tsv --output predictions.tsv
    xla-train predict --model runs/reviews --input new_reviews.csv --output scored.csv --backend xla
    xla-train predict --model runs/chat --input questions.jsonl --output answers.jsonl --max-new-tokens 128

Rows are sorted by length into a few buckets (chosen like training's, for a forward pass's cost),
every batch has the same row count (the last is filled with masked rows), replicas each predict a
shard, and the predictions are put back in input order: each row is predicted exactly once.

Each kind's prediction part does the work (tasks/base.py): a classifier's or a regression's rows
and their output formats, tasks/table.py; a causal LM's prompts and completions, tasks/completion.py.
"""

import json
import time
from pathlib import Path

from ..core.engine import Engine
from ..core.select import select_roles
from ..io.files import atomic_write
from ..models import load_pretrained
from ..tasks import PredictSettings, from_folder


def predict_worker(cfg, prediction, model, rows):
    """On every replica: its share of the rows; the main process writes them all, in input order."""
    engine = Engine(cfg.backend, num_processes=cfg.num_processes, strategy=cfg.strategy)
    engine.seed(cfg.seed or 0)  # sampling (--temperature)
    model = engine.prepare(model)
    start = time.perf_counter()
    result = prediction.predict(engine, model, rows, cfg.batch_size)
    seconds = time.perf_counter() - start
    if engine.is_main_process:
        done, metrics = prediction.write(cfg.output, rows, result, seconds)
        stats = engine.compile_stats()
        compiled = f"; {stats['compiles']} graphs compiled for buckets {rows.padding.buckets}" if stats else ""
        engine.print(f"{done} into {cfg.output}{compiled}")
        if cfg.metrics_out:
            metrics = {**metrics, "backend": engine.runtime, "world_size": engine.data_parallel_size,
                       "buckets": rows.padding.buckets, **({"xla": stats} if stats else {})}
            atomic_write(Path(cfg.metrics_out), json.dumps(metrics, indent=1) + "\n")


def run(cfg):
    """`xla-train predict`: every check first, then the model, then the replicas. The model's
    task (its folder's record) says how: scores per row, or a completion per prompt."""
    from transformers import AutoTokenizer

    cfg.validate()  # --model is a model folder
    task = from_folder(cfg.model)
    prediction = task.prediction
    settings = PredictSettings(cfg.model, cfg.max_length or task.max_length, cfg.buckets, cfg.max_new_tokens,
                               cfg.temperature, cfg.top_p, cfg.seed, cfg.text_columns, cfg.task)
    prediction.check(settings)
    backend = select_roles(cfg.backend, cfg.num_processes, cfg.strategy)
    tokenizer = load_pretrained(AutoTokenizer, cfg.model)
    rows = prediction.read(cfg.input, tokenizer, settings)  # the input checked before the model loads
    if rows.truncated:
        print(f"truncated to --max-length {settings.max_length} tokens: {rows.truncated} {prediction.unit}")
    model = prediction.load(cfg.model, backend.accelerator.name)
    rows = prediction.fit(rows, model, backend.accelerator, settings)
    backend.launch(predict_worker, (cfg, prediction, model, rows))
