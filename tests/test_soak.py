"""The soak's verdict on a worker's open files and threads (benchmarks/soak.py): a leak grows with the requests, a
pool started at its first use adds one once."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import soak


def verdict(threads: list[int], fds: list[int] | None = None) -> list[str]:
    """The problems ``judge`` finds in samples taken at 0, 1/4, 1/2, 3/4 and all of 100 requests (every request a
    bad one, so no answer is checked against a reference)."""
    fds = fds or [20] * len(threads)
    samples = [soak.ProcessSample(seconds=index, rss_mb=500, fds=files, threads=count, requests=index * 25)
               for index, (files, count) in enumerate(zip(fds, threads, strict=True))]
    plan = [(b"", None, "", 400)] * 100
    answers = [(400, "bad")] * 100
    report = soak.judge(Path("unused.mar"), plan, answers, samples, ("embeddings", "float32"), 25, 0.1,
                        lambda message: None)
    return report["problems"]


@pytest.mark.parametrize(("threads", "fds", "leaks"), [
    ([8, 8, 8, 8, 8], None, False),
    ([8, 9, 9, 9, 9], None, False),    # a pool started at its first use, in the first half
    ([8, 8, 8, 9, 9], None, True),     # growth in the second half
    ([8, 10, 10, 10, 10], None, True),  # more than one, even if it stopped
    ([8, 8, 8, 8, 8], [20, 20, 20, 21, 22], True),
])
def test_the_soak_tells_a_leak_from_a_pool_started_once(threads, fds, leaks):
    problems = verdict(threads, fds)
    assert bool(problems) is leaks, problems
    if leaks:
        assert "after warmup, halfway, at the end" in problems[0]
