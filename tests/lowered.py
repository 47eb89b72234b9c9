"""Runs a command beside other work at the lowest priority, for tests/suite.sh's engine
tier: ``python tests/lowered.py SESSION_NICE COMMAND...``.

The command runs in a session of its own. Where the kernel groups processes by session
(autogroups: the CPU is shared between sessions first, then between a session's
processes), that session's autogroup gets nice SESSION_NICE, which is what bounds its
share against the rest of the machine; the command itself runs at nice 19, which is what
counts on a kernel without autogroups (below Ray's workers, which Ray starts at 15)."""

import os
import sys


def main(argv: list[str]) -> None:
    session_nice, command = argv[0], argv[1:]
    os.setsid()
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(session_nice)
    except OSError:
        pass  # no autogroups: the processes' own nice is what counts
    os.nice(19)  # capped at 19
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
