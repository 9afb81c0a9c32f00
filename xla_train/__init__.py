"""xla_train: fine-tune Hugging Face transformers on TPU/XLA first, with a CUDA/CPU fallback."""

import time

from .core.errors import UserError
from .parallel.mesh import Mesh

STARTED = time.time()  # the process's start, near enough: where a run's wall time (goodput) begins

__version__ = "0.1.0"
__all__ = ["Engine", "Mesh", "launch", "notebook_launcher", "UserError", "__version__"]


def __getattr__(name):
    # Imported on first use (PEP 562): `xla-train` starts without torch, so a Ctrl-C while the
    # libraries load reaches the CLI's handler, and `xla-train --help` is quick.
    if name in ("Engine", "launch", "notebook_launcher"):
        from .core import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'xla_train' has no attribute {name!r}")
