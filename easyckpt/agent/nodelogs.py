"""The agent's two logs in the node's directory: the audit log (one file with the trainers, storage/auditlog.py)
and its own stdout and stderr (the agent log its starter handed it, storage/savedir.py). Both are capped in size
(storage/logcap.py: the agent log checked once a second from the loop) and opened again when the directory
they are in was replaced under the job (dirwatch.py): their descriptors would point at unlinked files.
"""
from __future__ import annotations

import os
import socket
import time

from easyckpt.config import Config
from easyckpt.formats.layout import agent_log_name
from easyckpt.storage import logcap
from easyckpt.storage.auditlog import AuditLog
from easyckpt.storage.savedir import SaveDir

CHECK_S = 1.0       # seconds between looks at the agent log's size


class NodeLogs:
    def __init__(self, cfg: Config, log: AuditLog):
        self.cfg, self.log = cfg, log
        self.path = os.path.join(cfg.node_dir, agent_log_name(socket.gethostname()))
        self.next_check = 0.0
        self.said = False

    def _open_agent_log(self) -> int:
        return SaveDir(self.cfg.node_dir, self.cfg.naming).open_agent_log(socket.gethostname())[1]

    def tick(self) -> None:
        """Cap the agent log (the audit log caps itself on each write); a rotation that fails is said once."""
        if time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + CHECK_S
        try:
            logcap.cap_stdio(self.path, self._open_agent_log)
        except OSError as exc:
            if not self.said:
                self.said = True
                self.log.record("warning", message=f"the agent log cannot be rotated: {exc}")

    def reopen(self) -> None:
        """Both logs opened at their paths again (OSError, UntrustedFileError: one cannot be)."""
        self.log.reopen()
        logcap.point_stdio(self._open_agent_log())
