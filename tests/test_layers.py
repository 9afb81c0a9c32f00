"""The package's layers, each importing only those below it (every import counts, lazy ones too):

    commands   cli, train, predict (and `python -m xla_train`)
    job        options (every option by section, recipes: what the job is), tasks/, models, run state
               and folder, checkpoints, monitor, trackers, report, ...
    library    xla_train/core/ (Engine, roles, devices, batching, inference), kernels/ (attention,
               experts, the chunked head, generation), parallel/ (the mesh, strategies, launchers,
               plans), io/ (storage, checkpoint IO) and gpu_fallback/ (the torch-native device and
               strategies)

Run as a script to print every import that goes up a layer:
    python tests/test_layers.py
"""

import sys

from test_structure import LIBRARY, import_graph

COMMANDS = {"xla_train.commands.cli", "xla_train.commands.train", "xla_train.commands.predict", "xla_train.__main__"}
ORDER = {"library": 0, "job": 1, "commands": 2}


def layer(module):
    if module == "xla_train" or module.startswith((*LIBRARY, "gpu_fallback")):
        return "library"
    return "commands" if module in COMMANDS else "job"


def upward(graph):
    """Every import of a module from a layer above its own, as 'module -> target'."""
    return sorted(f"{m} ({layer(m)}) -> {t} ({layer(t)})" for m, targets in graph.items() for t in targets
                  if ORDER[layer(t)] > ORDER[layer(m)])


def test_the_walker_sees_an_upward_import():
    assert upward({"xla_train.core.engine": {"xla_train.tasks"}, "xla_train.tasks": set()}) == [
        "xla_train.core.engine (library) -> xla_train.tasks (job)"]
    assert upward({"xla_train.commands.train": {"xla_train.core.engine"}, "xla_train.core.engine": set()}) == []


def test_no_import_goes_up_a_layer():
    graph = import_graph()
    assert {"xla_train.core.engine", "xla_train.tasks.base", "xla_train.commands.train"} <= graph.keys()  # the layout
    assert upward(graph) == []


def test_the_layers_hold_what_they_should():
    """The library has the Engine and the roles; the job has the tasks."""
    graph = import_graph()
    core = {m for m in graph if layer(m) == "library"}
    assert {"xla_train.core.engine", "xla_train.core.batching", "xla_train.core.inference",
            "xla_train.io.checkpoint_io", "xla_train.core.roles"} <= core
    assert not any(m.startswith("xla_train.tasks") for m in core)


if __name__ == "__main__":
    print("\n".join(upward(import_graph())) or "no import goes up a layer")
    sys.exit(0)
