"""A SIGTERM after `ray.init` reaches `python -m serve`'s own handler (which stops the service as
Ctrl-C does), not the one Ray installs in C, which aborts the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]

# A fresh process: its own local cluster, a Python SIGTERM handler installed before ray.init,
# then a SIGTERM to itself once ray.init has returned.
_CHILD = textwrap.dedent(
    """
    import os, signal, threading
    import ray
    from serve.launch import keeping_sigterm

    got = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: got.set())
    with keeping_sigterm():
        ray.init(address="local", include_dashboard=False, num_cpus=1, logging_level="ERROR")
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        print("handled" if got.wait(30) else "not handled", flush=True)
    finally:
        ray.shutdown()
    """
)


def test_a_sigterm_after_ray_init_reaches_the_callers_handler():
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=_REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "handled"
