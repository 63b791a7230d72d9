"""The sandbox's walls, said at the start of a run (console and training.log), and true: each claim of the line is
checked against what a strategy's process meets (a call outside the allowlist, the user it runs as)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import sandbox
import train_2048

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "cpu-demo.yaml")

# Escaped code (the tests' _unrestricted switch: every module, no Python check) that takes one step outside the
# process (getppid is not on the allowlist) and then says which user it runs as.
PROBE = "import os\ndef strategy(board):\n    os.getppid()\n    raise ValueError(f'euid {os.geteuid()}')\n"


@pytest.fixture
def server():
    """A server started with the switches a test asks for, and the default one back after."""

    def start(**switches):
        sandbox.shutdown()
        sandbox.start(**switches)
        return sandbox.describe_walls(sandbox.walls())

    yield start
    sandbox.shutdown()
    sandbox.start()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the sandbox's own warning, once seccomp is off
@pytest.mark.parametrize("switches", [{}, {"_disable_seccomp": True}, {"_disable_seccomp": True, "_keep_root": True}])
def test_the_line_says_what_a_strategy_meets(server, switches):
    line = server(**switches)
    assert line.startswith("sandbox walls: ") and "\n" not in line
    played = sandbox.play(PROBE, seed=0, _unrestricted=True)
    if "seccomp allowlist on" in line:
        assert played.status == "violation"  # the step outside killed it
    else:
        assert "seccomp OFF (disabled)" in line and played.status == "error", played
        euid = int(played.error.split("euid ")[1].rstrip("'\""))
        assert (euid != os.geteuid()) == ("a user of its own" in line), (line, euid)
        assert ("keep root" in line) == (euid == 0 == os.geteuid())
    assert ("no change of user" in line) == (os.geteuid() != 0)


def test_the_line_names_the_outer_wrap(server, monkeypatch):
    monkeypatch.setenv("TRAIN2048_SANDBOX_WRAP", "env --")  # a wrap that runs the server as it is
    line = server()
    assert "the server runs under `env --`" in line
    monkeypatch.delenv("TRAIN2048_SANDBOX_WRAP")
    assert "no outer wrap" in server()


def test_a_trainer_that_is_no_root_says_it_gets_no_change_of_user():
    """As a DGX Spark user or under `docker run --user`: seccomp, but no change of user (only root can switch)."""
    line = sandbox.describe_walls({"seccomp": True, "reason": "", "drops_root": False, "root": False, "wrap": ""})
    assert "seccomp allowlist on" in line and "no change of user (only root can switch users)" in line
    assert f"uid {os.geteuid()}" in line


class Stop(Exception):
    pass


def test_a_run_says_its_walls_on_the_console_and_in_training_log(tmp_path, monkeypatch, capsys):
    def load(*args, **kwargs):
        raise Stop  # the line is said before the model loads

    monkeypatch.setattr(train_2048, "load_or_leave", load)
    out = tmp_path / "run"
    with pytest.raises(Stop):
        train_2048.main(["--config", DEMO, "--output_dir", str(out), "--max_steps", "1"])
    expected = sandbox.describe_walls(sandbox.walls())
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("sandbox walls: ")] == [expected]
    logged = [line for line in (out / "training.log").read_text().splitlines() if "sandbox walls: " in line]
    assert len(logged) == 1 and logged[0].endswith(expected)
