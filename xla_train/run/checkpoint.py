"""Checkpoints for exact resume: model (safetensors), optimizer, scheduler, every replica's RNG
state, the data position and the run's config, in one folder per step (see storage.py).

Every replica calls `save`; tensors are copied to the CPU first and only the main replica writes.
Under FSDPv2 (a strategy that `writes_shards`) the trained weights and the optimizer's moments are
not copied whole: every host writes its own shards (`shards/host-N/`, torch.distributed.checkpoint)
and the main one the rest, its marker once every host's part is written.
Loading unpickles no objects of ours: safetensors for the model, `torch.load(weights_only=True)` for
the rest, JSON for the run state (torch.distributed.checkpoint reads a sharded checkpoint's
`.metadata` with pickle: resume only from checkpoints your runs wrote).
"""

import contextlib
import json
import pickle
import shutil

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.errors import UserError, first_line
from ..core.roles import optimizer_params, shaped_like
from ..core.ties import first_names_only
from ..io.checkpoint_io import trained_state
from ..io.storage import MARKER, SHARDS, checkpoint_name, complete_steps, open_store
from .folder import mismatch

BEST = "best"  # checkpoints/best: the best evaluation's weights (--save-best)
FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "state.json")
# What json.loads and torch.load(weights_only=True) raise on a damaged file, as seen by truncating
# these files and flipping their bytes: mostly RuntimeError (no zip archive) and UnpicklingError;
# also EOFError, ValueError (UnicodeDecodeError, JSONDecodeError), KeyError and IndexError from
# torch's reader of the legacy format. Caught only around the loads themselves.
DAMAGED = (OSError, RuntimeError, EOFError, ValueError, KeyError, IndexError, pickle.UnpicklingError)
MOMENTS = "sharded_moments"  # in a sharded checkpoint's optimizer.pt: the keys of the moments kept in shards


def _host_tree(engine, tree, writer_only=False):
    """`tree` (dicts, lists, tensors) with every tensor copied to the CPU in one transfer. With
    `writer_only`, only the main replica copies (`Engine.to_host`'s main_only); the others get None."""
    leaves, spec = tree_flatten(tree)
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    hosts = engine.to_host([leaves[i] for i in where], main_only=writer_only)
    if hosts is None:
        return None
    for i, host in zip(where, hosts):
        leaves[i] = host
    return tree_unflatten(leaves, spec)




def split_moments(optimizer):
    """The optimizer's state without the tensors shaped like their parameter (AdamW's two moments),
    and those tensors keyed `"<parameter index>.<name>"` (laid out like their parameter, on the
    device). The rest (steps, hyperparameters) is small and the same on every host."""
    saved = optimizer.state_dict()
    params = optimizer_params(optimizer)
    states: dict[int, dict]
    states, moments = {}, {}
    for i, s in saved["state"].items():
        states[i] = {}
        for k, v in s.items():  # a copy: `s` is the optimizer's own dict
            if shaped_like(v, params[i]):
                moments[f"{i}.{k}"] = v
            else:
                states[i][k] = v
    return {**saved, "state": states, MOMENTS: sorted(moments)}, moments


def save(engine, store, model, optimizer, scheduler, state, keep_last=None):
    """Writes checkpoint `step-<state["run"]["step"]>`; every replica must call this. Returns its URL."""
    from safetensors.torch import save_file

    strategy, name = engine.strategy, checkpoint_name(state["run"]["step"])
    what = f"cannot write checkpoint {store.checkpoint_url(name)}"
    model_state = trained_state(engine.unwrap_model(model))
    if strategy.writes_shards:
        opt_state, moments = split_moments(optimizer)
        host = _host_tree(engine, (None, opt_state), writer_only=True)
        state = {**state, "shards": SHARDS, "hosts": strategy.peers}  # a host reads the shards it wrote
    else:
        host = _host_tree(engine, (model_state, optimizer.state_dict()), writer_only=True)
    rng = strategy.gather(engine.accelerator.rng_state()[None].int().to(engine.device))  # one row per replica
    (rng,) = engine.to_host([rng])
    staging = None

    def stage():
        nonlocal staging
        store.clear(name)  # what an interrupted save of this step left, before any host uploads its part
        staging = store.staging(name)

    if strategy.writes_shards:
        # every host writes its shards (its own files and metadata: no host reads another's); the
        # others upload theirs, and the main one writes the rest once all have (on_every agrees)
        def write_shards():
            folder = staging if engine.is_main_process else store.part_staging(name)
            assert folder is not None  # the main process staged it before (stage, on_main)
            with _removed_on_failure(folder):
                strategy.save_shards({"model": model_state, "optimizer": moments},
                                     folder / SHARDS / f"host-{strategy.rank}")
                if not engine.is_main_process:
                    store.upload(folder, name)
            if not engine.is_main_process:
                store.drop_part(folder)

        _saving(engine.on_main, stage, what, store)
        _saving(engine.on_every, write_shards, what, store)

    def write():
        if staging is None:
            stage()
        assert staging is not None  # set by stage()
        model_state, opt_state = host
        with _removed_on_failure(staging):
            if model_state is not None:
                save_file({k: v.contiguous() for k, v in model_state.items()}, str(staging / "model.safetensors"))
            torch.save(opt_state, staging / "optimizer.pt")
            torch.save(scheduler.state_dict(), staging / "scheduler.pt")
            torch.save({"rng": rng.to(torch.uint8)}, staging / "rng.pt")
            (staging / "state.json").write_text(json.dumps(state, indent=1))
            (staging / MARKER).write_text("")
        store.commit(staging, name)
        if keep_last:
            for old in complete_steps(store)[:-keep_last]:
                store.delete(checkpoint_name(old))

    _saving(engine.on_main, write, what, store)
    return store.checkpoint_url(name)


