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
from .core.generate import Sampling, generate_rows
from .core.inference import predict_loader, predict_rows
from .core.select import select_roles
from .core.shapes import CostModel, choose_buckets, padding_for
from .generation import (
    check_lengths,
    completions,
    end_ids,
    generation_model,
    left_padded,
    read_prompts,
    write_completions,
)
from .models import load_pretrained
from .predictions import read_input, tokenize_rows, write_output
from .tasks import from_folder

MAX_NEW_TOKENS = 64  # --max-new-tokens' default


def forward_padding(lengths, roles, buckets, max_length, graphs=1):
    """The padding of one forward pass over these rows: the given bucket lengths, or `--buckets
    auto`'s for a forward pass (about a third of a training step's cost; `graphs` per bucket:
    generation compiles two, the prompt's pass and the one-token step)."""
    def choose():
        cost = CostModel(compile_seconds=roles.accelerator.compile_seconds,
                         token_seconds=roles.accelerator.token_seconds, graphs_per_bucket=graphs)
        return choose_buckets(lengths, 1 / 3, max_length, cost)[0]

    return padding_for("buckets", buckets, max_length, [lengths], choose)


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


def generate_worker(cfg, columns, model, tokenizer, data, padding, sampling):
    engine = Engine(cfg.backend, num_processes=cfg.num_processes, strategy=cfg.strategy)
    engine.seed(cfg.seed or 0)
    loader = predict_loader(engine, tokenizer, data, cfg.batch_size, padding)
    model = engine.prepare(model)
    start = time.perf_counter()
    tokens = generate_rows(engine, model, loader, sampling)
    seconds = time.perf_counter() - start
    if engine.is_main_process:
        assert len(tokens) == len(data), (len(tokens), len(data))  # each row exactly once
        texts, counts = completions(tokens, tokenizer, sampling.eos_ids)
        write_completions(cfg.output, columns, texts)
        rate = sum(counts) / seconds
        engine.print(f"generated {len(texts)} completions ({sum(counts)} tokens, {rate:.1f} tokens/s) into "
                     f"{cfg.output}{_compiled(engine, padding)}")
        _write_metrics(cfg, engine, padding, {"rows": len(texts), "max_new_tokens": sampling.max_new_tokens,
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
    padding = forward_padding(data["length"], backend, cfg.buckets, cfg.max_length)
    model = task.load_trained(cfg.model)  # a whole model, or an adapter (--lora) on its base
    data = model_inputs_only(data, model)
    backend.launch(predict_worker, (cfg, task, table, model, tokenizer, data, padding))


def run_generation(cfg, task):
    """A causal LM's completions: the prompts left-padded to buckets (generation.py, core/generate.py)."""
    from transformers import AutoTokenizer

    backend = select_roles(cfg.backend, cfg.num_processes, cfg.strategy)
    tokenizer = load_pretrained(AutoTokenizer, cfg.model)
    columns, data, truncated = read_prompts(cfg.input, tokenizer, cfg.max_length)
    if truncated:
        print(f"truncated to their last --max-length {cfg.max_length} tokens: {truncated} prompts")
    padding = forward_padding(data["length"], backend, cfg.buckets, cfg.max_length, graphs=2)
    model = generation_model(task.load_trained(cfg.model))  # a whole model, or an adapter (--lora) merged
    max_new = cfg.max_new_tokens or MAX_NEW_TOKENS
    check_lengths(model, tokenizer, max(data["length"]), padding.buckets[-1] + max_new, max_new,
                  backend.accelerator.static_shapes)
    eos = end_ids(tokenizer, model)
    tokenizer = left_padded(tokenizer, eos)
    sampling = Sampling(max_new, eos, tokenizer.pad_token_id, cfg.temperature or 0.0, cfg.top_p or 1.0)
    backend.launch(generate_worker, (cfg, columns, model, tokenizer, data, padding, sampling))
