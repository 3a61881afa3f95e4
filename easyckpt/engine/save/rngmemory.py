"""Python's and numpy's global RNG states read straight from the generators' memory, for every snapshot.

``random.getstate()`` builds 625 Python ints (10 us) and numpy's legacy ``get_state()`` copies its 624 words
one by one in a loop (40 us): together they were a fifth of a tiny state's snapshot
(benchmarks/bench_snapshot_cost.py). Both generators keep their state as a plain C array, so one memcpy of
2.5 KB each gives the same numbers in about a microsecond, and comparing those bytes with the last capture's
tells whether anything was drawn since.

Where the bytes lie:
- numpy: the MT19937 bit generator publishes its state struct's address (``.ctypes.state_address``,
  numpy's documented interface for C callers): 624 uint32 words, then ``int pos``. The legacy RandomState's
  cached Gaussian (``has_gauss``, ``gauss``) has no public address: its two fields are found once in the
  RandomState object by setting two known states and seeing which bytes follow them.
- Python: ``_random.Random`` is ``PyObject_HEAD; int index; uint32_t state[624]`` (Modules/_randommodule.c)
  behind the object's address; ``gauss_next`` is an attribute of the Python-level ``random.Random``.

Each reader proves itself at its first use against the public call and, where the bytes are not what
that call says (another layout, another interpreter), is never used again: the caller falls back to the
public call. Reads stay inside the object's own allocation (``__basicsize__``).
"""
from __future__ import annotations

import ctypes
import random
import struct
from typing import Any, Optional, Tuple

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

WORDS = 624
STATE_BYTES = 4 * WORDS + 4      # the words and the position (numpy: int pos after; Python: int index before)
_HEAD = object.__basicsize__     # PyObject_HEAD: 16 bytes on a regular build


class PythonState:
    """``random.getstate()``'s numbers, as bytes: ``index`` (int32) then the 624 words (uint32)."""

    def __init__(self) -> None:
        self.usable: Optional[bool] = None      # None: not proven yet
        self._kept: Tuple[bytes, Tuple[int, ...]] = (b"", ())
        self._inst: Any = None          # the generator read, and a ctypes view of its state's bytes
        self._view: Any = None

    def read(self) -> Optional[Tuple[int, bytes, Any]]:
        """``(version, raw, gauss_next)`` of the module's generator, None where the bytes cannot be read."""
        inst = getattr(random.getstate, "__self__", None)      # the instance random's functions are bound to
        if self.usable is False or not isinstance(inst, random.Random):
            return None
        if _HEAD + STATE_BYTES > type(inst).__basicsize__:
            self.usable = False
            return None
        if inst is not self._inst:       # (a view of its bytes, kept with it: string_at costs 1 us a call)
            self._inst, self._view = inst, (ctypes.c_char * STATE_BYTES).from_address(id(inst) + _HEAD)
        raw = self._view.raw
        if self.usable is None:
            self.usable = words(raw) == random.getstate()[1]
            if not self.usable:
                return None
        return inst.VERSION, raw, inst.gauss_next  # type: ignore[union-attr]

    def getstate(self) -> Tuple[int, Tuple[int, ...], Any]:
        """``random.getstate()``, its numbers kept from the last call while nothing was drawn since."""
        read = self.read()
        if read is None:
            return random.getstate()
        version, raw, gauss = read
        if raw != self._kept[0]:
            self._kept = (raw, words(raw))
        return version, self._kept[1], gauss


def words(raw: bytes) -> Tuple[int, ...]:
    """The 625 numbers of ``random.getstate()[1]`` from PythonState's bytes (the index is last there)."""
    return tuple(struct.unpack_from(f"<{WORDS}I", raw, 4)) + (index(raw),)


def index(raw: bytes) -> int:
    """The generator's position in PythonState's bytes."""
    return int(struct.unpack_from("<i", raw)[0])


