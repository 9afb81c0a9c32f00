"""A job's shapes: what lengths a batch may have, how many rows a step takes, how many steps an
epoch runs. Computed once; batching, the cost model, the monitor, the report and the test file's
predictions ask it. The only reader of `--padding`.
"""

import math
from dataclasses import dataclass

import numpy as np

from .errors import UserError


def lengths(rows):
    """The `length` column of tokenised rows (a datasets.Dataset, or a dict of lists) as a list:
    iterating datasets' own Column formats one row at a time (70 ms for MRPC's 4,000 rows), its
    slice reads the column at once."""
    return rows["length"][:]


class Padding:
    """How a batch's length is chosen: "buckets" (the smallest bucket that holds its longest row),
    "max_length" (always `max_length`) or "dynamic" (its longest row: the course's per-batch
    padding, one shape per distinct length)."""

    def __init__(self, mode="buckets", buckets=None, max_length=128):
        self.mode, self.max_length = mode, max_length
        self.buckets = sorted(buckets) if mode == "buckets" and buckets else [max_length]

    def pad_to(self, longest):
        """The length a batch whose longest row has `longest` tokens is padded to."""
        if self.mode == "dynamic":
            return longest
        if self.mode == "max_length":
            return self.max_length
        return next(b for b in self.buckets if b >= longest)

    @property
    def groups_by_length(self):
        """Rows are batched with rows of the same bucket (little compute goes to padding)."""
        return self.mode == "buckets"

    @property
    def lengths(self):
        """Every length a batch may have, or None where they are not bounded (dynamic)."""
        return None if self.mode == "dynamic" else list(self.buckets)

    @property
    def bucket_list(self):
        """The bucket lengths of bucketed padding (recorded in metrics and checkpoints), else None."""
        return list(self.buckets) if self.mode == "buckets" else None

    @property
    def recompiles_per_length(self):
        """Whether new batch lengths keep coming (and compiling) during a run."""
        return self.mode == "dynamic"

    def check_fit(self, lengths):
        """Every (truncated) row fits the longest length a batch may have."""
        longest = int(max(lengths)) if len(lengths) else 0
        if self.mode == "buckets" and longest > self.buckets[-1]:
            raise UserError(f"rows of up to {longest} tokens do not fit the longest bucket {self.buckets[-1]}; "
                            "add a longer bucket or lower `max_length`")


@dataclass
class Shapes:
    """A job's shapes: its padding, and the rows one micro-batch and one optimizer step take."""

    batch_size: int  # rows per device and micro-batch
    devices: int  # devices training in data parallel (replicas on every host, SPMD's devices)
    grad_accum: int = 1  # micro-batches per optimizer step
    padding: Padding | None = None  # set once the rows' lengths are known (the task's `padding`, `settle_padding`)
    estimate: dict | None = None  # what --buckets auto expected of its choice (None: buckets given)
    repeats: int = 1  # optimizer steps each step's micro-batches are trained on in a row (GRPO: tasks.grpo.Iterations)

    @property
    def global_batch(self):
        """Rows of one micro-batch over every device."""
        return self.batch_size * self.devices

    @property
    def rows_per_step(self):
        return self.global_batch * self.grad_accum

    def batches_per_epoch(self, rows):
        return math.ceil(rows / self.global_batch)  # the last one filled with repeats

    def steps_per_epoch(self, rows):
        """Optimizer steps an epoch of `rows` runs: an epoch's last micro-batches that cannot fill
        a step are skipped; each step's micro-batches are run `repeats` times in a row."""
        return self.batches_per_epoch(rows) // self.grad_accum * self.repeats

    def total_steps(self, rows, epochs, max_steps=None):
        return min(max_steps or 10**9, self.steps_per_epoch(rows) * epochs)

    def describe(self, rows, epochs):
        """The plan in a few words (the `--buckets auto` line)."""
        per_epoch = self.steps_per_epoch(rows)
        return (f"global batch {self.rows_per_step} = {self.batch_size} x {self.devices} device(s) x "
                f"{self.grad_accum} accumulated: {per_epoch} steps per epoch"
                f"{f' (each batch trained on {self.repeats} times)' if self.repeats > 1 else ''}, "
                f"{per_epoch * epochs} for {epochs} epochs")


def check_steps(shapes, rows):
    """An epoch of `rows` holds at least one optimizer step."""
    batches = shapes.batches_per_epoch(rows)
    if batches < shapes.grad_accum:
        raise UserError(f"{rows} training rows make {batches} batch(es) of {shapes.batch_size} x {shapes.devices} "
                        f"device(s), fewer than one optimizer step takes (`grad_accum` {shapes.grad_accum}): give "
                        "more rows, or a smaller `batch_size` or `grad_accum`")


def padding_for(mode, buckets, max_length, lengths, choose=None):
    """The one bucket rule: `buckets` (--buckets: a spec, or the lengths themselves), where it says
    "auto" `choose()`'s lengths, as the padding of `mode`; every row of each of `lengths` (one list
    per split) must fit it."""
    buckets = parse_buckets(buckets, max_length) if isinstance(buckets, str) else buckets
    if mode == "buckets" and buckets == "auto":
        buckets = choose()
    padding = Padding(mode, buckets, max_length)
    for split in lengths:
        padding.check_fit(split)
    return padding


