"""SIGTERM (preemption), SIGINT (Ctrl-C) and SIGHUP (the ssh session that started the run was
dropped) become a request to stop at the next step boundary, where the loop saves a checkpoint
and exits with 128 + the signal's number."""

import multiprocessing
import os
import signal
import threading


class StopRequest:
    """While active, records the first SIGTERM, SIGINT or SIGHUP in `signum` instead of dying. Later
    signals are ignored, so a second Ctrl-C cannot cut a checkpoint in half (SIGKILL still can).

    In a launcher process it also passes the signal on to the workers it started: a scheduler
    often signals only the process it launched.
    """

    # SIGHUP's default action ends the process at once, without the checkpoint: a TPU VM job
    # started over ssh without --detach (scripts/tpu_pod.py) gets it when the connection drops.
    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    # Process-wide, so that a signal caught by the launcher's request before the training loop
    # began (start-up, the first compilation) still stops the loop; reset by the outermost one.
    signum: int | None = None
    _depth = 0

    def __init__(self):
        self._previous = {}

    def __enter__(self):
        if StopRequest._depth == 0:
            StopRequest.signum = None
        StopRequest._depth += 1
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        StopRequest._depth -= 1
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if StopRequest.signum:
            return
        StopRequest.signum = signum
        for child in multiprocessing.active_children():
            assert child.pid is not None  # an active child has started
            os.kill(child.pid, signum)

    @property
    def name(self):
        assert self.signum is not None  # read once a signal has arrived (train.Trainer.check_stop)
        return signal.Signals(self.signum).name
