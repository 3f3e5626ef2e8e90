"""Under CI=true a skip is a failure, unless what is missing is hardware.

On a user's machine the suite skips, saying what to install, where something
optional is missing: a package (Ray, peft, the loggers), a program (Chromium,
shellcheck), the GSM8K files in ../shared, the network to PyPI. CI (`bash
.ci/run`, which sets CI=true) installs all of it (`make test`), so a skip there
is a feature that went untested: this plugin turns it into a failure whose
message is the skip's own reason. Only the reasons in ALLOWED stay skips.

tests/conftest.py loads it; a pytest run elsewhere can with `-p ci_skips`.
"""

from __future__ import annotations

import os
import re

import pytest

ALLOWED: dict[str, re.Pattern[str]] = {
    # Hardware. CI machines have no GPU: the `gpu` tests are deselected there (`-m "not gpu"`),
    # and these are the reasons they skip with wherever they are selected without a GPU.
    "no CUDA device": re.compile(r"\bno CUDA device\b"),
    # Hardware: on a machine with one GPU, NCCL refuses two ranks on it (tests/test_gpu.py).
    "one GPU for two NCCL ranks": re.compile(r"^NCCL refuses two ranks on one GPU"),
}


def allowed(reason: str) -> str | None:
    """The name of the ALLOWED entry that matches a skip's reason, or None."""
    return next((name for name, pattern in ALLOWED.items() if pattern.search(reason)), None)


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """A skipped report's reason, without pytest's 'Skipped: ' prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)  # (path, line, "Skipped: why")
    return text.removeprefix("Skipped: ")


def fail_a_forbidden_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under CI=true, turn a skip whose reason is not in ALLOWED into a failure that says why."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if allowed(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true: {reason}\n"
        "In CI every test runs but those that need a GPU: provide what the reason above names "
        "(`make test` installs the dev extras and, as root under CI=true, Debian's chromium, shellcheck "
        "and iproute2); a skip for missing hardware belongs in ALLOWED in tests/ci_skips.py."
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield  # a skip in setup (a skipif mark, a fixture) or in the test's body
    fail_a_forbidden_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield  # a module-level importorskip: under CI=true a collection error, so the run stops at once
    fail_a_forbidden_skip(report)
    return report
