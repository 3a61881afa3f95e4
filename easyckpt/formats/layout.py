"""The names of everything easyckpt puts in a save directory: the one place they are built and parsed.

Torch-free and I/O-free, so that the agent, the trainer and the operator tools agree on the names without
importing one another (Orbax's ``NameFormat``: one object builds names, the same object finds them).
storage/savedir.py is the only user that turns them into paths; nobody else formats or parses them.

    <step dir>                       the framework's own name: Naming.dir_name(step) / Naming.parse(name)
    .easyckpt-staging-<job>-<step dir>    a step being written by job <job>; renamed to <step dir> by the commit
    .easyckpt-trash-<job>-<victim>-<pid>  a directory on its way out (rename first: atomic; delete after)
    .easyckpt-done-rank-RRRRR.json   in a staging dir: rank R's files are durable (its marker)
    .easyckpt-damaged.json           step dirs the loader rejected, with why (retention orders deletes by it)
    quarantined-<step dir>-<stamp>   a committed step set aside, kept whole: one a fresh start could not restore,
                                     or an older run's step whose name a newer run commits again; no loader or
                                     retention ever takes it, ``easyckpt ls`` lists it, the operator decides
    <tracker>                        the framework's tracker file, Naming.tracker_text(step) inside

A name that does not parse (another tool's file, another framework's directory) is foreign: ``None``, and
every listing skips it. Staging and trash names carry the job id, so that a job only ever removes its own.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

STAGING_PREFIX = ".easyckpt-staging-"
TRASH_PREFIX = ".easyckpt-trash-"
MARKER_PREFIX = ".easyckpt-done-rank-"
MARKER_SUFFIX = ".json"
DAMAGED_NAME = ".easyckpt-damaged.json"
# visible (an operator must see it) and not a prefix any framework's own rotation globs (``checkpoint-*``)
QUARANTINE_PREFIX = "quarantined-"
# Every name is matched whole and in ASCII (re.ASCII, fullmatch): `$` alone lets a trailing newline through, and
# `\d` alone any Unicode digit, so that another user's "step_00000020\n" or "step_０００..." passed for a step of
# the job's (docs/reliability.md promise 15)
_QUARANTINE = re.compile(r"quarantined-(?P<final>[A-Za-z0-9_.\-]+)-(?P<stamp>\d+)", re.ASCII)
_JOB_ID = re.compile(r"[0-9a-f]{12}", re.ASCII)       # Config.job_id: 12 hex digits
_MARKER = re.compile(r"\.easyckpt-done-rank-(\d{5,})\.json", re.ASCII)


@dataclass(frozen=True)
class Naming:
    """How a framework names its step directories and tracker file (supplied by the adapter)."""

    dir_format: str = "step_{:08d}"          # str.format(step)
    dir_regex: str = r"^step_(\d{8})$"       # group 1 = step; what pruning and loading recognise
    tracker: Optional[str] = "latest"        # file name in save_dir, updated after each commit (None: none)
    tracker_format: str = "step_{:08d}"      # its content, str.format(step)
    framework: str = "pytorch"

    def dir_name(self, step: int) -> str:
        return self.dir_format.format(step)

    def parse(self, name: str) -> Optional[int]:
        """The step of a step directory's name, None for any other name."""
        m = re.fullmatch(self.dir_regex, name, re.ASCII)
        return int(m.group(1)) if m else None

    def tracker_text(self, step: int) -> str:
        return self.tracker_format.format(step)

    def parse_tracker(self, text: str) -> Optional[int]:
        """The step a tracker file's content names: a step directory's name (DeepSpeed's ``latest``) or a
        bare number (Megatron's); None for anything else (Megatron's ``release``, garbage)."""
        text = text.strip()
        step = self.parse(text)
        if step is not None:
            return step
        return int(text) if text.isascii() and text.isdecimal() and len(text) < 19 else None


# Each framework's native step-directory names, here (torch-free) so that the operator tools list and
# verify checkpoints without importing torch or the frameworks; the adapters take theirs from this table.
NAMINGS: Dict[str, Naming] = {
    "pytorch": Naming(dir_format="step_{:08d}", dir_regex=r"^step_(\d{8})$", tracker="latest",
                      tracker_format="step_{:08d}", framework="pytorch"),
    "megatron": Naming(dir_format="iter_{:07d}", dir_regex=r"^iter_(\d{7})$",
                       tracker="latest_checkpointed_iteration.txt", tracker_format="{}", framework="megatron"),
    "deepspeed": Naming(dir_format="global_step{}", dir_regex=r"^global_step(\d+)$", tracker="latest",
                        tracker_format="global_step{}", framework="deepspeed"),
    "transformers": Naming(dir_format="checkpoint-{}", dir_regex=r"^checkpoint-(\d+)$", tracker=None,
                           tracker_format="checkpoint-{}", framework="transformers"),
}


