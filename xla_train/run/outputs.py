"""What a run leaves when its loop ends: the final (or best) model and tokenizer, --test-file's
predictions, the run folder's record and the metrics JSON."""

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..io.files import atomic_write
from ..models import add_adapters, record_quantization, save_merged
from ..tasks import scores
from .folder import write_finished


def finish(engine, job, t, monitor):
    """After the loop: the final (or best) model, its predictions for --test-file, the metrics
    JSON and the run folder's files. `t` is the worker's train.Trainer (its model, run state,
    shapes, loaders and memory plan)."""
    cfg, state = job.cfg, t.state
    timing = monitor.clock.summary(state.step, t.shapes.rows_per_step, state.first_step)  # before the graphs below
    results = state.restore_best(t.model)  # --save-best: the best evaluation's weights
    predictions = save_outputs(engine, job, t, results) if state.store else None
    metrics = {**run_metrics(engine, job, t, monitor, timing, results), "predictions": predictions}
    if engine.is_main_process:
        tokens = metrics["tokens"]
        engine.print(f"dev {scores(results)}  (training {metrics['train_samples_per_s']:.1f} samples/s, "
                     f"{tokens['per_s']:.0f} tokens/s" + (f", MFU {tokens['mfu']:.1%}" if tokens["mfu"] else "") + ")")
        compiled = metrics.get("torch_compile")
        if compiled:  # --compile: what compiling cost, and what the cache (--compile-cache) saved
            engine.print(f"torch.compile: {compiled['compiles']} graphs, {compiled['compile_seconds']:.1f} s "
                         f"compiling; {compiled.get('cache_hits', 0)} of them from the cache"
                         + (f" ({cfg.compile_cache})" if cfg.compile_cache else ""))
        if cfg.metrics_out:
            atomic_write(cfg.metrics_out, json.dumps(metrics, indent=2) + "\n")  # makes missing folders
    monitor.close(metrics)
    goodput = metrics["goodput"]
    seconds, startup = goodput["seconds"], " + ".join(f"{k} {v:.1f}" for k, v in goodput["startup"].items())
    phases = ", ".join(f"{k} {v:.1f}" + (f" = {startup}" if k == "startup" else "")
                       for k, v in seconds.items() if k not in ("train_steps", "wall"))
    engine.print(f"goodput {goodput['ratio']:.2f}: training steps {seconds['train_steps']:.1f} s of "
                 f"{seconds['wall']:.1f} s ({phases})")
    return metrics


def save_outputs(engine, job, t, results):
    """The model and tokenizer, the task's description, --test-file's predictions and the run's
    record, into the output folder (published to gs:// from there). Returns the predictions' URL."""
    cfg, task, state = job.cfg, job.task, t.state
    folder = state.store.local_folder()
    if cfg.merge_lora:  # merged on the CPU, into the base model loaded again
        def load_base():
            return add_adapters(task.model.load(cfg.model, cfg.seed, job.tokenizer.pad_token_id), cfg.section("model"),
                                task.model.peft_task_type)

        save_merged(engine, t.model, load_base, job.tokenizer, folder)
    else:
        engine.save_pretrained(t.model, job.tokenizer, folder)
        if quant := cfg.quantization():  # predict quantizes the base again from the record (models.load_base)
            engine.on_main(lambda: record_quantization(folder, quant), f"cannot write {folder / 'config.json'}")
    predictions = result = None
    if job.test is not None:  # the final (or best) model's predictions, as xla-train predict writes them
        start = time.perf_counter()
        result = task.prediction.predict(engine, t.model, job.test, cfg.batch_size)
        seconds = time.perf_counter() - start
        predictions = f"{state.store.url.rstrip('/')}/{task.prediction.output_name(cfg.test_file)}"

    def write_files():
        task.write_record(folder)
        if result is not None:
            assert predictions is not None  # set with result, above
            task.prediction.write(folder / Path(predictions).name, job.test, result, seconds)
        write_finished(folder, job.run_id, cfg, state.step, results, state.best, state.stopped_early)
        state.store.publish()

    engine.on_main(write_files, f"cannot write the run's files to {state.store.url}")
    return predictions


