"""SIGTERM (preemption) and SIGINT (Ctrl-C) become a request to stop at the next step boundary,
where the loop saves a checkpoint and exits. A second Ctrl-C stops at once."""

import multiprocessing
import os
import signal
import threading


class StopRequest:
    """While active, records the first SIGTERM or SIGINT in `signum` instead of dying.

    In a launcher process it also passes SIGTERM on to the workers it started (a scheduler often
    signals only the process it launched; Ctrl-C already reaches the whole process group).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # pressed twice: do not wait for the checkpoint
        self.signum = self.signum or signum
        if signum == signal.SIGTERM:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGTERM)

    @property
    def name(self):
        return signal.Signals(self.signum).name
