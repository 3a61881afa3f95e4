"""What easyckpt says on a training console: one readable line per notable event, through Python
``logging`` (the logger named ``easyckpt``), in the frameworks' rank-0 convention.

Notable events are said at INFO on global rank 0 only (as Megatron's ``print_rank_0``, DeepSpeed's
``log_dist(ranks=[0])``, the Trainer's main process): the step resumed and from where, each checkpoint
committed, the SIGTERM save. Warnings and errors are said on the rank that has them (its own trouble is
known only there), as the Trainer's ``log_level_replica`` default (warning) does.

Where the lines go: as transformers does for its own logger, easyckpt adds one handler to its logger and
does not propagate to the root logger, so the lines look the same under every framework (Megatron-LM's
``training.py`` configures the root logger with its own format at import): ``easyckpt: <line>``
(``easyckpt [rank 3]: ...`` on other ranks) on stderr, or on stdout for Megatron whose own log is there;
written through ``tqdm.write`` while a tqdm bar (the Trainer's) is drawn, so the bar is not torn. An
application that wants the lines in its own handlers adds a handler to ``easyckpt`` before training starts:
easyckpt then adds none. The level is the user's to set (INFO when left unset):
``logging.getLogger("easyckpt").setLevel(logging.WARNING)`` keeps only warnings and errors; DEBUG adds
every audit-log event (logger ``easyckpt.audit``).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional, TextIO

logger = logging.getLogger("easyckpt")
audit_logger = logging.getLogger("easyckpt.audit")

_rank = 0


class _ConsoleHandler(logging.StreamHandler):
    """stderr or stdout as they are when a line is written (test runners and launchers replace them)."""

    def __init__(self, to_stdout: bool):
        super().__init__()
        self.to_stdout = to_stdout

    @property
    def stream(self) -> TextIO:
        return sys.stdout if self.to_stdout else sys.stderr

    @stream.setter
    def stream(self, value: Optional[TextIO]) -> None:
        pass    # StreamHandler.__init__ assigns one; ours is looked up at each line

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
        if bars and tqdm is not None:      # a bar is on the screen: tqdm clears it, writes the line, redraws it
            try:
                tqdm.tqdm.write(self.format(record), file=self.stream)
                return
            except Exception:   # noqa: BLE001 - never lose the line for the bar's sake
                pass
        super().emit(record)


def install(rank: int, to_stdout: bool = False, speaker: str = "easyckpt") -> None:
    """Called once per training process when the engine starts (again by a second engine: a no-op but
    for the rank), and by the agent (``speaker="easyckpt agent"``: its stderr is its log file)."""
    global _rank
    _rank = rank
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if logger.handlers:
        return        # the application's (or an earlier engine's) handler decides where lines go
    handler = _ConsoleHandler(to_stdout)
    handler.setFormatter(logging.Formatter(f"{speaker}: %(message)s" if rank == 0
                                           else f"{speaker} [rank {rank}]: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False       # or a root handler (Megatron-LM's, basicConfig) would print it twice


def info(text: str) -> None:
    """A notable event, said once for the job (global rank 0)."""
    if _rank == 0:
        logger.info(text)


def warning(text: str) -> None:
    _ensure()
    logger.warning(_plain(text))


def error(text: str) -> None:
    _ensure()
    logger.error(_plain(text))


def _ensure() -> None:
    # a warning said before the engine started (the DeepSpeed CPU switch, a bad setting) reads as the rest
    if not logger.handlers:
        rank = os.environ.get("RANK", "0")      # torchrun's; the engine installs with its own later
        install(int(rank) if rank.isdigit() else 0)


def _plain(text: str) -> str:
    # older messages name the speaker themselves; the handler's prefix does now
    for prefix in ("easyckpt: ", "easyckpt agent: "):
        if text.startswith(prefix):
            return text[len(prefix):] if prefix == "easyckpt: " else "agent: " + text[len(prefix):]
    return text
