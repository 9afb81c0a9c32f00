"""The Hugging Face course's full training loop, ported to xla_train the way the course ports it
to Accelerate: an Engine instead of an Accelerator, and `engine.optimizer_step(optimizer)`.

    python scripts/custom_loop_mrpc.py                                  # auto backend
    PJRT_DEVICE=CPU python scripts/custom_loop_mrpc.py --backend xla     # XLA on the CPU
    python scripts/custom_loop_mrpc.py --backend cpu --num-processes 2   # two gloo workers

On XLA, `prepare` turns the per-batch padding of DataCollatorWithPadding into a few fixed
shapes, so the loop compiles a handful of graphs instead of one per batch length.
"""

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_scheduler,
)

from xla_train import Engine, launch
from xla_train.models import bundled_model_path
from xla_train.tasks import load_metric, load_mrpc


def training_function(args):
    engine = Engine(backend=args.backend, num_processes=args.num_processes)  # was: Accelerator()
    torch.manual_seed(args.seed)
    checkpoint = args.model or bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    raw_datasets = load_mrpc(args.data_dir)  # the course: load_dataset("glue", "mrpc")

    def tokenize_function(example):
        return tokenizer(example["sentence1"], example["sentence2"], truncation=True)

    tokenized_datasets = raw_datasets.map(tokenize_function, batched=True)
    tokenized_datasets = tokenized_datasets.remove_columns(["sentence1", "sentence2", "idx"])
    tokenized_datasets = tokenized_datasets.rename_column("label", "labels")
    tokenized_datasets.set_format("torch")
    data_collator = DataCollatorWithPadding(tokenizer=tokenizer)
    train_dataloader = DataLoader(tokenized_datasets["train"], shuffle=True, batch_size=8, collate_fn=data_collator)
    eval_dataloader = DataLoader(tokenized_datasets["validation"], batch_size=8, collate_fn=data_collator)

    model = AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_dataloader, eval_dataloader, model, optimizer = engine.prepare(
        train_dataloader, eval_dataloader, model, optimizer)

    num_training_steps = args.epochs * len(train_dataloader)
    if args.max_steps:
        num_training_steps = min(num_training_steps, args.max_steps)
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0,
                                 num_training_steps=num_training_steps)
    progress_bar = tqdm(range(num_training_steps), disable=not engine.is_main_process)
    step = 0
    model.train()
    for epoch in range(args.epochs):
        train_dataloader.set_epoch(epoch)
        for batch in train_dataloader:
            outputs = model(**batch)
            engine.backward(outputs.loss)  # was: accelerator.backward(loss)
            engine.optimizer_step(optimizer)  # was: optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            progress_bar.update(1)
            step += 1
            if step == num_training_steps:
                break
        if step == num_training_steps:
            break

    metric = load_metric()  # evaluate.load("glue", "mrpc"), from the copy inside the package (no hub)
    model.eval()
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        predictions = torch.argmax(outputs.logits, dim=-1)
        predictions, references = engine.gather_for_metrics((predictions, batch["labels"]))
        metric.add_batch(predictions=predictions, references=references)
    n = len(metric)
    result = {**metric.compute(), "n": n, "steps": step, "world_size": engine.world_size}
    engine.print(result)
    if args.metrics_out and engine.is_main_process:
        Path(args.metrics_out).write_text(json.dumps(result) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--metrics-out", default=None)
    args = p.parse_args()
    launch(training_function, (args,), backend=args.backend, num_processes=args.num_processes)


if __name__ == "__main__":
    main()
