"""The peer transfers' mapped slots (agent/warmslots.py), in process, on real /dev/shm slots: a mapping held by a
transfer is never closed under it (the agent's shutdown, a dropped or replaced slot), and once the agent closes
them no transfer starts (before: a put that arrived during shutdown died in its thread on a closed mapping)."""
from __future__ import annotations

import os
import threading

import pytest

from easyckpt.agent.warmslots import Warm
from easyckpt.errors import PeerError
from easyckpt.ipc import shm

JOB = "3a7f00c0ffee"


@pytest.fixture
def path():
    p = shm.replica_path(JOB, 0, 0)
    shm.Slot.create_or_grow(p, shm.HEADER_BYTES + (1 << 20)).close()
    yield p
    if os.path.exists(p):
        os.unlink(p)


def test_a_transfer_keeps_its_mapping_through_the_agents_shutdown_and_none_starts_after(path):
    warm = Warm()
    with warm.use(path, writable=True) as slot:
        closing = threading.Thread(target=warm.close)
        closing.start()
        closing.join(10)
        assert not closing.is_alive()
        assert slot.mm is not None
        slot.begin_write(7)                                  # the put goes on writing into its slot
        slot.mm[shm.HEADER_BYTES:shm.HEADER_BYTES + 4] = b"abcd"
    assert slot.mm is None                                   # closed when the transfer let it go
    with pytest.raises(PeerError, match="shutting down"):
        with warm.use(path, writable=False):
            pass


def test_a_slot_dropped_or_replaced_while_held_is_closed_by_its_last_transfer(path):
    warm = Warm()
    with warm.use(path, writable=False) as reader:
        with warm.use(path, writable=False) as again:
            assert again is reader                           # kept mapped between transfers
        with warm.use(path, writable=True) as writer:        # a writer needs a writable mapping: replaced
            assert writer is not reader and reader.mm is not None
        os.unlink(path)
        shm.Slot.create_or_grow(path, shm.HEADER_BYTES + (1 << 20)).close()   # the trainer's new slot
        warm.drop_gone()
        assert reader.mm is not None                         # still held: not closed under the transfer
    assert reader.mm is None and writer.mm is None
    with warm.use(path, writable=False) as fresh:
        assert fresh.inode == os.stat(path).st_ino
    warm.close()
    assert fresh.mm is None
