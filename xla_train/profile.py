"""`--profile-steps A:B`: a device profile of optimizer steps A to B, in the format TensorBoard's
profile plugin opens (`tensorboard --logdir OUTPUT_DIR/profile`, the Profile tab).

XLA: torch_xla's profiler (`xp.start_trace` / `xp.stop_trace`: no server needed), each step
annotated with `xp.StepTrace`; CUDA and CPU: `torch.profiler` with TensorBoard's trace handler.
Only the main process captures; outside the window nothing is added to the loop.
"""

from .core.errors import UserError


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
    """One window of profiled steps; a no-op without --profile-steps and on other replicas."""

    def __init__(self, engine, spec, folder):
        self.accelerator, self.folder = engine.accelerator, folder
        self.first, self.last = parse_steps(spec) if spec and engine.is_main_process else (None, None)
        self.session = self.step = None

    def step_begins(self, step):
        """Before the first micro-batch of optimizer step `step` (called for every micro-batch)."""
        if self.first is None or self.step == step or not self.first <= step <= self.last:
            return
        if self.session is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.session = self.accelerator.start_profile(self.folder)
        self.step = step
        self._annotation = self.accelerator.step_annotation(step)
        self._annotation.__enter__()

    def step_ended(self, step):
        """After optimizer step `step`: its annotation ends; after step B the profile is written."""
        if self.step != step:
            return
        self._annotation.__exit__(None, None, None)
        if step >= self.last:
            self.close()

    def close(self):
        """Writes the profile (also when the run ends inside the window)."""
        if self.session is not None:
            self.accelerator.stop_profile(self.session)
            self.session, self.first = None, None
