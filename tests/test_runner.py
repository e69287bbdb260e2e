"""`python -m tests` (tests/__main__.py), which every make target runs the suites with: pytest's
exit code comes back, atexit callbacks run, the interpreter's finalization does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A test module that leaves a mark from an atexit callback and one from an object destroyed
# only when the interpreter finalizes its modules.
MODULE = """
import atexit
import sys

OUT = {out!r}
atexit.register(lambda: open(OUT + "/atexit", "w").close())


class Finalized:
    def __init__(self, path):
        self.path = path

    def __del__(self):
        open(self.path, "w").close()


# Held only by sys.modules, which the interpreter empties when it finalizes.
sys.modules["runner_mark"] = Finalized(OUT + "/finalized")


def test_it():
    assert {passes}
"""


def run(tmp_path: Path, runner: str, passes: bool) -> tuple[int, set[str]]:
    """Run the module under `python -m RUNNER`; its exit code and the marks it left."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_mod.py").write_text(MODULE.format(out=str(tmp_path), passes=passes))
    args = [sys.executable, "-m", runner, "-q", "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini")]
    proc = subprocess.run([*args, str(tmp_path / "test_mod.py")], cwd=ROOT, capture_output=True, text=True)
    return proc.returncode, {name for name in ("atexit", "finalized") if (tmp_path / name).exists()}


@pytest.mark.parametrize("passes, code", [(True, 0), (False, 1)])
def test_pytests_exit_code_comes_back(tmp_path, passes, code):
    assert run(tmp_path, "tests", passes) == (code, {"atexit"})


def test_plain_pytest_finalizes_where_the_runner_does_not(tmp_path):
    assert run(tmp_path, "pytest", True) == (0, {"atexit", "finalized"})
