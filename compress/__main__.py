"""The `compress` command (`python -m compress` too): the CLI, imported inside a guard so that
a Ctrl-C or SIGTERM while torch and transformers load (seconds) ends as one line and exit code
130, as it does once the command runs (compress.cli._interrupted), not as a traceback of the
import or the shell's status for a killed process."""

import json
import os
import signal
import sys

from compress.errors import WRITING_COMMANDS  # plain Python, as this whole module: nothing heavy
from compress.launcher import process_rank


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run() -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # until the command installs its own (cli._terminate_as_interrupt)
    try:
        if os.environ.get("COMPRESS_TEST_KILL_AT") == "importing":  # the kill tests' hook (compress.checkpoint.kill_point)
            os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("COMPRESS_TEST_KILL_SIGNAL", "KILL").upper()))
        from compress.cli import main
    except KeyboardInterrupt:
        if process_rank() != 0:  # under a launcher the main process says it (cli._interrupted)
            return 130
        argv = sys.argv[1:]
        writes = bool(WRITING_COMMANDS & set(argv))  # as cli._interrupted says of them
        message = "interrupted: no output was written" if writes else "interrupted"
        hint = "rerun the same command" if writes else None
        print(message + (f" ({hint})" if hint else ""), file=sys.stderr)
        if "--json" in argv:
            print(json.dumps({"error": message, "hint": hint, "exit_code": 130}))
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
