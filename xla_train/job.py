"""The prepared job: what the parent process reads, checks and loads once, and hands to every
worker and to the finish as one value."""

from dataclasses import dataclass


@dataclass
class Job:
    cfg: object  # the run's TrainOptions
    task: object  # tasks.Task: labels, metric, evaluation splits, test rows
    tokenizer: object
    data: object  # the tokenised DatasetDict: train, the evaluation splits, test
    shapes: object  # shapes.ShapePlan: padding, global batch, steps per epoch
    model: object  # the pretrained model with its new head (and a resumed run's weights)
    run_id: str = None  # the output folder's run
    truncated: dict = None  # rows cut to --max-length, per split
    resume: object = None  # checkpoint.Resume, or None
    started: float = None  # time.time() when the launching process started (goodput's wall time)

    def report(self):
        """What the metrics JSON says of the job's preparation."""
        return {"run_id": self.run_id, "truncated": self.truncated, "buckets_auto": self.shapes.estimate}