@contextlib.contextmanager
def _removed_on_failure(folder):
    """A part-written step's folder is removed when its writing fails (its space back)."""
    try:
        yield
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _saving(run, write, what, store):
    """`run(write, what)` (Engine.on_main or on_every); a failure's line says what the output
    folder still holds, on every replica."""
    try:
        run(write, what)
    except UserError as e:
        raise UserError(f"{e}; {kept(store)}", e.exit_code) from None


def kept(store):
    """What a failed save leaves: the latest complete checkpoint, untouched (a save writes into a
    staging folder and appears whole or not at all)."""
    try:
        complete = complete_steps(store)
    except Exception:  # broad on purpose: the store that failed the save may fail its listing too
        return "the complete checkpoints written before it are kept"
    if not complete:
        return "no complete checkpoint was written before it"
    latest = store.checkpoint_url(checkpoint_name(complete[-1]))
    return f"the latest complete checkpoint, {latest}, is kept: continue from it with --resume"


def save_best(engine, store, model):
    """Keeps the model's trained weights as the best so far (with --lora the adapters and head, not
    the frozen base): in `OUTPUT_DIR/checkpoints/best/` with a store (so a resumed run still has
    them), else returned on the CPU. Every replica must call this."""
    from safetensors.torch import save_file

    # without a store every replica keeps its copy (to restore it); with one, only the writer copies
    weights = _host_tree(engine, trained_state(engine.unwrap_model(model)), writer_only=store is not None)
    if store is None:
        return weights

    def write():
        store.clear(BEST)
        staging = store.staging(BEST)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / "model.safetensors"))
        (staging / MARKER).write_text("")
        store.commit(staging, BEST)

    engine.on_main(write, f"cannot write the best model to {store.checkpoint_url(BEST)}")
    return None


def load_best(store):
    """The best weights `save_best` kept in the store."""
    from safetensors.torch import load_file

    return load_file(str(store.fetch(BEST) / "model.safetensors"))


def find(store, resume_from=None):
    """The checkpoint to resume, `resume_from`, else the latest complete one: its local folder, its
    URL, its store and its name (what `Resume` takes)."""
    if resume_from:
        url = str(resume_from).rstrip("/")
        parent, _, name = url.rpartition("/checkpoints/")
        if not parent or not name:
            raise UserError(f"--resume-from {resume_from}: expected a path like OUTPUT_DIR/checkpoints/step-00000100")
        store = open_store(parent)
        found = store.checkpoints()
        step = int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None
        if step not in found:
            raise UserError(f"checkpoint not found: {resume_from}")
        if not found[step]:
            raise UserError(f"checkpoint {resume_from} is incomplete (no {MARKER} marker: it was interrupted "
                            "while being written); resume from an earlier one")
        name = checkpoint_name(step)
        return store.fetch(name), store.checkpoint_url(name), store, name
    complete = complete_steps(store)
    if not complete:
        raise UserError(f"--resume: no complete checkpoint in {store.checkpoint_url('')[:-1]}")
    name = checkpoint_name(complete[-1])
    return store.fetch(name), store.checkpoint_url(name), store, name


