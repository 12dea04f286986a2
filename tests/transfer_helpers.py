"""Test helpers for the transfer engine's emulated backend (roundpipe.worker.transfer)."""

from __future__ import annotations

import threading

__all__ = ["HeldLink"]


class HeldLink:
    """Holds an emulated engine's link (its h2d or d2h): no chunk lands until
    ``release``, so a test orders copies by events, not by the bus's timing."""

    def __init__(self, link) -> None:
        self.on_bus = threading.Event()  # a chunk is issued and held
        self._gate = threading.Event()
        finish = link._finish

        def held_finish(chunk, token) -> None:
            self.on_bus.set()
            self._gate.wait()  # a test that fails first leaves a daemon thread waiting
            finish(chunk, token)

        link._finish = held_finish

    def release(self) -> None:
        self._gate.set()
