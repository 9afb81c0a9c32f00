"""xla_train: fine-tune Hugging Face transformers on TPU/XLA first, with a CUDA/CPU fallback."""

from .api import Engine, launch, notebook_launcher
from .errors import UserError

__version__ = "0.1.0"
__all__ = ["Engine", "launch", "notebook_launcher", "UserError", "__version__"]
