"""How long this process's threads waited for a CPU: the benchmarks print it so a reader can tell clean numbers
from numbers taken while other processes held the cores."""

from __future__ import annotations

import os


def runq_wait_s() -> float:
    """Seconds the live threads of this process have spent runnable but waiting for a CPU (Linux
    ``/proc/self/task/*/schedstat``, field 2, nanoseconds; 0.0 where it cannot be read).

    Threads that already exited are not counted, so callers read it while their workers are alive.
    """
    total = 0
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/schedstat") as fh:
                total += int(fh.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return total / 1e9
