"""The reversal task's reward (benchmarks/bench_grpo.py, tests/test_grpo.py), in TRL's calling
convention: the share of the answer's letters each completion has in place (partial credit: a
policy is rewarded for getting closer)."""


def reversed_letters(completions, answer, **kwargs):
    out = []
    for completion, want in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        got, want = text.split(), want.split()
        out.append(sum(a == b for a, b in zip(got, want)) / len(want))
    return out
