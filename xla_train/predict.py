"""Predictions from a fine-tuned classifier, or completions from a causal LM, with static shapes
on XLA.

    xla-train predict --model runs/mrpc --input test.tsv --output predictions.tsv
    xla-train predict --model runs/reviews --input new_reviews.csv --output scored.csv --backend xla
    xla-train predict --model runs/chat --input questions.jsonl --output answers.jsonl --max-new-tokens 128

Rows are sorted by length into a few buckets (chosen like training's, for a forward pass's cost),
every batch has the same row count (the last is filled with masked rows), replicas each predict a
shard, and the predictions are put back in input order: each row is predicted exactly once.

The output's formats: predictions.py; a causal LM's rows and completions: generation.py.
"""

import json
import time
from pathlib import Path

from .core.batching import model_inputs_only
from .core.engine import Engine
from .core.files import atomic_write
from .core.inference import predict_loader, predict_rows
from .core.select import select_roles
from .core.shapes import forward_padding
from .generation import MAX_NEW_TOKENS, complete, generation_model, prompts_to_complete, write_completions
from .models import load_pretrained
from .predictions import read_input, tokenize_rows, write_output
from .tasks import from_folder

def predict_worker(cfg, task, table, model, tokenizer, data, padding):
    engine = Engine(cfg.backend, num_processes=cfg.num_processes, strategy=cfg.strategy)
    loader = predict_loader(engine, tokenizer, data, cfg.batch_size, padding)
    model = engine.prepare(model)
    start = time.perf_counter()
    scores = predict_rows(engine, model, loader, task.predict_columns)
    if engine.is_main_process:
        assert len(scores) == len(table), (len(scores), len(table))  # each row exactly once
        write_output(cfg.output, table, task, scores)
        engine.print(f"predicted {len(scores)} rows into {cfg.output}{_compiled(engine, padding)}")
        _write_metrics(cfg, engine, padding, {"rows": len(scores), "seconds": round(time.perf_counter() - start, 3)})


def generate_worker(cfg, model, prompts):
    engine = Engine(cfg.backend, num_processes=cfg.num_processes, strategy=cfg.strategy)
    engine.seed(cfg.seed or 0)
    model = engine.prepare(model)
    start = time.perf_counter()
    texts, counts = complete(engine, model, prompts, cfg.batch_size)
    seconds = time.perf_counter() - start
    if engine.is_main_process:
        assert len(texts) == len(prompts.data), (len(texts), len(prompts.data))  # each row exactly once
        write_completions(cfg.output, prompts.columns, texts)
        rate = sum(counts) / seconds
        engine.print(f"generated {len(texts)} completions ({sum(counts)} tokens, {rate:.1f} tokens/s) into "
                     f"{cfg.output}{_compiled(engine, prompts.padding)}")
        _write_metrics(cfg, engine, prompts.padding, {"rows": len(texts), "max_new_tokens": prompts.sampling.max_new_tokens,
                                                      "tokens_generated": sum(counts), "seconds": round(seconds, 3),
                                                      "tokens_per_s": round(rate, 2)})


def _compiled(engine, padding):
    stats = engine.compile_stats()
    return f"; {stats['compiles']} graphs compiled for buckets {padding.buckets}" if stats else ""


def _write_metrics(cfg, engine, padding, metrics):
    if not cfg.metrics_out:
        return
    stats = engine.compile_stats()
    metrics = {**metrics, "backend": engine.runtime, "world_size": engine.data_parallel_size, "buckets": padding.buckets,
               **({"xla": stats} if stats else {})}
    atomic_write(Path(cfg.metrics_out), json.dumps(metrics, indent=1) + "\n")


def run(cfg):
    """`xla-train predict`: every check first, then the model, then the replicas."""
    cfg.validate()  # --model is a model folder
    task = from_folder(cfg.model)
    task.check_predict(cfg)
    cfg.max_length = cfg.max_length or task.max_length
    if task.generates:
        return run_generation(cfg, task)
    from transformers import AutoTokenizer

    table = read_input(cfg.input, task, cfg.text_columns, cfg.task)
    backend = select_roles(cfg.backend, cfg.num_processes, cfg.strategy)
    tokenizer = load_pretrained(AutoTokenizer, cfg.model)
    data, truncated = tokenize_rows(table, task, tokenizer, cfg.max_length)
    if truncated:
        print(f"truncated to --max-length {cfg.max_length} tokens: {truncated} rows")
    padding = forward_padding(data["length"], backend.accelerator, cfg.buckets, cfg.max_length)
    model = task.load_trained(cfg.model)  # a whole model, or an adapter (--lora) on its base
    data = model_inputs_only(data, model)
    backend.launch(predict_worker, (cfg, task, table, model, tokenizer, data, padding))


def run_generation(cfg, task):
    """A causal LM's completions: the prompts left-padded to buckets (generation.py, core/generate.py)."""
    from transformers import AutoTokenizer

    backend = select_roles(cfg.backend, cfg.num_processes, cfg.strategy)
    tokenizer = load_pretrained(AutoTokenizer, cfg.model)
    model = generation_model(task.load_trained(cfg.model))  # a whole model, or an adapter (--lora) merged
    prompts = prompts_to_complete(cfg.input, tokenizer, model, cfg.max_length, cfg.buckets, backend.accelerator,
                                  cfg.max_new_tokens or MAX_NEW_TOKENS, cfg.temperature or 0.0, cfg.top_p or 1.0)
    if prompts.truncated:
        print(f"truncated to their last --max-length {cfg.max_length} tokens: {prompts.truncated} prompts")
    backend.launch(generate_worker, (cfg, model, prompts))
