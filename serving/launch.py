"""The ``defect-runner`` entry point: the signals of ``serve`` are handled from its first line.

Importing the command line (numpy, Pillow, onnxruntime) takes 0.5-1 s on 2 busy cores; a SIGHUP sent by an
orchestrator in that window would kill the process with Python's default action. Here, before that import,
``serve`` ignores SIGHUP (with a line on stderr: no model is loaded yet, so there is nothing to reload) and
exits 0 on SIGTERM or SIGINT (nothing has started); ``serve`` installs its own handlers before it loads the
model, which then queue a reload or shut down cleanly.
"""

from __future__ import annotations

import os
import signal
import sys


def _ignored_hangup(signum: int, frame: object) -> None:
    os.write(2, b"defect-runner: SIGHUP while starting, before any model is loaded: nothing to reload, ignored\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:
        signal.signal(signal.SIGHUP, _ignored_hangup)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: os._exit(0))
    from serving.cli import main as cli_main  # after the handlers above: this import takes 0.5-1 s (measured)

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
