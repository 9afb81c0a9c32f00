"""The one inference loop, for evaluation and prediction alike: every row of a prepared loader
exactly once across replicas, gathered on the device per batch and copied to the host once."""

import torch
from tqdm.auto import tqdm

from .batching import make_loader


def infer(engine, model, loader, columns, desc=None, forward=None, prepare=None):
    """`columns(batch, output)` gives a batch's 1-D tensors of one dtype; they are gathered on the
    device per batch and copied to the host once, at the end (a per-batch copy would make the host
    wait for every batch). `forward(model, inputs)` runs the model (default: `model(**inputs)`);
    `prepare(model, batch)` makes the batch it runs on of the loaded one (default: as loaded).
    Returns the host columns, filler rows dropped."""
    model.eval()
    parts = []
    bar = tqdm(total=len(loader), desc=desc, disable=not (desc and engine.is_main_process), dynamic_ncols=True,
               leave=False)
    with engine.inference_mode(), bar:
        for batch in loader:
            batch = prepare(model, batch) if prepare else batch
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "row")}
            with engine.autocast():
                output = forward(model, inputs) if forward else model(**inputs)
            parts.append(engine.gather_on_device(columns(batch, output)))
            bar.update(1)
    return engine.rows_to_host(parts)


def predict_rows(engine, model, loader, columns, desc="Predicting", forward=None):
    """`columns(output)`'s float rows for every row the loader holds, across replicas, in input
    order, as one (rows, columns) host tensor. The loader's dataset has a `row` column (the input
    position); filler rows are dropped. `forward`: as `infer`'s."""

    def with_position(batch, output):
        # floats only: the row numbers are exact in float32 below 2**24, and 64-bit integer
        # collectives may not lower on every device
        return (batch["row"].float(), *columns(output))

    table = torch.stack(infer(engine, model, loader, with_position, desc, forward), 1)
    order = table[:, 0].round().long().argsort()
    return table[order, 1:]


def predict_loader(engine, tokenizer, data, batch_size, padding):
    """A prepared loader over tokenised rows (with their `row` numbers) padded by `padding`, in order."""
    loader = make_loader(data, tokenizer, batch_size, padding, shuffle=False, seed=0, fill="mask")
    return engine.prepare(loader)
