"""Per-test cost records for balancing the suite: `SUITE_TIMINGS=DIR` turns them on.

Each test process (each xdist worker) appends one JSON line per test phase to `DIR/<worker>.jsonl`:
`{"nodeid", "when", "worker", "start", "wall_s", "cpu_s", "children_cpu_s"}`. `cpu_s` is the test process's own user
and system time in that phase; `children_cpu_s` that of the child processes it reaped in it (a daemon stopped at a
module fixture's teardown is counted where it is reaped). `scripts/suite_costs DIR` sums them by module.
Each test daemon's start is noted in `DIR/<worker>.daemons` (JSON lines) too: a fork of the zygote, or a new process
and why (tests/support/zygote.py).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class TimingRecorder:
    """A pytest plugin writing one record per test phase (setup, call, teardown) to a JSON-lines file."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self._file = (directory / f"{worker}.jsonl").open("a", encoding="utf-8")
        self._worker = worker

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        """Record the setup phase."""
        with _Phase(self, item.nodeid, "setup"):
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        """Record the call phase."""
        with _Phase(self, item.nodeid, "call"):
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        """Record the teardown phase."""
        with _Phase(self, item.nodeid, "teardown"):
            yield

    def write(self, record: dict[str, object]) -> None:
        """Append one record and flush it (a killed worker keeps what it measured)."""
        record["worker"] = self._worker
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


class _Phase:
    def __init__(self, recorder: TimingRecorder, nodeid: str, when: str) -> None:
        self._recorder, self._nodeid, self._when = recorder, nodeid, when

    def __enter__(self) -> None:
        self._start = time.time()
        self._wall = time.perf_counter()
        self._self = _cpu(resource.RUSAGE_SELF)
        self._children = _cpu(resource.RUSAGE_CHILDREN)

    def __exit__(self, *_exc: object) -> None:
        self._recorder.write(
            {
                "nodeid": self._nodeid,
                "when": self._when,
                "start": round(self._start, 3),
                "wall_s": round(time.perf_counter() - self._wall, 4),
                "cpu_s": round(_cpu(resource.RUSAGE_SELF) - self._self, 4),
                "children_cpu_s": round(_cpu(resource.RUSAGE_CHILDREN) - self._children, 4),
            }
        )