class Resume:
    """A checkpoint read and checked in the parent process; workers load their part of it."""

    def __init__(self, folder, url, store=None, name=None):
        self.folder, self.url, self.store, self.name = folder, url, store, name
        try:
            self.state = json.loads((folder / "state.json").read_text()) if (folder / "state.json").is_file() else {}
        except DAMAGED as e:
            raise UserError(f"checkpoint {url} is corrupt: {first_line(e)}")
        # a sharded checkpoint's weights are in its hosts' shards, which each host's worker reads
        self.sharded = self.state.get("shards") == SHARDS
        missing = [f for f in FILES if not (folder / f).is_file() and not (self.sharded and f == "model.safetensors")]
        if missing:
            raise UserError(f"checkpoint {url} is corrupt: {', '.join(missing)} missing")
        try:
            for f in ("optimizer.pt", "scheduler.pt", "rng.pt"):  # checked here, loaded again by workers
                torch.load(folder / f, weights_only=True, map_location="cpu")
        except DAMAGED as e:
            raise UserError(f"checkpoint {url} is corrupt: {first_line(e)}")

    def check(self, cfg, n_train, roles):
        if self.sharded and not roles.strategy.writes_shards:
            raise UserError(f"checkpoint {self.url} holds its hosts' shards (written by --backend xla --strategy "
                            "fsdp): resume with --backend xla --strategy fsdp")
        if self.state["n_train"] != n_train:
            raise UserError(f"checkpoint {self.url} was made with {self.state['n_train']} training rows; this "
                            f"data has {n_train}: resume with the same data")
        error = mismatch(self.state["config"], cfg, f"checkpoint {self.url}")
        if error:
            raise error

    def model_weights(self):
        """The checkpoint's weights on the CPU, or None when they are in its hosts' shards (the
        workers load those into the prepared model: `load_training_state`)."""
        from safetensors import SafetensorError

        if self.sharded:
            return None
        from safetensors.torch import load_file

        try:
            return load_file(str(self.folder / "model.safetensors"))
        except (SafetensorError, OSError) as e:  # a truncated or damaged file; one that cannot be read
            raise UserError(f"checkpoint {self.url} is corrupt: model.safetensors: {first_line(e)}")

    def load_model(self, model, weights):
        """Loads a checkpoint's weights into the freshly loaded (and adapted) model; a checkpoint
        of trained parameters only leaves the frozen ones and the buffers as they are."""
        kept = set(trained_state(model))
        weights, stale = first_names_only(model, weights)
        if stale:
            print(f"checkpoint {self.url} holds {', '.join(stale)} apart from the tensor tied to it (written before "
                  "tied weights were kept one): the first name's trained values are loaded")
        try:
            result = model.load_state_dict(weights, strict=False)
            absent = sorted(kept & set(result.missing_keys))
            if result.unexpected_keys or absent:
                raise RuntimeError(f"missing {absent[:3]}, unexpected {result.unexpected_keys[:3]}")
        except RuntimeError as e:
            raise UserError(f"checkpoint {self.url} does not fit model {self.state['config']['model']!r}: "
                            f"{first_line(e)}")

    def load_training_state(self, engine, model, optimizer, scheduler, world_size):
        """In every worker, after `prepare` and after the scheduler exists: the optimizer's,
        scheduler's and random state, and the weights of a sharded checkpoint."""
        if self.state["world_size"] != world_size:
            raise UserError(f"checkpoint {self.url} was made by {self.state['world_size']} replicas; this run "
                            f"has {world_size}: resume with the same number of devices")

        def load(f):
            return torch.load(self.folder / f, weights_only=True, map_location="cpu")

        opt_state = load("optimizer.pt")
        if self.sharded:  # every host reads its own shards; one that fails stops them all
            engine.on_every(lambda: self._load_shards(engine, model, optimizer, opt_state),
                            f"cannot resume from {self.url}")
        optimizer.load_state_dict(opt_state)  # param groups carry the current learning rate
        engine.strategy.place_optimizer_state(optimizer)
        scheduler.load_state_dict(load("scheduler.pt"))
        engine.accelerator.set_rng_state(replica_row(load("rng.pt")["rng"], engine))

    def _load_shards(self, engine, model, optimizer, opt_state):
        """Loads this host's shards into the model's trained tensors (in place) and into the moments
        of `opt_state` (made here laid out like their parameters)."""
        strategy = engine.strategy
        if self.state.get("hosts", 1) != strategy.peers:
            raise UserError(f"checkpoint {self.url} was made on {self.state.get('hosts', 1)} host(s); this run has "
                            f"{strategy.peers}: resume on as many hosts (each reads the shards it wrote)")
        part = f"{SHARDS}/host-{strategy.rank}"
        folder = self.store.fetch(self.name, part) / part
        if not (folder / ".metadata").is_file():
            raise UserError(f"checkpoint {self.url} is corrupt: {part}/.metadata missing")
        params = optimizer_params(optimizer)
        moments = {key: strategy.zeros_like_param(params[int(key.split(".")[0])]) for key in opt_state.pop(MOMENTS)}
        try:
            strategy.load_shards({"model": trained_state(engine.unwrap_model(model), live=True),
                                  "optimizer": moments}, folder)
        except DAMAGED as e:
            raise UserError(f"checkpoint {self.url} is corrupt: {part}: {first_line(e)}")
        finally:
            self.store.drop_fetched(self.name, part)
        for key, value in moments.items():
            index, _, k = key.partition(".")
            opt_state["state"][int(index)][k] = value


def replica_row(rows, engine):
    """This process's row of a checkpoint's random states, saved one per replica (`strategy.gather`).
    Under SPMD there is one replica (world size 1) but a process on every host, each with a rank
    (its process index): all of them run the same program from the same seed, so they share the
    one row; indexing by rank would fail on host 1 and up."""
    return rows[engine.rank if engine.world_size > 1 else 0]

