"""Tokenisation and static-shape batching.

XLA compiles one graph per distinct input shape, so the batch plan decides how many graphs a run
compiles. `BatchPlan` is the single place that decides shapes: every batch has the same number
of rows, and its length is one of a few bucket lengths (`buckets`), the longest row of the
batch (`dynamic`, the course's `DataCollatorWithPadding` behaviour) or one fixed length
(`max_length`). Rows are grouped by length in buckets mode so little compute goes to padding.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from .errors import UserError

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")


def tokenize(ds, tokenizer, max_length):
    """Tokenises `text1` (and `text2`, for sentence pairs), truncated to `max_length`, adding a
    `length` column.

    Returns the tokenised DatasetDict and the number of truncated rows per split.
    """

    def encode(batch):
        texts = (batch["text1"], batch["text2"]) if "text2" in batch else (batch["text1"],)
        full = tokenizer(*texts)["input_ids"]
        enc = tokenizer(*texts, truncation=True, max_length=max_length)
        enc["length"] = [len(ids) for ids in enc["input_ids"]]
        enc["truncated"] = [len(ids) > max_length for ids in full]
        return enc

    import datasets

    keep = set(MODEL_INPUTS) | {"label", "length", "truncated", "row"}  # row: a prediction's input position
    quiet = sum(len(split) for split in ds.values()) < 50_000  # MRPC takes about a second: no bar
    if quiet:
        datasets.disable_progress_bars()
    try:
        out = ds.map(encode, batched=True, desc="Tokenising")
    finally:
        if quiet:
            datasets.enable_progress_bars()
    out = out.remove_columns([c for c in next(iter(out.values())).column_names if c not in keep])
    truncated = {split: int(sum(out[split]["truncated"])) for split in out}
    return out.remove_columns("truncated"), truncated


def model_inputs_only(data, model):
    """`data` without the input columns `model.forward` does not take (DistilBERT has no
    `token_type_ids`), nor `token_type_ids` for a model with one token type (RoBERTa-style)."""
    import inspect

    takes = inspect.signature(model.forward).parameters
    drop = [c for c in MODEL_INPUTS if c not in takes]
    if getattr(model.config, "type_vocab_size", 2) < 2:
        drop.append("token_type_ids")
    present = data.column_names  # a Dataset's list, or a DatasetDict's lists per split
    present = present if isinstance(present, list) else next(iter(present.values()))
    drop = [c for c in dict.fromkeys(drop) if c in present]
    return data.remove_columns(drop) if drop else data


# ---------------------------------------------------------------------------------------------
# Bucket choice


def check_fit(lengths, buckets):
    """Every (truncated) row must fit the longest bucket."""
    longest = int(np.max(lengths))
    if longest > buckets[-1]:
        raise UserError(f"rows of up to {longest} tokens do not fit the longest bucket {buckets[-1]}; "
                        "add a longer bucket or lower --max-length")


@dataclass
class CostModel:
    """What `--buckets auto` minimises: graphs x compile cost + padded tokens x per-token cost.

    compile_seconds: cost of one XLA compilation (XLA:CPU here ~10-15 s for this model's training
        graph; about 6 s a graph in Hugging Face's TPU blog post, see XLABackend; 0 on the eager
        CUDA/CPU fallback).
    token_seconds: cost of one padded token in one training step (forward + backward).
    graphs_per_bucket: graphs each bucket length costs (training step and evaluation step).
    """

    compile_seconds: float
    token_seconds: float
    graphs_per_bucket: int = 2

    def total(self, n_buckets, padded_tokens):
        return n_buckets * self.graphs_per_bucket * self.compile_seconds + padded_tokens * self.token_seconds


def choose_buckets(lengths, weights, max_length, cost, multiple=8):
    """Bucket lengths that minimise `cost` for rows of these `lengths`.

    `weights[i]` is how many training-step equivalents row i costs over the run (training rows:
    the number of times it is fed; evaluation rows: about a third of that per pass, forward
    only). Rows are batched with rows of similar length, so a row costs about the smallest
    bucket that holds it. Candidates are multiples of `multiple` up to `max_length`; an exact
    dynamic program over them picks the best set of any size. Returns (buckets, estimate dict).
    """
    lengths = np.minimum(np.asarray(lengths), max_length)
    weights = np.broadcast_to(np.asarray(weights, dtype=float), lengths.shape)
    top = int(math.ceil(lengths.max() / multiple) * multiple)
    cands = sorted({min(c, max_length) for c in range(multiple, top + multiple, multiple)})
    # load[k] = weighted rows whose length falls in (cands[k-1], cands[k]]
    slot = np.searchsorted(cands, lengths)
    load = np.bincount(slot, weights=weights, minlength=len(cands))
    # best[j] = (cost, buckets) of covering every row up to cands[j], the last bucket being cands[j]
    best = []
    for j, length in enumerate(cands):
        options = []
        for i in range(-1, j):  # the previous bucket ends at cands[i] (none when i = -1)
            prev_cost, prev = (0.0, []) if i < 0 else best[i]
            options.append((prev_cost + cost.total(1, load[i + 1 : j + 1].sum() * length), prev + [length]))
        best.append(min(options, key=lambda o: o[0]))
    total, buckets = best[-1]
    padded = np.asarray(buckets)[np.searchsorted(buckets, lengths)]
    estimate = {
        "buckets": buckets,
        "estimated_seconds": round(float(total), 1),
        "estimated_compile_seconds": round(len(buckets) * cost.graphs_per_bucket * cost.compile_seconds, 1),
        "padding_efficiency": round(float((lengths * weights).sum() / (padded * weights).sum()), 3),
    }
    return buckets, estimate


def job_rows(train_lengths, eval_lengths, steps, rows_per_step, epochs):
    """(lengths, weights) of every row a job of `steps` optimizer steps of `rows_per_step` training
    rows (batch x replicas x accumulation) feeds, evaluating after each of up to `epochs` epochs;
    a row's weight is its cost in training-row passes."""
    passes = steps * rows_per_step / len(train_lengths)  # times each training row is fed
    evals = min(epochs, math.ceil(passes))  # an evaluation after every epoch, forward only (~1/3)
    return (np.concatenate([train_lengths, eval_lengths]),
            np.concatenate([np.full(len(train_lengths), passes), np.full(len(eval_lengths), evals / 3)]))


