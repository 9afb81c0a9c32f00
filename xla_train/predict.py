"""Predictions from a fine-tuned classifier, with static shapes on XLA.

    xla-train predict --model runs/mrpc --input test.tsv --output predictions.tsv
    xla-train predict --model runs/reviews --input new_reviews.csv --output scored.csv --backend xla

Rows are sorted by length into a few buckets (chosen like training's, for a forward pass's cost),
every batch has the same row count (the last is filled with masked rows), replicas each predict a
shard, and the predictions are put back in input order: each row is predicted exactly once.

The output's formats: predictions.py.
"""

from .core.batching import model_inputs_only
from .core.engine import Engine
from .core.inference import predict_loader, predict_rows
from .core.select import select_roles
from .core.shapes import CostModel, choose_buckets, padding_for
from .models import load_pretrained
from .predictions import read_input, tokenize_rows, write_output
from .tasks import from_folder


def forward_padding(lengths, roles, buckets, max_length):
    """The padding of one forward pass over these rows: the given bucket lengths, or `--buckets
    auto`'s for a forward pass (about a third of a training step's cost; one graph per bucket)."""
    def choose():
        cost = CostModel(compile_seconds=roles.accelerator.compile_seconds,
                         token_seconds=roles.accelerator.token_seconds, graphs_per_bucket=1)
        return choose_buckets(lengths, 1 / 3, max_length, cost)[0]

    return padding_for("buckets", buckets, max_length, [lengths], choose)


def predict_worker(cfg, task, table, model, tokenizer, data, padding):
    engine = Engine(cfg.backend, num_processes=cfg.num_processes, strategy=cfg.strategy)
    loader = predict_loader(engine, tokenizer, data, cfg.batch_size, padding)
    model = engine.prepare(model)
    scores = predict_rows(engine, model, loader, task.predict_columns)
    if engine.is_main_process:
        assert len(scores) == len(table), (len(scores), len(table))  # each row exactly once
        write_output(cfg.output, table, task, scores)
        stats = engine.compile_stats()
        compiled = f"; {stats['compiles']} graphs compiled for buckets {padding.buckets}" if stats else ""
        engine.print(f"predicted {len(scores)} rows into {cfg.output}{compiled}")


def run(cfg):
    """`xla-train predict`: every check first, then the model, then the replicas."""
    from transformers import AutoTokenizer

    cfg.validate()  # --model is a model folder
    task = from_folder(cfg.model)
    task.check_predict(cfg.model)
    cfg.max_length = cfg.max_length or task.max_length
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
