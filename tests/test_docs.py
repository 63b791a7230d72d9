"""The docs' commands against the commands themselves: every option README and docs/ write after train_2048.py,
evaluate_2048.py or merge_2048.py is one that command's --help lists, every doc page and `make` target README names
exists. A renamed option fails here, not in a reader's shell."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = ("train_2048", "evaluate_2048", "merge_2048")
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_-]*[a-z0-9])")


def help_flags(command: str) -> set[str]:
    module = __import__(command)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        module.main(["--help"])
    return set(FLAG.findall(out.getvalue()))


@pytest.fixture(scope="module")
def listed():
    return {command: help_flags(command) for command in COMMANDS}


def written_flags(text: str) -> dict[str, set[str]]:
    """The options written after each command's name on a line (a command line, or an options table's row under a
    heading that names the command)."""
    found = {command: set() for command in COMMANDS}
    for line in text.splitlines():
        for command in COMMANDS:
            at = line.find(f"{command}.py")
            if at >= 0:
                found[command] |= set(FLAG.findall(line[at:].split("|")[0] if "|" in line[at:] else line[at:]))
    return found


def options_table(text: str, heading: str) -> set[str]:
    """The options in the first column of the table under `heading` (a section of options of one command)."""
    section = text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    return {flag for row in section.splitlines() if row.startswith("| `") for flag in FLAG.findall(row.split("|")[1])}


# Each options table, and whose options it lists.
TABLES = [("README.md", "## Options people change", "train_2048"), ("docs/TRAINING.md", "## Options", "train_2048"),
          ("docs/EVALUATE.md", "## Options", "evaluate_2048")]  # fmt: skip


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_option_a_page_gives_a_command_is_one_it_takes(page, listed):
    wrong = {command: sorted(flags - listed[command] - {"help"}) for command, flags in written_flags(page.read_text()).items()}
    assert not any(wrong.values()), f"{page.name}: options the commands do not take: {wrong}"


@pytest.mark.parametrize("page, heading, command", TABLES)
def test_an_options_table_lists_options_of_its_command(page, heading, command, listed):
    table = options_table((ROOT / page).read_text(), heading)
    assert len(table) >= 10
    assert table <= listed[command], sorted(table - listed[command])


def test_the_check_finds_a_misspelt_option(listed):
    text = "python train_2048.py --max_step 10\n| `--max_steps` | x |"
    assert written_flags(text)["train_2048"] - listed["train_2048"] == {"max_step"}


def test_readme_names_pages_and_make_targets_that_exist():
    readme = (ROOT / "README.md").read_text()
    pages = set(re.findall(r"docs/[A-Z_]+\.md", readme))
    assert pages and all((ROOT / page).is_file() for page in pages), [p for p in pages if not (ROOT / p).is_file()]
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"(?:^|`)make ([a-z][a-z0-9-]*)", readme, re.M))  # commands, not "make room"
    assert {"demo", "test"} <= named <= targets, named - targets