class NumpyState:
    """numpy's legacy global RandomState, as ``np.random.get_state()`` returns it, from memory: the objects of
    the last read come back while nothing was drawn (nobody changes them: a snapshot only reads them)."""

    def __init__(self) -> None:
        self.usable: Optional[bool] = None      # None: not proven yet
        self._flag_at, self._gap = 0, 0         # has_gauss (int32) in the RandomState; gauss (double) _gap after
        # the RandomState and bit generator read, and ctypes views of their bytes (kept with them: string_at
        # costs 1 us a call)
        self._rs: Any = None
        self._bitgen: Any = None
        self._words: Any = None
        self._gauss: Any = None
        self._kept: Tuple[bytes, Any] = (b"", None)

    def read(self) -> Optional[Tuple[str, Any, int, int, float]]:
        """``np.random.get_state()``'s tuple, None where the bytes cannot be read (the caller asks numpy)."""
        if np is None:
            return None
        rs = getattr(np.random.get_state, "__self__", None)
        if self.usable is False or not isinstance(rs, np.random.RandomState) \
                or not isinstance(rs._bit_generator, np.random.MT19937):
            return None              # np.random.set_bit_generator(another kind): numpy's own call serves
        if rs._bit_generator is not self._bitgen or rs is not self._rs:
            self._bitgen, self._rs = rs._bit_generator, rs
            self._words = (ctypes.c_char * STATE_BYTES).from_address(int(self._bitgen.ctypes.state_address))
            self._gauss = None
        # under the bit generator's lock, which numpy's draws take: another thread's draw is never read half
        # done, nor (while proving) drawn from the marked states
        with self._bitgen.lock:
            if self.usable is None:
                self.usable = self._prove(rs)
                if not self.usable:
                    return None
            return self._state(rs)

    def _state(self, rs: Any) -> Tuple[str, Any, int, int, float]:
        if self._gauss is None:
            self._gauss = (ctypes.c_char * (self._gap + 8)).from_address(id(rs) + self._flag_at)
        raw = self._words.raw + self._gauss.raw
        kept_raw, kept = self._kept
        if raw == kept_raw:
            return kept
        pos, has_gauss = struct.unpack_from("<ii", raw, 4 * WORDS)
        gauss, = struct.unpack_from("<d", raw, STATE_BYTES + self._gap)
        key = np.frombuffer(raw, dtype=np.uint32, count=WORDS).copy()     # its own, writable, like numpy's
        state = ("MT19937", key, pos, has_gauss, gauss)
        self._kept = (raw, state)
        return state

    def _prove(self, rs: Any) -> bool:
        """Find has_gauss and gauss in ``rs``, then check what the bytes give against get_state() with and
        without a cached Gaussian; the generator is set back to where it was."""
        before = rs.get_state()
        try:
            found = _find_gauss(rs, before)
            if found is None:
                return False
            self._flag_at, self._gap = found
            self._gauss = None
            for probe in (before[:3] + (1, 0.123), before):
                rs.set_state(probe)
                self._kept = (b"", None)
                mine, theirs = self._state(rs), rs.get_state()
                if not ((mine[1] == theirs[1]).all() and mine[2:] == tuple(theirs[2:])):
                    return False
            return True
        finally:
            rs.set_state(before)
            self._kept = (b"", None)


def _find_gauss(rs: Any, base: Tuple[Any, ...]) -> Optional[Tuple[int, int]]:
    """(offset of has_gauss, bytes from it to gauss) in the RandomState ``rs``: where two marked Gaussians
    appear, and the int before them that reads 1 with a Gaussian cached and 0 without."""
    size = type(rs).__basicsize__
    marks = (0.8125048828125, -3.0517578125e-05)      # doubles unlikely to lie in a pointer or a count
    mems = []
    for mark in marks:
        rs.set_state(base[:3] + (1, mark))
        mems.append(ctypes.string_at(id(rs), size))
    at = [m.find(struct.pack("<d", mark), _HEAD) for m, mark in zip(mems, marks)]
    if at[0] < 0 or at[0] != at[1]:
        return None
    rs.set_state(base[:3] + (0, 0.0))
    mems.append(ctypes.string_at(id(rs), size))
    for gap in (4, 8):
        flag = at[0] - gap
        if flag >= _HEAD and [struct.unpack_from("<i", m, flag)[0] for m in mems] == [1, 1, 0]:
            return flag, gap
    return None


PYTHON = PythonState()
NUMPY = NumpyState()
