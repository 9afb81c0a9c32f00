"""Where the training time goes: wall time of the training phases and XLA's compilation counters."""

import time
from contextlib import contextmanager

# torch.compile's cache counters (gpu_fallback's compile_stats): dynamo graphs whose compiled forward
# and backward came from the cache or not, and inductor's graphs (forward, backward, inference) alike
TORCH_COMPILE_CACHE = ("cache_hits", "cache_misses", "inductor_cache_hits", "inductor_cache_misses")


class Startup:
    """Start-up's parts, timed in the launching process as laps from the process's start:
    `imports` (the package and its libraries, until the job begins), `data` (reading, tokenising,
    the shapes), `model` (config, tokenizer, weights). What follows, up to the first training
    step, is `device`: the workers' start (spawned ones import again), process groups, the model
    on the device, loaders, optimizer (`split`). The parts add up to goodput's `startup`."""

    PARTS = ("imports", "data", "model", "device")

    def __init__(self, started=None):
        self.started = self.last = started or time.time()
        self.seconds = dict.fromkeys(self.PARTS[:-1], 0.0)

    def lap(self, part):
        """The time since the previous lap (or the start) was `part`'s."""
        now = time.time()
        self.seconds[part] += now - self.last
        self.last = now

    def split(self, first_step):
        """Seconds by part, `first_step` (time.time()) ending the device's set-up."""
        return {**self.seconds, "device": max(first_step - self.last, 0.0)}