def auto_buckets(train_lengths, eval_lengths, steps, rows_per_step, epochs, max_length, cost):
    """`--buckets auto` for such a job (see `job_rows`)."""
    return choose_buckets(*job_rows(train_lengths, eval_lengths, steps, rows_per_step, epochs), max_length, cost)


# ---------------------------------------------------------------------------------------------
# Batching


class BatchPlan(torch.utils.data.Sampler):
    """Yields, for this replica, lists of `(row, pad_to, valid)` keys: one list per step.

    Every global batch holds `batch_size * num_replicas` rows padded to one length; replica r
    takes rows [r*batch_size, (r+1)*batch_size), so all replicas run the same shape at each step.
    The last short global batch is filled: for training with repeats of other rows (like
    `DistributedSampler`), for evaluation with masked rows (`valid=0`) that metrics drop, so
    every evaluation row is scored exactly once.

    padding: "buckets" (smallest bucket >= the batch's longest row), "max_length" (always
    `max_length`) or "dynamic" (the batch's longest row, one shape per distinct length).
    """

    def __init__(self, lengths, batch_size, padding="buckets", buckets=None, max_length=128,
                 shuffle=False, seed=0, fill="repeat", num_replicas=1, rank=0):
        self.lengths = np.asarray(lengths)
        self.batch_size, self.padding, self.max_length = batch_size, padding, max_length
        self.buckets = sorted(buckets) if buckets else [max_length]
        if padding == "buckets":
            check_fit(self.lengths, self.buckets)
        self.shuffle, self.seed, self.fill = shuffle, seed, fill
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch, self.start = 0, 0

    def shard(self, num_replicas, rank):
        self.num_replicas, self.rank = num_replicas, rank

    def set_epoch(self, epoch, start=0):
        """Plans epoch `epoch` (its own shuffle) and skips its first `start` batches (resuming)."""
        self.epoch, self.start = epoch, start

    def _pad_to(self, rows):
        longest = int(self.lengths[rows].max())
        if self.padding == "dynamic":
            return longest
        if self.padding == "max_length":
            return self.max_length
        return next(b for b in self.buckets if b >= longest)

    def global_batches(self):
        """The whole epoch's plan: a list of (rows, pad_to, n_real) with len(rows) = global batch."""
        gb = self.batch_size * self.num_replicas
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.lengths)) if self.shuffle else np.arange(len(self.lengths))
        if self.padding == "buckets":
            # Stable sort by bucket: rows stay shuffled within a bucket, batches then hold one bucket.
            bucket_of = np.searchsorted(self.buckets, self.lengths[order])
            order = order[np.argsort(bucket_of, kind="stable")]
        batches = [order[i : i + gb] for i in range(0, len(order), gb)]
        if self.padding == "buckets" and self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        plan = []
        for rows in batches:
            n_real = len(rows)
            if n_real < gb and self.fill == "repeat":
                rows = np.concatenate([rows, order[: gb - n_real]])
            elif n_real < gb:
                rows = np.concatenate([rows, np.full(gb - n_real, rows[0])])
            plan.append((rows, self._pad_to(rows[:n_real] if self.fill != "repeat" else rows), n_real))
        return plan

    def __iter__(self):
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for rows, pad_to, n_real in self.global_batches()[self.start :]:
            yield [(int(r), pad_to, int(lo + j < n_real or self.fill == "repeat"))
                   for j, r in enumerate(rows[lo:hi])]

    def __len__(self):
        return math.ceil(len(self.lengths) / (self.batch_size * self.num_replicas))

    def padding_by_length(self):
        """Per padded length, over one epoch of this plan: {length: {"batches", "real_tokens",
        "padded_tokens", "efficiency"}} (filler rows count as padding)."""
        out = {}
        for rows, pad_to, n_real in self.global_batches():
            b = out.setdefault(int(pad_to), {"batches": 0, "real_tokens": 0, "padded_tokens": 0})
            b["batches"] += 1
            b["real_tokens"] += int(self.lengths[rows[:n_real]].sum())
            b["padded_tokens"] += len(rows) * int(pad_to)
        for b in out.values():
            b["efficiency"] = round(b["real_tokens"] / b["padded_tokens"], 4)
        return dict(sorted(out.items()))

    def padding_efficiency(self):
        """Real tokens / padded tokens over one epoch of this plan (filler rows count as padding)."""
        per_length = self.padding_by_length().values()
        return sum(b["real_tokens"] for b in per_length) / sum(b["padded_tokens"] for b in per_length)


