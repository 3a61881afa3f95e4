"""Slots kept mapped between peer transfers (peerserve.py, replicas.py), their pages populated once: a slot
sent or received every few steps then costs the copy alone.

A mapping is checked against the file at every use (same inode, same size: a slot recreated or grown gets a new
one), and ``drop_gone`` lets go of slots whose file is gone (a trainer's unlink at bye must free the memory).
A transfer holds its slot through ``use``: a mapping replaced, dropped or closed meanwhile (the agent shutting
down while a put arrives) is closed by the last transfer that holds it, never under it; once closed, ``use``
refuses with PeerError.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Dict, Iterator

from easyckpt.errors import PeerError
from easyckpt.ipc import shm


class Warm:
    def __init__(self) -> None:
        self._slots: Dict[str, shm.Slot] = {}
        self._users: Dict[int, int] = {}      # id(slot) -> transfers holding it
        self._retired: Dict[int, shm.Slot] = {}   # replaced, dropped or closed while held: closed when let go
        self._closed = False
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def use(self, path: str, writable: bool) -> Iterator[shm.Slot]:
        """The slot at ``path``, mapped (``writable`` when asked), held until the block ends."""
        slot = self._take(path, writable)
        try:
            yield slot
        finally:
            with self._lock:
                key = id(slot)
                self._users[key] -= 1
                if not self._users[key]:
                    del self._users[key]
                    gone = self._retired.pop(key, None)
                    if gone is not None:
                        gone.close()

    def _take(self, path: str, writable: bool) -> shm.Slot:
        st = os.stat(path, follow_symlinks=False)
        with self._lock:
            if self._closed:
                raise PeerError("the agent is shutting down: no transfer starts now")
            slot = self._slots.get(path)
            if slot is None or (slot.inode, slot.size) != (st.st_ino, st.st_size) or (writable and not slot.writable):
                if slot is not None:
                    self._let_go(self._slots.pop(path))
                slot = shm.Slot(path, writable, populate=True)
                self._slots[path] = slot
            self._users[id(slot)] = self._users.get(id(slot), 0) + 1
            return slot

    def _let_go(self, slot: shm.Slot) -> None:
        """(under the lock) close ``slot`` now, or when the last transfer holding it ends."""
        if id(slot) in self._users:
            self._retired[id(slot)] = slot
        else:
            slot.close()

    def drop_gone(self) -> None:
        with self._lock:
            for path, slot in list(self._slots.items()):
                try:
                    same = os.stat(path, follow_symlinks=False).st_ino == slot.inode
                except FileNotFoundError:
                    same = False
                if not same:
                    self._let_go(slot)
                    del self._slots[path]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for slot in self._slots.values():
                self._let_go(slot)
            self._slots.clear()
