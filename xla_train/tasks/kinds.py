"""The registry of task kinds: a `--problem` name to its `Task` class. A new kind is one module and
one entry here."""

from .causal_lm import CausalLM
from .sequence import Classification, Regression

KINDS = {kind.kind: kind for kind in (Classification, Regression, CausalLM)}
PROBLEMS = tuple(KINDS)
