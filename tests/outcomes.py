"""pytest plugin: each test's outcome appended to a file the moment the test ends, so that a run stopped by a time
limit (a lent GPU's lease) still says which tests passed and which failed, and why -- pytest's own summary comes
only at the end. Load it with ``-p outcomes`` (tests/ on the import path, as pytest puts it for this project's
tests) and name the file with ``--outcomes PATH``: one JSON line per test (``test``, ``outcome`` -- passed, failed,
skipped, or error for a failed set-up or tear-down --, ``seconds``, and for a failure or skip the message's first
lines). Under pytest-xdist only the controlling process writes, as the workers' reports reach it."""
import json

import pytest

ERROR_LINES = 8  # the first lines of a failure's report kept (the assertion, or the exception and where)


def pytest_addoption(parser):
    parser.addoption("--outcomes", metavar="PATH", help="append each test's outcome to PATH as a JSON line when the "
                                                        "test ends (outcomes.py)")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    path = config.getoption("outcomes")
    if path and not hasattr(config, "workerinput"):  # (an xdist worker: its controller writes)
        config.pluginmanager.register(_Writer(path), "outcomes-writer")


class _Writer:
    def __init__(self, path):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.failed or (report.when == "setup" and report.skipped):
            outcome = report.outcome if report.when == "call" or report.skipped else "error"
            line = {"test": report.nodeid, "outcome": outcome, "when": report.when,
                    "seconds": round(report.duration, 3)}
            if report.failed or report.skipped:
                text = report.longreprtext if not report.skipped else str(report.longrepr[-1])
                line["message"] = "\n".join(_message_lines(text))
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")


def _message_lines(text):
    """The lines of a report that say what went wrong (pytest's ``E`` lines first), at most ERROR_LINES."""
    lines = text.splitlines()
    errors = [line for line in lines if line.startswith("E ")]
    return (errors or lines[-ERROR_LINES:])[:ERROR_LINES]
