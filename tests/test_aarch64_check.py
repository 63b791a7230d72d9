"""bench/aarch64_check.py's verdict: it passes only when every check ran and passed. No result from the VM, a check
skipped, a failure, or no check at all is a failure, never a pass."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("aarch64_check", REPO / "bench" / "aarch64_check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)

RESULT = dict(rc=0, seconds=300.0, time_scale=15.0, tests=3, failed=[], skipped=[], machine="aarch64", kernel="6.1.0",
              python="3.11.2", root=True, kills={"clone": 2, "openat": 1})  # fmt: skip


def test_no_result_is_a_failure(capsys):
    assert check.report(None, time.monotonic()) == 1
    assert "FAILED: no result came back" in capsys.readouterr().out


@pytest.mark.parametrize("change", [{}, dict(rc=1), dict(tests=0), dict(failed=["t.py::x"]),
                                    dict(skipped=[["t.py::x", "system call numbers are x86_64's"]])])  # fmt: skip
def test_anything_short_of_every_check_passing_fails(change, capsys):
    assert check.report({**RESULT, **change}, time.monotonic()) == (1 if change else 0)
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "aarch64 check " + ("FAILED" if change else "passed")
    assert "by system call: 3 (clone 2, openat 1)" in out


def test_without_root_only_the_change_of_users_tests_may_be_skipped(capsys):
    """Natively, as a DGX Spark's user, the change of user is not checked: said, and not a failure; as root it is."""
    from test_sandbox_attacks import root_only

    assert check.NOT_ROOT == root_only.kwargs["reason"]
    user = {**RESULT, "root": False, "skipped": [["t.py::user", check.NOT_ROOT]]}
    assert check.report(user, time.monotonic()) == 0
    assert "not checked without root: 1" in capsys.readouterr().out
    assert check.report({**user, "root": True}, time.monotonic()) == 1
    assert check.report({**user, "skipped": [*user["skipped"], ["t.py::x", "other"]]}, time.monotonic()) == 1


def test_the_result_line_is_read_behind_a_kernel_message(capsys):
    lines = ["Booting Linux\n", "[  12.3] audit: kauditd hold queue overflow" + check.MARK + json.dumps(RESULT) + "\n"]
    assert check.relay(iter(lines)) == RESULT
    assert capsys.readouterr().out == "Booting Linux\n"


def test_checks_that_select_nothing_fail():
    """The part that runs in the VM (or natively on aarch64) reports no test run as a failure."""
    out = subprocess.run([sys.executable, "bench/aarch64_check.py", "--inside", "--", "-k", "no_such_check"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    (line,) = [line for line in out.stdout.splitlines() if line.startswith(check.MARK)]
    result = json.loads(line[len(check.MARK) :])
    assert out.returncode == 1 and result["tests"] == 0 and result["rc"] != 0, out.stdout[-2000:]
