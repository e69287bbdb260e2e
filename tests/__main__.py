"""`python -m tests ARGS`: pytest with ARGS, then the process leaves with pytest's exit code
through `os._exit`, after Python's atexit callbacks but before the interpreter's finalization
and the native libraries' static destructors.

Why: a test process that drove Ray keeps Ray's native threads (the GCS client's io thread, gRPC's
event engine and timers) past `ray.shutdown()`, and at exit the C++ statics of the libraries
loaded beside them (Ray, gRPC, torch, UCX, triton) are destroyed while those threads run. Once
in CI every test had passed and pytest had printed its summary when, in that teardown, a thread
other than the main one jumped into heap memory (SIGSEGV, exit 139) and failed `make test`.
Ray's own worker processes never run that teardown either (they leave through `QuickExit`). The
make targets run the suites this way (docs/testing.md); everything a test checks has happened
by then."""

from __future__ import annotations

import atexit
import os
import sys

import pytest


def main(argv: list[str]) -> int:
    """Run pytest, run the atexit callbacks (logging, temp directories), flush what was
    written and return pytest's exit code; `os._exit` is the caller's to do."""
    code = int(pytest.main(argv))
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))
