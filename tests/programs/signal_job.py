"""A job for the supervisor's signal tests: it starts two helpers that ignore SIGTERM (one in its
process group, one in a session of its own, like a torchrun worker), writes the three pids to
OUT.json, and on SIGTERM or SIGINT records the signal in OUT.signal and exits with EXIT_CODE,
leaving the helpers behind for the supervisor to clean up.

Usage: signal_job.py OUT EXIT_CODE (no torch, starts fast)
"""

import json
import os
import signal
import subprocess
import sys
import time

HELPER = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "print('ready', flush=True); time.sleep(300)")


def main() -> None:
    out, code = sys.argv[1], int(sys.argv[2])

    def on_signal(signum, frame):
        with open(out + ".signal", "w") as f:
            f.write(signal.Signals(signum).name)
        os._exit(code)

    helpers = [subprocess.Popen([sys.executable, "-c", HELPER], stdout=subprocess.PIPE, text=True,
                                start_new_session=own) for own in (False, True)]
    for helper in helpers:
        assert helper.stdout.readline() == "ready\n"
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with open(out + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "helpers": [h.pid for h in helpers]}, f)
    os.replace(out + ".tmp", out + ".json")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
