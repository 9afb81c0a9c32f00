"""SIGTERM (preemption), SIGINT (Ctrl-C) and SIGHUP (the ssh session that started the run was
dropped) become a request to stop at the next step boundary, where the loop saves a checkpoint
and exits with 128 + the signal's number. Outside the loop (start-up, the finish) the command line's
Ctrl-C is `CtrlC`'s: `Interrupted`, one line and exit 130."""

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
            if CtrlC.received:  # a Ctrl-C during start-up that a library swallowed: stop before any step
                raise Interrupted
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


class Interrupted(KeyboardInterrupt):
    """The command line's Ctrl-C outside a StopRequest. A subclass, not KeyboardInterrupt itself:
    CPython remembers a KeyboardInterrupt (that very type) that leaves any exec() of a string, such
    as the ones dataclasses and namedtuple run while a library imports, as "unhandled" even when a
    caller catches it, and then ends the process by SIGINT (exit -2) after the command returned 130
    (Modules/main.c and Python/pythonrun.c, `_Py_UnhandledKeyboardInterrupt`, 3.11; the runtime's
    `unhandled_keyboard_interrupt` later)."""


class CtrlC:
    """While active (the whole of `xla-train`'s command), SIGINT raises `Interrupted` and is
    remembered in `received`, so that the command ends with one line and exit 130 whatever the
    libraries loading at that moment do with the exception: an extension module's initialisation
    (pybind11) turns it into ImportError("initialization failed"), an optional import's `except
    ImportError` then swallows it, and start-up would carry on into training. A StopRequest takes
    SIGINT over for the training loop and gives it back after."""

    received = False

    def __init__(self):
        self._previous = None
        self._installed = False

    def __enter__(self):
        CtrlC.received = False
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc):
        if self._installed:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGINT, signal.default_int_handler if self._previous is None else self._previous)
        CtrlC.received = False

    def ending(self):
        """The command is saying how it ended: a Ctrl-C now (a second one, or the first) changes
        nothing, and cannot cut the line in half or end the process by SIGINT."""
        if self._installed:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    @staticmethod
    def _handle(signum, frame):
        CtrlC.received = True
        raise Interrupted
