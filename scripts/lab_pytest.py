"""pytest plugin of ``scripts/gpu_lab.sh``: one JSON line per test, appended the moment the test ends.

A phase cut off by its time limit then still leaves every finished test's outcome
(``DISTFUSE_LAB_TESTS_JSONL`` names the file; ``scripts/lab_record.py tests`` summarises it).
Load it with ``-p lab_pytest`` and ``scripts/`` on ``PYTHONPATH``.
"""

import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("DISTFUSE_LAB_TESTS_JSONL")
    if not path:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed") or \
            (report.when == "teardown" and report.outcome == "failed"):
        rec = dict(test=report.nodeid, when=report.when, outcome=report.outcome, seconds=round(report.duration, 3))
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            rec["reason"] = str(report.longrepr[2])[:200]
        elif report.outcome == "failed":
            rec["message"] = report.longreprtext[-3000:]
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
