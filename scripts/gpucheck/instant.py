"""A pytest plugin the GPU check loads (``-p scripts.gpucheck.instant``; ``python -m pytest``
from the repository root finds it): each failure's text goes to the log when the test fails, not
at the end of the session, and a test still running after ``faulthandler_timeout`` (which the
check sets a little under the file's deadline) dumps every thread's stack. A file cut at its
deadline by a later test that hangs then still brings back why the earlier ones failed, and where
the hung one waits (2026-11-28's H200 check: test_gpu_activity.py printed ``FF`` and was killed
at 70 s, with neither)."""

from __future__ import annotations

import pytest

_config: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _config[:] = [config]


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed or not _config:
        return
    # looked up here: the terminal reporter registers itself after this plugin is configured
    reporter = _config[0].pluginmanager.getplugin("terminalreporter")
    if reporter is None:
        return
    reporter.write_line("")
    reporter.write_line(f"[failed now] {report.nodeid} ({report.when})")
    for line in report.longreprtext.splitlines():
        reporter.write_line(line)
    reporter.flush()
