"""Snapshots skipped under back-pressure (both of a rank's slots still being persisted), said on the console once
per episode instead of once per skip.

An episode begins at the first skip that breaks the loss bound (the newest kept snapshot more than
save_mem_interval iterations behind): one warning with the cause and what a crash would lose. It ends at the
rank's next snapshot: one line with how many were skipped, the worst loss bound meanwhile, how long the slots
stayed busy against the training time of save_storage_interval iterations, and the persists' times where known.
Every skip, within the bound or not, is in the audit log as it happens (a "skip" event; the end is a
"skips_ended" event); the console lines are the summary of those.

Each rank says its own episodes: the loss bound is per rank (docs/reliability.md promise 10), ranks on other
nodes are served by other agents and storage paths, and merging them would add a collective to a training step.
So a slow store costs each rank two lines an episode, not one a step.

And two lines a minute at most: an episode that begins within QUIET_SECONDS of the end of one said on the console
goes to the audit log alone, and the next episode said counts those in its first line. Under the default
``save_storage_interval`` a loop of 10 ms steps persisted every 5 steps until the budget had measured how far
apart the persists must be (persistpace.py): its first seconds said 18 to 30 lines (9 to 15 episodes, three
runs) before the budget's own line said the cadence.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from easyckpt import console
from easyckpt.storage.auditlog import AuditLog


@dataclass
class _Episode:
    first: int                   # the first step skipped over the bound
    kept: int                    # the newest snapshot then: its persist and the one before held both slots
    started: float               # monotonic seconds then
    skipped: int = 0             # snapshots skipped since (the first included)
    worst: int = 0               # the most iterations a crash would have lost meanwhile
    said: bool = True            # on the console (False: within QUIET_SECONDS of the last one said)


# seconds after an episode said on the console during which the next ones go to the audit log alone
QUIET_SECONDS = 60.0


class SkipEpisodes:
    def __init__(self, rank: int, save_mem_interval: int, save_storage_interval: int, log: AuditLog):
        self.rank, self.mem, self.storage, self.log = rank, save_mem_interval, save_storage_interval, log
        self.episode: Optional[_Episode] = None
        self._quiet_until = float("-inf")
        self._unsaid = [0, 0]        # episodes, and their skips, not said since the last one said

    def skipped(self, step: int, behind: int, why: str, now: float) -> None:
        """Snapshot ``step`` was skipped for ``why``; the newest kept one is ``behind`` iterations back."""
        over = behind > self.mem
        bound = f", more than save_mem_interval={self.mem}" if over else ""
        message = (f"rank {self.rank}: snapshot of step {step} skipped: {why}; a crash now would lose {behind} "
                   f"iterations on this rank{bound}")
        episode = self.episode
        if episode is not None:
            episode.skipped += 1
            episode.worst = max(episode.worst, behind)
        # on the console once an episode, and only when the loss bound does not hold: a skip that leaves the
        # newest snapshot within save_mem_interval risks nothing
        if episode is None and over:
            said = now >= self._quiet_until
            self.episode = _Episode(step, step - behind, now, 1, behind, said)
            if said:
                episodes, skips = self._unsaid
                self._unsaid = [0, 0]
                earlier = (f" ({episodes} more episode(s), {skips} skip(s) in all, since the last one said are in the "
                           f"audit log alone)") if episodes else ""
                self.log.emit("skip", step=step, rank=self.rank, behind=behind,
                              message=f"{message}; further skips go to the audit log until snapshots "
                                      f"resume{earlier}")
            else:
                self.log.record("skip", step=step, rank=self.rank, behind=behind, message=message)
        else:
            self.log.record("skip", step=step, rank=self.rank, behind=behind, message=message)

    def resumed(self, step: int, now: float, persist_seconds: Callable[[], Dict[int, float]]) -> None:
        """Snapshot ``step`` was taken: an episode in course ends, said with what it cost. ``persist_seconds``:
        asks the agent (bounded) the seconds it took to persist and commit recent steps, by step."""
        episode, self.episode = self.episode, None
        if episode is None:
            return
        steps = max(step - episode.first, 1)
        lasted = now - episode.started
        # the persists that held the slots when the episode began, and those since; a slot is free once the agent
        # has its copy, often before that step commits, so these may not be known yet
        took = [s for at, s in persist_seconds().items() if episode.kept - self.storage <= at < step]
        known = f"; the persists took {statistics.median(took):.2f} s each" if took else ""
        message = (f"rank {self.rank}: snapshots resumed at step {step}: {episode.skipped} skipped since step "
                   f"{episode.first} (a crash would have lost up to {episode.worst} iterations) while both slots "
                   f"were being persisted for {lasted:.2f} s, against {lasted / steps * self.storage:.2f} s of "
                   f"training per save_storage_interval={self.storage}{known}")
        self.log.record("skips_ended", step=step, rank=self.rank, first=episode.first, skipped=episode.skipped,
                        worst=episode.worst, message=message)
        if episode.said:
            console.warning(message)    # where its episode's warning was said: on this rank, whichever it is
            self._quiet_until = now + QUIET_SECONDS
        else:
            self._unsaid[0] += 1
            self._unsaid[1] += episode.skipped
