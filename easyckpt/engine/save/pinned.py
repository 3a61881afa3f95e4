"""Page-locking a snapshot slot for CUDA (cudaHostRegister), so device-to-host copies into it are
asynchronous DMA instead of staging through a pageable bounce buffer.

Trainer side only: the slot format (ipc/shm.py) is shared with the agent, which never imports
torch. Only called when the state has device tensors, so CPU machines never initialise CUDA here.
"""
from __future__ import annotations

import torch

from easyckpt.errors import ShmCapacityError
from easyckpt.ipc import shm
from easyckpt.units import human


def pin(slot: shm.Slot) -> int:
    """Register ``slot``'s whole mapping with CUDA; return the address to hand to ``unpin``."""
    assert slot.mm is not None
    view = torch.frombuffer(slot.mm, dtype=torch.uint8)
    addr = view.data_ptr()
    del view
    err = torch.cuda.cudart().cudaHostRegister(addr, slot.size, 0)
    if int(err) != 0:
        raise ShmCapacityError(f"cannot page-lock snapshot slot {slot.path} ({human(slot.size)}) "
                               f"for CUDA copies (cudaHostRegister error {int(err)}); raise the locked-memory "
                               f"limit (`ulimit -l unlimited`, docker `--ulimit memlock=-1`)")
    return addr


def unpin(addr: int) -> None:
    """Undo ``pin`` before the mapping goes away (a registered range that is unmapped stays locked)."""
    torch.cuda.cudart().cudaHostUnregister(addr)