class PlannedRows(torch.utils.data.Dataset):
    """Looks up `(row, pad_to, valid)` keys from a `BatchPlan` in a tokenised dataset."""

    def __init__(self, ds):
        self.ds = ds.with_format(None)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, key):
        row, pad_to, valid = key
        record = self.ds[row]
        return {k: record[k] for k in (*MODEL_INPUTS, "label", "labels", "row") if k in record}, pad_to, valid


class PadCollator:
    """Pads a planned batch to its planned length with the tokenizer's own `pad`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, items):
        features, pads, valid = zip(*items)
        batch = self.tokenizer.pad(list(features), padding="max_length", max_length=pads[0], return_tensors="pt")
        if "label" in batch:
            batch["labels"] = batch.pop("label")
        batch["valid"] = torch.tensor(valid, dtype=torch.long)
        return dict(batch)


def make_loader(ds, tokenizer, batch_size, padding, buckets, max_length, shuffle, seed, fill, lengths=None):
    """A DataLoader over a tokenised split whose batches follow a `BatchPlan`."""
    plan = BatchPlan(ds["length"] if lengths is None else lengths, batch_size, padding=padding, buckets=buckets, max_length=max_length,
                     shuffle=shuffle, seed=seed, fill=fill)
    # Its own generator: a DataLoader draws a seed for every iterator it starts, and drawing it
    # from the global generator would shift dropout masks (a resumed run starts one mid-epoch).
    return torch.utils.data.DataLoader(PlannedRows(ds), batch_sampler=plan, collate_fn=PadCollator(tokenizer),
                                       generator=torch.Generator().manual_seed(seed))
