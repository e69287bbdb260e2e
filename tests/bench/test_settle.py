"""bench.peers starts each run on a quiet machine: a peer still spinning after its own run
(vLLM's worker busy-polls for about a second) must not land on the next engine's run."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.peers import settle

SPIN = "import time\nend = time.monotonic() + 2.0\nwhile time.monotonic() < end:\n    pass\n"


def test_settle_waits_until_a_spinning_process_has_stopped():
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.3)
        settle()
        assert spinner.poll() is not None
    finally:
        spinner.kill()
        spinner.wait()
