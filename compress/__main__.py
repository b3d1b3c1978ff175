"""The `compress` command (`python -m compress` too): the CLI, imported inside a guard so that
a Ctrl-C or SIGTERM while torch and transformers load (seconds) ends as one line and exit code
130, as it does once the command runs (compress.cli._interrupted), not as a traceback of the
import or the shell's status for a killed process."""

import os
import signal
import sys


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run() -> int:
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if os.environ.get("COMPRESS_TEST_KILL_AT") == "importing":  # the kill tests' hook (compress.checkpoint.kill_point)
            os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("COMPRESS_TEST_KILL_SIGNAL", "INT")))
        from compress.cli import main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        if "--json" in sys.argv[1:]:
            print('{"error": "interrupted", "hint": null, "exit_code": 130}')
        return 130
    finally:
        signal.signal(signal.SIGTERM, before)  # the command installs its own (cli._terminate_as_interrupt)
    return main()


if __name__ == "__main__":
    sys.exit(run())
