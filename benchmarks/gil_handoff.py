"""What the interpreter's thread switch interval costs a step loop that shares its process
with a busy event loop, as ``hf-paged serve`` does: a "step" thread waits ``--step-ms`` with
the GIL released (a GPU step's ``Event.synchronize``), then runs ``--host-us`` of Python (the
engine's host work); an "event loop" thread runs Python ``--busy-us`` at a time, then waits
``--idle-us`` (I/O), so it holds the GIL a given fraction of the time. When the step thread
wakes while the other holds the GIL, it waits for the holder to block or for the switch
interval to pass (Python's default: 5 ms, longer than a decode step). Prints the step loop's
mean and p99 iteration time over its ideal (step + host work) for each interval.

usage: python -m benchmarks.gil_handoff [--step-ms 4] [--host-us 800] [--busy-us 2000]
       [--idle-us 1000] [--intervals-ms 5 1 0.5 0.2] [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np


def spin(seconds: float) -> None:
    """Python work (bytecodes: the GIL held, handed over only at the interval's checks)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(step_s: float, host_s: float, busy_s: float, idle_s: float,
            seconds: float) -> list[float]:
    stop = threading.Event()

    def event_loop() -> None:
        while not stop.is_set():
            spin(busy_s)
            time.sleep(idle_s)

    other = threading.Thread(target=event_loop)
    other.start()
    times = []
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            start = time.perf_counter()
            time.sleep(step_s)  # the GIL released, as while waiting for the device
            spin(host_s)
            times.append(time.perf_counter() - start)
    finally:
        stop.set()
        other.join()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--host-us", type=float, default=800.0)
    parser.add_argument("--busy-us", type=float, default=2000.0)
    parser.add_argument("--idle-us", type=float, default=1000.0)
    parser.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 1.0, 0.5, 0.2])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    ideal = args.step_ms + args.host_us / 1e3
    alone = measure(args.step_ms / 1e3, args.host_us / 1e6, 0.0, 1.0, args.seconds / 2)
    rows = {"alone": alone}
    for interval in args.intervals_ms:
        sys.setswitchinterval(interval / 1e3)
        rows[f"switch {interval:g} ms"] = measure(args.step_ms / 1e3, args.host_us / 1e6,
                                                   args.busy_us / 1e6, args.idle_us / 1e6,
                                                   args.seconds)
    out = {"ideal_ms": ideal, "event_loop_busy_fraction": round(
        args.busy_us / (args.busy_us + args.idle_us), 2)}
    for name, times in rows.items():
        ms = np.array(times) * 1e3
        out[name] = {"mean_ms": round(float(ms.mean()), 3),
                     "p99_ms": round(float(np.percentile(ms, 99)), 3),
                     "over_ideal": round(float(ms.mean()) / ideal, 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
