"""Verdicts read from a test run's output, as Terminal-Bench 1's harness reads them (task.yaml's `parser_name`)."""

from __future__ import annotations

from collections.abc import Callable

PYTEST_SUMMARY = "short test summary info"
PYTEST_PASSED = "PASSED"
PYTEST_FAILING = ("FAILED", "ERROR", "XPASS")  # SKIPPED and XFAIL neither count as a pass nor fail the run


def pytest_solved(output: str) -> bool:
    """Whether a pytest run (with `-rA`: its short test summary lists every test's outcome) passed: at least one
    `PASSED` line and no `FAILED`, `ERROR` or `XPASS` one in any summary. Neither the exit status nor a missing summary
    (a module under test that ends the process while pytest imports it) passes."""
    outcomes = set()
    in_summary = False
    for line in output.splitlines():
        if line.startswith("=") and PYTEST_SUMMARY in line:
            in_summary = True
        elif line.startswith("="):  # the closing "== N passed in 0.1s ==" line
            in_summary = False
        elif in_summary:
            outcomes.add(line.split(" ", 1)[0])
    return PYTEST_PASSED in outcomes and not outcomes.intersection(PYTEST_FAILING)


PARSERS: dict[str, Callable[[str], bool]] = {"pytest": pytest_solved}
