"""Checkpoints for exact resume: model (safetensors), optimizer, scheduler, every replica's RNG
state, the data position and the run's config, in one folder per step (see storage.py).

Every replica calls `save`; tensors are copied to the CPU first and only the main replica writes.
Loading never unpickles objects: safetensors for the model, `torch.load(weights_only=True)` for
the rest, JSON for the run state.
"""

import json
import pickle

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import UserError, first_line
from .run_folder import mismatch
from .storage import MARKER, checkpoint_name, open_store

BEST = "best"  # checkpoints/best: the best evaluation's weights (--save-best)
FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "state.json")
# What json.loads and torch.load(weights_only=True) raise on a damaged file, as seen by truncating
# these files and flipping their bytes: mostly RuntimeError (no zip archive) and UnpicklingError;
# also EOFError, ValueError (UnicodeDecodeError, JSONDecodeError), KeyError and IndexError from
# torch's reader of the legacy format. Caught only around the loads themselves.
DAMAGED = (OSError, RuntimeError, EOFError, ValueError, KeyError, IndexError, pickle.UnpicklingError)


def _host_tree(engine, tree, writer_only=False):
    """`tree` (dicts, lists, tensors) with every tensor copied to the CPU in one transfer. With
    `writer_only`, only the main replica copies (`Engine.to_writer`); the others get None."""
    leaves, spec = tree_flatten(tree)
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    hosts = (engine.to_writer if writer_only else engine.to_host)([leaves[i] for i in where])
    if hosts is None:
        return None
    for i, host in zip(where, hosts):
        leaves[i] = host
    return tree_unflatten(leaves, spec)


def trained_state(model):
    """What a checkpoint keeps of `model`: its whole state, or, when part of it is frozen (LoRA's
    base), the trained parameters only; the frozen ones come again from the model's own files.
    Which are trained is read from the state's own values (`keep_vars`), so the keys may differ
    from `named_parameters()`' (under FSDPv2 the state's keys lose the wrappers' `_orig_module.`,
    xla_backend._drop_wrapper_keys; the parameters' names keep it). A trained tied parameter
    appears under each of its keys."""
    state = model.state_dict(keep_vars=True)
    if all(v.requires_grad for v in state.values() if isinstance(v, torch.nn.Parameter)):
        return {k: v.detach() for k, v in state.items()}
    return {k: v.detach() for k, v in state.items() if isinstance(v, torch.nn.Parameter) and v.requires_grad}


def save(engine, store, model, optimizer, scheduler, state, keep_last=None):
    """Writes checkpoint `step-<state["run"]["step"]>`; every replica must call this. Returns its URL."""
    from safetensors.torch import save_file

    host = _host_tree(engine, (trained_state(engine.unwrap_model(model)), optimizer.state_dict()), writer_only=True)
    rng = engine.gather(engine.rng_state()[None].int().to(engine.device))  # one row per replica
    (rng,) = engine.to_host([rng])
    name = checkpoint_name(state["run"]["step"])

    def write():
        model_state, opt_state = host
        staging = store.staging(name)
        save_file({k: v.contiguous() for k, v in model_state.items()}, str(staging / "model.safetensors"))
        torch.save(opt_state, staging / "optimizer.pt")
        torch.save(scheduler.state_dict(), staging / "scheduler.pt")
        torch.save({"rng": rng.to(torch.uint8)}, staging / "rng.pt")
        (staging / "state.json").write_text(json.dumps(state, indent=1))
        (staging / MARKER).write_text("")
        store.commit(staging, name)
        if keep_last:
            complete = sorted(s for s, ok in store.checkpoints().items() if ok)
            for old in complete[:-keep_last]:
                store.delete(checkpoint_name(old))

    engine.on_main(write, f"cannot write checkpoint {store.checkpoint_url(name)}")
    return store.checkpoint_url(name)