def deepspeed_tag(step: int) -> str:
    """DeepSpeed's tag of ``step`` (its step directory's name, also inside the HF Trainer's checkpoint-N)."""
    return NAMINGS["deepspeed"].dir_name(step)


# DeepSpeed's own file names inside a tag directory (global_stepN/), for the tools that pick its files out of
# a manifest: the model states of a pipeline/tensor rank, and a ZeRO partition's optimizer states
DS_MODEL_STATES = re.compile(r"^(?:(?P<dir>global_step\d+)/)?(?:zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$")
DS_OPTIM_STATES = re.compile(r"^(?:global_step\d+/)?(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")


def staging_name(job_id: str, final_name: str) -> str:
    return f"{STAGING_PREFIX}{job_id}-{final_name}"


def parse_staging(name: str) -> Optional[Tuple[str, str]]:
    """(job id, final name) of a staging directory's name; None for any other name."""
    if not name.startswith(STAGING_PREFIX):
        return None
    job, sep, final = name[len(STAGING_PREFIX):].partition("-")
    return (job, final) if sep and final and _JOB_ID.fullmatch(job) else None


def trash_name(job_id: str, victim: str, pid: int) -> str:
    return f"{TRASH_PREFIX}{job_id}-{victim}-{pid}"


def quarantine_name(final_name: str, stamp: int) -> str:
    return f"{QUARANTINE_PREFIX}{final_name}-{stamp}"


def parse_quarantine(name: str) -> Optional[Tuple[str, int]]:
    """(the step directory's former name, stamp) of a quarantined step's name; None for any other name."""
    m = _QUARANTINE.fullmatch(name)
    return (m.group("final"), int(m.group("stamp"))) if m else None


def claim_name(job_id: str) -> str:
    """On an object store (no staging directory, no rename) the object a job writes first under a step's prefix
    it is writing, deleted by its commit: a prefix with this job's claim and no manifest is this job's
    unfinished step, which its next agent may delete; one without a claim is never ours to delete."""
    return f"{STAGING_PREFIX}{job_id}"


def parse_claim(name: str) -> Optional[str]:
    """The job id of a claim object's name; None for any other name."""
    job = name[len(STAGING_PREFIX):] if name.startswith(STAGING_PREFIX) else ""
    return job if _JOB_ID.fullmatch(job) else None


def own_prefixes(job_id: str) -> Tuple[str, str]:
    """The name prefixes of job ``job_id``'s staging and trash directories: the only ones it may remove."""
    return f"{STAGING_PREFIX}{job_id}-", f"{TRASH_PREFIX}{job_id}-"


def agent_log_name(host: str) -> str:
    """The node agent's stdout/stderr (one per host: a job's agents on many nodes may share the dir)."""
    return f".easyckpt-agent-{host}.log"


SCRATCH_KINDS = ("universal", "processor", "resume", "adapter", "merged", "restore", "best")


def scratch_name(kind: str, job_id: str, rank: Optional[int] = None) -> str:
    """A job's scratch directory for a framework call that only speaks in paths: ``universal`` (DeepSpeed's
    converted copy), ``processor`` (the HF processor's save_pretrained), ``resume`` (per rank: the Trainer's
    trainer_state.json), ``adapter`` and ``merged`` (easyckpt convert --base-model: PEFT's adapter folder, the
    merged model's save_pretrained), ``restore`` (per rank: an object store's step copied for a reader that opens
    paths: Megatron's, DCP's, DeepSpeed's), ``best`` (per rank: the Trainer's best checkpoint copied from an object
    store for its load_best_model_at_end).
    Job and rank in the name: two jobs or ranks never share one."""
    if kind not in SCRATCH_KINDS:
        raise ValueError(f"unknown scratch kind {kind!r}")
    return f".easyckpt-{kind}-{job_id}" + ("" if rank is None else f"-r{rank}")


def marker_name(rank: int) -> str:
    return f"{MARKER_PREFIX}{rank:05d}{MARKER_SUFFIX}"


def parse_marker(name: str) -> Optional[int]:
    """The rank of a per-rank marker's name; None for any other name."""
    m = _MARKER.fullmatch(name)
    return int(m.group(1)) if m else None
