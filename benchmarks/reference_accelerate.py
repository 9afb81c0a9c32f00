"""The reference: the Hugging Face course's full training loop, made distributed with Accelerate.

AdamW, linear schedule, batch 8, `accelerator.prepare` / `accelerator.backward`, accuracy and F1
with evaluate's glue/mrpc definitions. The data comes from the bundled MRPC copy and the model
from the bundled MiniLM (no hub here); everything else is the course's code path.

    python benchmarks/reference_accelerate.py --padding dynamic --metrics-out ref.json
    USE_TORCH_XLA=0 python benchmarks/reference_accelerate.py ...   # plain CPU, not XLA:CPU
"""

import argparse
import json
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_scheduler,
)

from xla_train.models import bundled_model_path
from xla_train.tasks import load_metric, load_mrpc


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--padding", choices=["dynamic", "max_length"], default="dynamic")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    p.add_argument("--metrics-out", required=True)
    args = p.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    torch.manual_seed(args.seed)
    checkpoint = bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    raw = load_mrpc()
    pad = {"padding": "max_length", "max_length": 128} if args.padding == "max_length" else {}

    def tokenize_function(example):
        return tokenizer(example["sentence1"], example["sentence2"], truncation=True, **pad)

    tokenized = raw.map(tokenize_function, batched=True)
    tokenized = tokenized.remove_columns(["sentence1", "sentence2", "idx"]).rename_column("label", "labels")
    tokenized.set_format("torch")
    collator = DataCollatorWithPadding(tokenizer=tokenizer)
    train_dl = DataLoader(tokenized["train"], shuffle=True, batch_size=8, collate_fn=collator)
    eval_dl = DataLoader(tokenized["validation"], batch_size=8, collate_fn=collator)

    model = AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_dl, eval_dl, model, optimizer = accelerator.prepare(train_dl, eval_dl, model, optimizer)
    steps = args.epochs * len(train_dl)
    if args.max_steps:
        steps = min(steps, args.max_steps)
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=steps)

    bar = tqdm(range(steps), disable=not accelerator.is_main_process)
    model.train()
    t0, done, first_step_at = time.perf_counter(), 0, None
    for _epoch in range(args.epochs):
        for batch in train_dl:
            first_step_at = first_step_at or time.time()  # start-up ends here (bench_startup.py)
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            bar.update(1)
            done += 1
            if done == steps:
                break
        if done == steps:
            break
    accelerator.wait_for_everyone()
    if accelerator.device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
    elif accelerator.device.type == "cuda":
        torch.cuda.synchronize()  # the queued steps belong to the training time
    train_seconds = time.perf_counter() - t0

    metric = load_metric()  # evaluate.load("glue", "mrpc"), from the copy inside the package (no hub)
    model.eval()
    for batch in eval_dl:
        with torch.no_grad():
            outputs = model(**batch)
        predictions = torch.argmax(outputs.logits, dim=-1)
        predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        metric.add_batch(predictions=predictions, references=references)
    n = len(metric)
    result = {**metric.compute(), "n": n}

    lengths = [len(x) for x in tokenized["train"]["input_ids"]]
    out = {"backend": accelerator.device.type, "device": str(accelerator.device), "steps": done,
           "train_samples": done * 8, "train_seconds": round(train_seconds, 3),
           "train_samples_per_s": round(done * 8 / train_seconds, 3), "eval": result,
           "padding": args.padding, "mixed_precision": args.mixed_precision, "xla": None,
           "first_step_at": first_step_at}
    if accelerator.device.type == "xla":
        import torch_xla.debug.metrics as met

        compiles = met.metric_data("CompileTime")
        transfers = met.metric_data("TransferFromDeviceTime")
        out["xla"] = {"compiles": compiles[0] if compiles else 0,
                      "compile_seconds": round(compiles[1] / 1e9, 3) if compiles else 0.0,
                      "host_syncs_per_step": round((transfers[0] if transfers else 0) / max(done, 1), 4),
                      "aten_fallbacks": sum(met.counter_value(c) for c in met.counter_names()
                                            if c.startswith("aten::"))}
    if args.padding == "max_length":
        real = sum(int(x.sum()) for x in tokenized["train"]["attention_mask"])
        out["padding_efficiency"] = round(real / (len(lengths) * 128), 4)
    if accelerator.is_main_process:
        Path(args.metrics_out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