def even_buckets(lengths, step=32):
    """Buckets every `step` tokens up to the longest row (a loop's own DataLoader on XLA, rebuilt
    by `Engine.prepare`: the Engine knows nothing of its job to weigh compilations against padding)."""
    top = -(-max(lengths) // step) * step
    return padding_for("buckets", list(range(step, top + 1, step)), top, [lengths])


@dataclass(frozen=True)
class PaddingRequest:
    """What a job asks of its batches' padding: the mode, the bucket lengths ("auto": chosen for
    the job), the longest row, and the job's length in epochs or steps and its compilation cost
    (None: the accelerator's estimate), which `auto` weighs."""

    mode: str = "buckets"  # buckets, max_length or dynamic (Padding.mode)
    buckets: object = "auto"  # "auto", or bucket lengths ("32,64" or a list)
    max_length: int = 128
    epochs: int = 3
    max_steps: int | None = None
    compile_seconds: float | None = None


def settle_padding(request, shapes, data, eval_splits, accelerator, resumed_buckets=None):
    """The padding of the batches: the bucket lengths asked for, a resumed run's
    (`resumed_buckets`: the data order depends on them), or `auto`'s choice for this job. Every
    row must fit them."""
    given = resumed_buckets or request.buckets
    return padding_for(request.mode, given, request.max_length, [lengths(split) for split in data.values()],
                       lambda: _auto_buckets(request, shapes, data, eval_splits, accelerator))


def _auto_buckets(request, shapes, data, eval_splits, accelerator):
    """`auto` buckets for the job the run will really be: every device training in data parallel
    (replicas on every host, SPMD's devices), counted before launch."""
    rows = len(data["train"])
    steps = shapes.total_steps(rows, request.epochs, request.max_steps)
    compile_s = accelerator.compile_seconds if request.compile_seconds is None else request.compile_seconds
    cost = CostModel(compile_seconds=compile_s, token_seconds=accelerator.token_seconds)
    eval_lengths = [n for split in [*eval_splits, "test"] if split in data for n in lengths(data[split])]
    buckets, estimate = auto_buckets(lengths(data["train"]), eval_lengths, steps, shapes.rows_per_step, request.epochs,
                                     request.max_length, cost)
    estimate.update(steps=steps, devices=shapes.devices, rows_per_step=shapes.rows_per_step,
                    steps_per_epoch=shapes.steps_per_epoch(rows))
    shapes.estimate = estimate
    print(f"buckets auto: {buckets} for {steps} steps ({shapes.describe(rows, request.epochs)}; compile {compile_s:g} "
          f"s/graph, {cost.token_seconds:g} s/token): estimated {estimate['estimated_seconds']} s, padding "
          f"efficiency {estimate['padding_efficiency']}")
    return buckets


# ---------------------------------------------------------------------------------------------
# Bucket choice


@dataclass
class CostModel:
    """What `--buckets auto` minimises: graphs x compile cost + padded tokens x per-token cost.

    compile_seconds: cost of one XLA compilation (XLA:CPU here ~10-15 s for this model's training
        graph; about 6 s a graph in Hugging Face's TPU blog post, see XlaAccelerator; 0 on the eager
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
    best: list[tuple[float, list[int]]] = []
    for j, length in enumerate(cands):
        choices = []
        for i in range(-1, j):  # the previous bucket ends at cands[i] (none when i = -1)
            prev_cost, prev = (0.0, []) if i < 0 else best[i]
            choices.append((prev_cost + cost.total(1, load[i + 1 : j + 1].sum() * length), prev + [length]))
        best.append(min(choices, key=lambda o: o[0]))
    total, buckets = best[-1]
    padded = np.asarray(buckets)[np.searchsorted(buckets, lengths)]
    estimate = {
        "buckets": buckets,
        "estimated_seconds": round(float(total), 1),
        "estimated_compile_seconds": round(len(buckets) * cost.graphs_per_bucket * cost.compile_seconds, 1),
        "padding_efficiency": round(float((lengths * weights).sum() / (padded * weights).sum()), 3),
    }
    return buckets, estimate


def job_rows(train_lengths, eval_lengths, steps, rows_per_step, epochs) -> tuple[np.ndarray, np.ndarray]:
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


def forward_padding(lengths, accelerator, buckets, max_length, graphs=1):
    """The padding of one forward pass over rows of these `lengths` (prediction, generation): the
    given bucket lengths, or `--buckets auto`'s for a forward pass (about a third of a training
    step's cost; `graphs` per bucket: generation compiles two, the prompt's pass and the one-token
    step), priced by `accelerator`'s compile and token costs."""
    def choose():
        cost = CostModel(compile_seconds=accelerator.compile_seconds, token_seconds=accelerator.token_seconds,
                         graphs_per_bucket=graphs)
        return choose_buckets(lengths, 1 / 3, max_length, cost)[0]

    return padding_for("buckets", buckets, max_length, [lengths], choose)


def parse_buckets(spec, max_length):
    """`auto` or a comma-separated list of increasing lengths no longer than `max_length`."""
    if spec == "auto":
        return "auto"
    try:
        buckets = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"`buckets` must be 'auto' or lengths like 32,64,96,128, not {spec!r}") from None
    if not buckets or buckets[0] < 1:
        raise UserError(f"`buckets` must list positive lengths, not {spec!r}")
    if buckets[-1] > max_length:
        raise UserError(f"bucket {buckets[-1]} is longer than `max_length` {max_length}")
    return buckets