def save_best(engine, store, model):
    """Keeps the model's weights as the best so far: in `OUTPUT_DIR/checkpoints/best/` with a store
    (so a resumed run still has them), else returned on the CPU. Every replica must call this."""
    from safetensors.torch import save_file

    # without a store every replica keeps its copy (to restore it); with one, only the writer copies
    weights = _host_tree(engine, engine.unwrap_model(model).state_dict(), writer_only=store is not None)
    if store is None:
        return weights

    def write():
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
    """The local folder of the checkpoint to resume: `resume_from`, else the latest complete one."""
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
        return store.fetch(checkpoint_name(step)), store.checkpoint_url(checkpoint_name(step))
    complete = sorted(s for s, ok in store.checkpoints().items() if ok)
    if not complete:
        raise UserError(f"--resume: no complete checkpoint in {store.checkpoint_url('')[:-1]}")
    name = checkpoint_name(complete[-1])
    return store.fetch(name), store.checkpoint_url(name)


class Resume:
    """A checkpoint read and checked in the parent process; workers load their part of it."""

    def __init__(self, folder, url):
        self.folder, self.url = folder, url
        missing = [f for f in FILES if not (folder / f).is_file()]
        if missing:
            raise UserError(f"checkpoint {url} is corrupt: {', '.join(missing)} missing")
        try:
            self.state = json.loads((folder / "state.json").read_text())
            for f in ("optimizer.pt", "scheduler.pt", "rng.pt"):  # checked here, loaded again by workers
                torch.load(folder / f, weights_only=True, map_location="cpu")
        except DAMAGED as e:
            raise UserError(f"checkpoint {url} is corrupt: {first_line(e)}")

    def check(self, cfg, n_train):
        if self.state["n_train"] != n_train:
            raise UserError(f"checkpoint {self.url} was made with {self.state['n_train']} training rows; this "
                            f"data has {n_train}: resume with the same data")
        error = mismatch(self.state["config"], cfg, f"checkpoint {self.url}")
        if error:
            raise error

    def model_weights(self):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(self.folder / "model.safetensors"))
        except (SafetensorError, OSError) as e:  # a truncated or damaged file; one that cannot be read
            raise UserError(f"checkpoint {self.url} is corrupt: model.safetensors: {first_line(e)}")

    def load_model(self, model, weights):
        """Loads a checkpoint's weights into the freshly loaded (and adapted) model; a checkpoint
        of trained parameters only leaves the frozen ones and the buffers as they are."""
        kept = set(trained_state(model))
        try:
            result = model.load_state_dict(weights, strict=False)
            absent = sorted(kept & set(result.missing_keys))
            if result.unexpected_keys or absent:
                raise RuntimeError(f"missing {absent[:3]}, unexpected {result.unexpected_keys[:3]}")
        except RuntimeError as e:
            raise UserError(f"checkpoint {self.url} does not fit model {self.state['config']['model']!r}: "
                            f"{first_line(e)}")

    def load_training_state(self, engine, optimizer, scheduler, world_size):
        """In every worker, after `prepare` and after the scheduler exists."""
        if self.state["world_size"] != world_size:
            raise UserError(f"checkpoint {self.url} was made by {self.state['world_size']} replicas; this run "
                            f"has {world_size}: resume with the same number of devices")

        def load(f):
            return torch.load(self.folder / f, weights_only=True, map_location="cpu")

        optimizer.load_state_dict(load("optimizer.pt"))  # param groups carry the current learning rate
        engine.backend.place_optimizer_state(optimizer)
        scheduler.load_state_dict(load("scheduler.pt"))
        engine.set_rng_state(replica_row(load("rng.pt")["rng"], engine))


def replica_row(rows, engine):
    """This process's row of a checkpoint's random states, saved one per replica (`engine.gather`).
    Under SPMD there is one replica (world size 1) but a process on every host, each with a rank
    (its process index): all of them run the same program from the same seed, so they share the
    one row; indexing by rank would fail on host 1 and up."""
    return rows[engine.rank if engine.world_size > 1 else 0]

