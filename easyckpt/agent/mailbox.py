"""Results that worker threads hand to the agent's loop, and the pipe that wakes the loop's selector for them."""
from __future__ import annotations

import collections
import os
import threading
from typing import Deque, Generic, List, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    def __init__(self) -> None:
        self._items: Deque[T] = collections.deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def put(self, item: T) -> None:
        """From any thread: hand ``item`` over and wake the loop."""
        with self._lock:
            self._items.append(item)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass      # the pipe is full of wake-ups already: the loop will look

    def wake_fd(self) -> int:
        """Readable when items are waiting (the loop's selector watches it)."""
        return self._wake_r

    def take(self) -> List[T]:
        """Every item put since the last call, in order."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            out = list(self._items)
            self._items.clear()
        return out