class RunClock:
    """Training-phase wall time and compilation counters, excluding evaluation.

    The one reader of `Engine.compile_stats()` (process-wide counters, so everything counts from
    this object's creation) and the one place that diffs them; the monitor owns it.
    Timings wait for the device at the end of each training phase, so they include every
    queued step; `steady` rates start at the first log point after the last compilation.
    """

    def __init__(self, engine, startup=None):
        self.engine, self.seconds, self.marks = engine, 0.0, []
        self.startup = startup or Startup()  # the run's start (the launching process's) and its parts, for goodput
        self.started = self.startup.started
        self.first_start = None  # when the first training phase began: start-up ends there
        self.checkpoint_seconds = 0.0
        self.data_seconds = 0.0  # waiting in the training loader for the next batch
        self.rollout_seconds = 0.0  # a kind's rows made inside the step (GRPO: generation and rewards)
        self.eval_seconds = self.eval_compile_seconds = self.train_compile_seconds = 0.0
        self.transfers = 0  # device-to-host transfers during training phases only
        self.first_epoch_compiles = None
        self.counting = engine.compile_stats() is not None  # False where nothing compiles
        self._last = self._base = self._stats()  # counters are per process: count from here
        self.outside = self._last.get("compiles", 0)  # compilations outside training phases

    def _stats(self):
        return self.engine.compile_stats() or {}

    def counters(self):
        """The run's counters so far ({} where nothing compiles)."""
        return _diff(self._stats(), self._base)

    def delta(self, mark=None):
        """(counters since `mark`, a new mark); `mark` None: since this clock began."""
        now = self._stats()
        return _diff(now, mark or self._base), now

    def start(self):
        self.first_start = self.first_start or time.time()
        self._t0, s = time.perf_counter(), self._stats()
        self.outside += s.get("compiles", 0) - self._last.get("compiles", 0)
        self._last = s

    def now(self):
        return self.seconds + time.perf_counter() - self._t0

    @contextmanager
    def excluding(self):
        """A checkpoint inside a training phase: its time and transfers are counted apart."""
        t0, stats = time.perf_counter(), self._stats()
        yield
        now = self._stats()
        for key in ("transfers", "compile_seconds"):  # a checkpoint's compilations are its own time
            self._last[key] = self._last.get(key, 0) + now.get(key, 0) - stats.get(key, 0)
        elapsed = time.perf_counter() - t0
        self._t0 += elapsed
        self.checkpoint_seconds += elapsed

    def mark(self, step):
        self.marks.append((step, self.now(), self._stats().get("compiles", 0) - self.outside))

    def stop(self, step):
        # The last step's graph is still pending when the loop breaks (the loader cuts each step's
        # graph when it hands out the next batch): run it, and its log point's read, in this phase.
        self.engine.cut_graph()
        self.engine.synchronize()
        self.seconds = self.now()
        s = self._stats()
        self.transfers += s.get("transfers", 0) - self._last.get("transfers", 0)
        self.train_compile_seconds += s.get("compile_seconds", 0) - self._last.get("compile_seconds", 0)
        self.marks.append((step, self.seconds, s.get("compiles", 0) - self.outside))
        self._last = s

    def timed(self, batches):
        """`batches`, with the time spent waiting for each counted as the data's (host time only:
        no device sync). An XLA loader compiles and dispatches the last step's graph inside
        `next()` (torch_xla.sync(), in torch_xla 2.9's PerDeviceLoader.next): that
        compilation is the compile phase's, so it is taken out of the wait."""
        batches = iter(batches)
        while True:
            t0, compiled = time.perf_counter(), self._stats().get("compile_seconds", 0)
            try:
                batch = next(batches)
            except StopIteration:
                return
            compiled = self._stats().get("compile_seconds", 0) - compiled
            self.data_seconds += max(time.perf_counter() - t0 - compiled, 0.0)
            yield batch

    @contextmanager
    def rolling_out(self):
        """Inside a training phase, the step's rows made by the model (a rollout: generating and
        scoring completions): its time counted apart, its compilations the compile phase's. It
        ends with the rollout's copy to the host, which waits for the generation."""
        t0, before = time.perf_counter(), self._stats().get("compile_seconds", 0)
        yield
        compiled = self._stats().get("compile_seconds", 0) - before
        self.rollout_seconds += max(time.perf_counter() - t0 - compiled, 0.0)

    @contextmanager
    def evaluating(self):
        """An evaluation: its time, and its compilations' apart."""
        t0, before = time.perf_counter(), self._stats().get("compile_seconds", 0)
        yield
        self.engine.synchronize()
        self.eval_seconds += time.perf_counter() - t0
        self.eval_compile_seconds += self._stats().get("compile_seconds", 0) - before

    def goodput(self):
        """The run's wall time so far split into phases that add up to it, the share that trained,
        and start-up's parts: {"seconds": {phase: s, ..., "wall": s}, "ratio": training steps /
        wall, "startup": {"imports": s, "data": s, "model": s, "device": s}, "started_at": Unix time}."""
        now = time.time()
        wall, first_step = now - self.started, self.first_start or now
        compiling = self.train_compile_seconds + self.eval_compile_seconds
        parts = {
            "startup": first_step - self.started,  # imports, data, model, device set-up: `startup` below
            "compile": compiling,
            "train_steps": max(self.seconds - self.train_compile_seconds - self.data_seconds - self.rollout_seconds,
                               0.0),
            "data": self.data_seconds,
            **({"rollout": self.rollout_seconds} if self.rollout_seconds else {}),  # kinds that roll out
            "eval": max(self.eval_seconds - self.eval_compile_seconds, 0.0),
            "checkpoint": self.checkpoint_seconds,
        }
        parts["other"] = max(wall - sum(parts.values()), 0.0)  # the finish, between phases
        seconds = {**{k: round(v, 3) for k, v in parts.items()}, "wall": round(wall, 3)}
        # from the rounded seconds, so that the ratio is the one the written numbers give
        return {"seconds": seconds, "ratio": round(seconds["train_steps"] / max(seconds["wall"], 1e-3), 4),
                "startup": {k: round(v, 3) for k, v in self.startup.split(first_step).items()},
                "started_at": round(self.started, 3)}  # the Unix time the wall time counts from

    def end_of_epoch(self):
        if self.first_epoch_compiles is None:
            self.first_epoch_compiles = self._stats().get("compiles", 0)

    def summary(self, steps, samples_per_step, first_step=0):
        """Rates over the steps this process ran (`first_step` < step <= `steps`)."""
        total = samples_per_step * (steps - first_step)
        if not total:  # nothing was left to train (a finished run resumed)
            return {"train_seconds": 0.0, "train_samples_per_s": 0.0, "steady_samples_per_s": 0.0, "xla": None,
                    "torch_compile": None}
        final_compiles = self.marks[-1][2]
        # steady: from the first mark with every compilation already done, to the end
        s0, t0 = next((s, t) for s, t, c in self.marks if c == final_compiles)
        if steps > s0 and self.seconds > t0:
            steady = samples_per_step * (steps - s0) / (self.seconds - t0)
        else:
            steady = total / self.seconds
        out = {"train_seconds": round(self.seconds, 3), "train_samples_per_s": round(total / self.seconds, 3),
               "steady_samples_per_s": round(steady, 3), "checkpoint_seconds": round(self.checkpoint_seconds, 3),
               "xla": None, "torch_compile": None}
        now, stats = self._stats(), self.counters()
        if not stats:
            return out
        compiled = {"compiles": stats["compiles"], "compile_seconds": round(stats["compile_seconds"], 3),
                    "compiles_after_first_epoch": now["compiles"] - (self.first_epoch_compiles or now["compiles"])}
        if "executions" not in stats:  # torch.compile's counters: graphs, seconds, graphs from its caches
            out["torch_compile"] = {**compiled, **{k: stats[k] for k in TORCH_COMPILE_CACHE if k in stats}}
        else:
            out["xla"] = {
                **compiled, "host_syncs_per_step": round(self.transfers / max(steps, 1), 4),
                "aten_fallbacks": stats["aten_fallbacks"], "cache_hits": stats["cache_hits"],
                "cache_misses": stats["cache_misses"], "cache_load_failures": stats["cache_load_failures"],
                "executions": stats["executions"],
                "replicas_sharing_counters": self.engine.replicas_per_process,  # torch_xla's are per process
            }
        return out


def _diff(now, before):
    return {k: v - before[k] for k, v in now.items()}
