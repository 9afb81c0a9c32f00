"""Static-shape batching (a task tokenises its rows: tasks/).

XLA compiles one graph per distinct input shape, so the batch plan decides how many graphs a run
compiles. `BatchPlan` is the single place that decides shapes: every batch has the same number
of rows, and its length is one of a few bucket lengths (`buckets`), the longest row of the
batch (`dynamic`, the course's `DataCollatorWithPadding` behaviour) or one fixed length
(`max_length`). Rows are grouped by length in buckets mode so little compute goes to padding.
"""

import math

import numpy as np
import torch

from .shapes import Padding
from .shapes import lengths as column_lengths

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")


def model_inputs_only(data, model):
    """`data` without the input columns `model.forward` does not take (DistilBERT has no
    `token_type_ids`), nor `token_type_ids` for a model with one token type (RoBERTa-style)."""
    import inspect

    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's forward takes **kwargs
    takes = inspect.signature(model.forward).parameters
    drop = [c for c in MODEL_INPUTS if c not in takes]
    if getattr(model.config, "type_vocab_size", 2) < 2:
        drop.append("token_type_ids")
    present = data.column_names  # a Dataset's list, or a DatasetDict's lists per split
    present = present if isinstance(present, list) else next(iter(present.values()))
    drop = [c for c in dict.fromkeys(drop) if c in present]
    return data.remove_columns(drop) if drop else data


# ---------------------------------------------------------------------------------------------
# Batching


class BatchPlan(torch.utils.data.Sampler):
    """Yields, for this replica, lists of `(row, pad_to, valid)` keys: one list per step.

    Every global batch holds `batch_size * num_replicas` rows padded to one length; replica r
    takes rows [r*batch_size, (r+1)*batch_size), so all replicas run the same shape at each step.
    (Under SPMD a "replica" is a host's one process, and `batch_size` the rows of all its devices.)
    The last short global batch is filled: for training with repeats of other rows (like
    `DistributedSampler`), for evaluation with masked rows (`valid=0`) that metrics drop, so
    every evaluation row is scored exactly once.

    padding: a `shapes.Padding`, or its mode ("buckets", "max_length", "dynamic") with `buckets`
    and `max_length`: the length each batch is padded to. `repeats`: each run of `grad_accum`
    batches (an optimizer step's) comes `repeats` times in a row, and a last run that cannot fill a
    step is left out (GRPO's --num-iterations: K updates on one rollout, tasks.grpo.Iterations).
    """

    def __init__(self, lengths, batch_size, padding="buckets", buckets=None, max_length=128,
                 shuffle=False, seed=0, fill="repeat", num_replicas=1, rank=0, repeats=1, grad_accum=1):
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        self.pad = padding if isinstance(padding, Padding) else Padding(padding, buckets, max_length)
        self.buckets = self.pad.buckets
        self.pad.check_fit(self.lengths)
        self.shuffle, self.seed, self.fill = shuffle, seed, fill
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch, self.start = 0, 0
        self.repeats, self.grad_accum = repeats, grad_accum

    def shard(self, num_replicas, rank):
        self.num_replicas, self.rank = num_replicas, rank

    def set_epoch(self, epoch, start=0):
        """Plans epoch `epoch` (its own shuffle) and skips its first `start` batches (resuming)."""
        self.epoch, self.start = epoch, start

    def _pad_to(self, rows):
        return self.pad.pad_to(int(self.lengths[rows].max()))

    def global_batches(self, epoch=None):
        """The whole epoch's plan (this epoch's, or `epoch`'s): a list of (rows, pad_to, n_real)
        with len(rows) = global batch."""
        gb = self.batch_size * self.num_replicas
        rng = np.random.default_rng([self.seed, self.epoch if epoch is None else epoch])
        order = rng.permutation(len(self.lengths)) if self.shuffle else np.arange(len(self.lengths))
        if self.pad.groups_by_length:
            # Stable sort by bucket: rows stay shuffled within a bucket, batches then hold one bucket.
            bucket_of = np.searchsorted(self.buckets, self.lengths[order])
            order = order[np.argsort(bucket_of, kind="stable")]
        batches = [order[i : i + gb] for i in range(0, len(order), gb)]
        if self.pad.groups_by_length and self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        plan = []
        for rows in batches:
            n_real = len(rows)
            if n_real < gb and self.fill == "repeat":
                rows = np.concatenate([rows, order[: gb - n_real]])
            elif n_real < gb:
                rows = np.concatenate([rows, np.full(gb - n_real, rows[0])])
            plan.append((rows, self._pad_to(rows[:n_real] if self.fill != "repeat" else rows), n_real))
        if self.repeats > 1:
            n = self.grad_accum
            plan = [b for i in range(0, len(plan) - n + 1, n) for _ in range(self.repeats) for b in plan[i : i + n]]
        return plan

    def __iter__(self):
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for rows, pad_to, n_real in self.global_batches()[self.start :]:
            yield [(int(r), pad_to, int(lo + j < n_real or self.fill == "repeat"))
                   for j, r in enumerate(rows[lo:hi])]

    def __len__(self):
        n = math.ceil(len(self.lengths) / (self.batch_size * self.num_replicas))
        return n if self.repeats == 1 else n // self.grad_accum * self.grad_accum * self.repeats

    def padding_by_length(self):
        """Per padded length, over one epoch of this plan: {length: {"batches", "real_tokens",
        "padded_tokens", "efficiency"}} (filler rows count as padding)."""
        out: dict[int, dict[str, float]] = {}
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
        return {k: v for k, v in record.items() if k not in ("length", "trained")}, pad_to, valid


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


def make_loader(ds, tokenizer, batch_size, padding, shuffle, seed, fill, lengths=None, collate=None, repeats=1,
                grad_accum=1):
    """A DataLoader over a tokenised split whose batches follow a `BatchPlan` padded by `padding`
    (a `shapes.Padding`), padded by `collate` (default: the tokenizer's own `pad`); `repeats` and
    `grad_accum` as BatchPlan's."""
    plan = BatchPlan(column_lengths(ds) if lengths is None else lengths, batch_size, padding=padding, shuffle=shuffle,
                     seed=seed, fill=fill, repeats=repeats, grad_accum=grad_accum)
    # Its own generator: a DataLoader draws a seed for every iterator it starts, and drawing it
    # from the global generator would shift dropout masks (a resumed run starts one mid-epoch).
    return torch.utils.data.DataLoader(PlannedRows(ds), batch_sampler=plan,
                                       collate_fn=collate or PadCollator(tokenizer),
                                       generator=torch.Generator().manual_seed(seed))
