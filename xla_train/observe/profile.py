"""`--profile-steps A:B`: a device profile of optimizer steps A to B, in the format TensorBoard's
profile plugin opens (`tensorboard --logdir OUTPUT_DIR/profile`, the Profile tab).

XLA: torch_xla's profiler (`xp.start_trace` / `xp.stop_trace`: no server needed), each
micro-batch annotated with `xp.Trace`; CUDA and CPU: `torch.profiler` with TensorBoard's trace
handler. One worker per host captures (on one host: the main process) into a local temporary
folder; the files then go to OUTPUT_DIR/profile/ through the run's store (a local folder or
gs://). Outside the window nothing is added to the loop, and inside it the graphs are the same.
"""

import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path

from ..core.errors import UserError


def parse_steps(spec):
    """"A:B" -> (A, B), optimizer steps counted from 1, A <= B."""
    try:
        first, last = (int(x) for x in spec.split(":"))
    except ValueError:
        raise UserError(f"--profile-steps must be A:B (optimizer steps, e.g. 12:16), not {spec!r}") from None
    if not 1 <= first <= last:
        raise UserError(f"--profile-steps {spec}: steps count from 1 and A must not be after B")
    return first, last


class Profile:
    """One window of profiled steps; a no-op without --profile-steps and on all but one worker per host."""

    def __init__(self, engine, spec, store):
        self.accelerator, self.store = engine.accelerator, store
        self.window = parse_steps(spec) if spec and engine.is_host_main else None
        self.session = self.folder = None

    def micro_batch(self, step):
        """A context around one micro-batch of optimizer step `step` (its forward and backward, and
        at the last one the optimizer step), entered once the loader has handed its batch out. The
        capture starts at step A's first micro-batch, and ends at the first micro-batch after step
        B: the loader's `next()` has then dispatched step B's last graph (see `ended`)."""
        if self.session is not None:
            assert self.window is not None  # set while a capture runs (close() clears both)
            if step > self.window[1]:
                self.close()
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return nullcontext()
        if self.session is None:
            self.folder = Path(tempfile.mkdtemp(prefix="xla_train_profile_"))
            self.session = self.accelerator.start_profile(self.folder, "steps_{}_{}".format(*self.window))
        return self.accelerator.step_annotation(step)

    def ended(self, step):
        """At the graph cut that ends an epoch's loop, after step `step`: the capture ends there if
        step B has run (the run's last step, or an epoch's)."""
        if self.session is not None:
            assert self.window is not None  # set while a capture runs (close() clears both)
            if step >= self.window[1]:
                self.close()

    def close(self):
        """Writes the capture to OUTPUT_DIR/profile/ (also when the run stops inside the window)."""
        if self.session is None:
            return
        session, self.session, self.window = self.session, None, None
        assert self.folder is not None  # made with the session (micro_batch)
        self.accelerator.stop_profile(session)
        for f in sorted(p for p in self.folder.rglob("*") if p.is_file()):
            self.store.put_file(f, Path("profile", f.relative_to(self.folder)).as_posix())
        shutil.rmtree(self.folder, ignore_errors=True)
