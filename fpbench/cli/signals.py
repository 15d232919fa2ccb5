"""SIGTERM stops `fpbench run` as Ctrl-C does.

SIGTERM is what SLURM's time limit, `scancel` and preemption send, and `timeout`, `kill` and
`docker stop`. Its default kills the process at once, leaving the cell `running` until its claim
goes stale. Here it raises `Terminated` (a KeyboardInterrupt) in the main thread instead: the
cell is stored `interrupted` with the signal named, one plain line says where it stopped, and
the process exits with 143 (128 + 15, what a shell reports for SIGTERM). Worker processes of
`--jobs N` are sent SIGINT, which they already handle as Ctrl-C.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator

EXIT_SIGTERM = 128 + signal.SIGTERM
EXIT_SIGINT = 128 + signal.SIGINT


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; the runner stores the cell as interrupted by `signal_name`."""

    signal_name = "SIGTERM"


class SignalWatch:
    """Which signal stopped the run, if any."""

    def __init__(self) -> None:
        self.terminated = False

    @property
    def exit_code(self) -> int:
        return EXIT_SIGTERM if self.terminated else EXIT_SIGINT

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if self.terminated:
            return  # a second SIGTERM while the first is being stored: finish storing it
        self.terminated = True
        for child in multiprocessing.active_children():  # a --jobs pool's workers
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGINT)
        raise Terminated


@contextlib.contextmanager
def sigterm_interrupts(watch: SignalWatch) -> Iterator[SignalWatch]:
    """SIGTERM raises `Terminated` in the main thread while the block runs (elsewhere: no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield watch
        return
    previous = signal.signal(signal.SIGTERM, watch._on_sigterm)
    try:
        yield watch
    finally:
        signal.signal(signal.SIGTERM, previous)