def run_metrics(engine, job, t, monitor, timing, results):
    """The metrics JSON of the run (DESIGN.md's contract and more)."""
    cfg, task, state = job.cfg, job.task, t.state
    sums = replica_checksums(engine, t.model)
    plan = t.train_dl.loader.batch_sampler
    return {
        "backend": engine.runtime, "device": engine.describe_device(),
        "world_size": engine.data_parallel_size, "model": cfg.model, "task": task.name, "problem": task.problem,
        "labels": task.labels, "num_labels": task.num_labels, "main_metric": task.main, "steps": state.step,
        "epochs": round(state.step / t.steps_per_epoch, 4),
        "train_samples": state.step * t.shapes.rows_per_step, **timing,
        "padding_efficiency": round(plan.padding_efficiency(), 4),
        "tokens": token_throughput(engine, job, t, timing),
        "padding_by_bucket": plan.padding_by_length(),
        "eval": results,  # of the saved model: the last evaluation, or the best with --save-best
        "best": state.best, "evaluations": state.evaluations, "stopped_early": state.stopped_early,
        "train_loss": [h[:3] for h in state.history],  # [step, mean loss since the last entry, learning rate]
        "train_metrics": state.train_metrics,  # the kind's own: [step, {name: mean since the last entry}]
        "param_checksum": float(sums[0].double().sum()),
        "replicas_identical": bool((sums == sums[0]).all()),
        "buckets": t.shapes.padding.bucket_list,
        "padding": cfg.padding, "precision": cfg.precision,
        "resumed_from": job.resume.url if job.resume else None,
        "first_step": state.first_step, "checkpoint": state.saved, "config": asdict(cfg), **job.report(),
        "memory": {**t.memory.metrics(), "peak_bytes": engine.peak_memory()}, **t.memory.counts(),
        "goodput": monitor.clock.goodput(),  # last: the wall time up to the metrics
    }


def token_throughput(engine, job, t, timing):
    """The tokens this run trained on, counted on the host from the batch plan: every padded token
    (`padded`), those of the rows (`real`) and those in the loss (`trained`, where the task's rows
    say: causal-lm); per second of training steps; the padding share; and the model FLOPs
    utilisation where the device's peak is known (core.peaks), else None."""
    from ..core.peaks import flops_per_token, peak_flops

    plan, state, accum = t.train_dl.loader.batch_sampler, t.state, job.cfg.grad_accum
    data = job.data["train"]
    trained = data["trained"] if "trained" in data.column_names else None
    padded, real, in_loss = token_counts(plan, trained, state.first_step * accum, state.step * accum,
                                         t.steps_per_epoch * accum)
    seconds = timing["train_seconds"] or float("nan")
    peak = peak_flops(engine.accelerator.device_kind(), job.cfg.precision)
    model = engine.unwrap_model(t.model)
    length = padded / max(1, (state.step - state.first_step) * t.shapes.rows_per_step)  # the mean row length
    mfu = (flops_per_token(model.config, t.memory.params, length) * real / seconds /
           (peak * math.prod(size for _, size in engine.strategy.mesh_shape()))) if peak and real else None
    return {"padded": padded, "real": real, "trained": in_loss, "per_s": round(padded / seconds, 3),
            "trained_per_s": round(in_loss / seconds, 3) if in_loss is not None else None,
            "padding_share": round(1 - real / padded, 4) if padded else None,
            "mfu": round(mfu, 4) if mfu is not None else None, "peak_flops": peak}


def token_counts(plan, trained, first, last, per_epoch):
    """(padded, real, trained) tokens of the run's global micro-batches [first, last), each epoch
    `per_epoch` of them, as the batch plan made them; trained is None without `trained` counts."""
    import numpy as np

    weights = np.asarray(trained) if trained is not None else None
    padded = real = in_loss = 0
    for epoch in range(first // per_epoch, -(-last // per_epoch)):
        lo, hi = max(first - epoch * per_epoch, 0), min(last - epoch * per_epoch, per_epoch)
        for rows, pad_to, _ in plan.global_batches(epoch)[lo:hi]:  # filler rows are trained on too
            padded += len(rows) * int(pad_to)
            real += int(plan.lengths[rows].sum())
            in_loss += int(weights[rows].sum()) if weights is not None else 0
    return padded, real, in_loss if weights is not None else None


def replica_checksums(engine, model):
    """Per-parameter sums from every replica (rows), to show that replicas hold the same model."""
    params = list(engine.unwrap_model(model).parameters())
    sums = torch.stack([engine.strategy.whole(p.detach().float().sum()) for p in params])  # FSDP: of every shard
    (host,) = engine.to_host([engine.strategy.gather(sums[None])])
    return host
