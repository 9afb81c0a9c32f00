"""transformers as the job wants it: quiet (the job says what matters itself)."""

import contextlib


@contextlib.contextmanager
def quiet_transformers():
    """transformers without its progress bars and warnings (the job says what matters itself)."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
