"""Ctrl-C and SIGTERM as a request to stop a streamed run after the batch in progress."""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger(__name__)


@contextmanager
def stop_requests() -> Iterator[threading.Event]:
    """Ctrl-C / SIGTERM set an event the loop checks between batches (a second Ctrl-C aborts at once)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request(signum, frame):  # noqa: ARG001 - signal handler signature
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()
        log.warning("stopping after the current batch (Ctrl-C again to abort without saving)")

    previous = {sig: signal.signal(sig, request) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
