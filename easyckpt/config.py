"""The settings of one easyckpt job, and their validation.

Validation happens in ``initialize_easyckpt`` so that a wrong setting fails before the first
iteration, not at step N: every message names the argument and what to change.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import os
import socket
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Mapping,
    Optional,
    Type,
    TypeVar,
    Union,
)

from easyckpt.errors import ConfigError, UnknownSettingError

# the save-dir names (formats/layout.py); re-exported: adapters and settings name them from here
from easyckpt.formats import layout, paths
from easyckpt.formats.layout import NAMINGS, Naming  # noqa: F401
from easyckpt.storage import resolve
from easyckpt.storage.posix import probe_writable

DEFAULT_LOG_NAME = "easyckpt.log"
NO_VALID_CHECKPOINT = ("error", "start_fresh")


class UnsetInterval(int):
    """save_storage_interval's default: 5 wherever a number is read (signatures show it, comparisons see it), and
    the mark that the user did not choose it. Left so, the budget may space the persists further apart
    (engine/save/persistpace.py); a number the user gives, 5 included, is kept exactly."""


STORAGE_DEFAULT = UnsetInterval(5)


def log_setting(value: Any) -> Union[str, bool, None]:
    """An adapter's ``log_file_path`` argument as Config holds it (paths become str)."""
    return value if value is None or isinstance(value, bool) else str(value)


if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")     # the decorator reads the fields of a dataclass


# the names other checkpointers and the Trainer use for easyckpt's settings: too far apart for difflib to match
_ALIASES = {
    "output_dir": ("save_dir", "Under the Trainer it defaults to TrainingArguments(output_dir=...)"),
    "checkpoint_dir": ("save_dir", "The directory checkpoints are committed to"),
    "save_steps": ("save_storage_interval", "Under the Trainer it defaults to TrainingArguments(save_steps=...)"),
    "save_interval": ("save_storage_interval", "Every how many steps a checkpoint reaches storage"),
    "save_total_limit": ("max_ckpt_num", "Under the Trainer it defaults to TrainingArguments(save_total_limit=...)"),
    "keep_last": ("max_ckpt_num", "How many committed checkpoints to keep"),
    "log_file": ("log_file_path", "easyckpt's audit log"),
    "endpoint": ("endpoint_url", "The S3-compatible endpoint of an s3:// save_dir"),
}


def _unknown(where: str, given: Iterable[str], known: Iterable[str]) -> None:
    """UnknownSettingError naming every setting ``where`` does not know, with the nearest known name."""
    known = list(known)
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return
    hints = []
    for name in unknown:
        alias = _ALIASES.get(name)
        near = [alias[0]] if alias is not None and alias[0] in known else difflib.get_close_matches(name, known, n=1)
        why = f" {alias[1]}" if alias is not None and near == [alias[0]] else ""
        hints.append(f"{name!r} (did you mean {near[0]!r}?{why})" if near else repr(name))
    raise UnknownSettingError(f"{where} got unknown setting(s) {', '.join(hints)}; it accepts {known}")


def _refuse_unknown_settings(cls: Type[T]) -> Type[T]:
    """``Config(save_intervall=3)`` names the setting as the verbs do (a ConfigError, still a TypeError),
    instead of the dataclass's bare TypeError."""
    init = cls.__init__
    names = [f.name for f in fields(cls)]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _unknown(cls.__name__, kwargs, names)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def is_url(path: object) -> bool:
    """Whether a path setting is a URL (an object store's, or one validate refuses) rather than a directory; the
    adapters ask here, storage/resolve.py decides."""
    return resolve.is_url(path)


def default_local_dir(job_id: str) -> str:
    """An object-store job's node-local directory when local_dir is not set: ~/.cache/easyckpt/<job id>."""
    return os.path.join(os.path.expanduser("~"), ".cache", "easyckpt", job_id)


@_refuse_unknown_settings
@dataclass(frozen=True)
class Config:
    """Every setting of one job. Build it once and hand it to any adapter (``initialize_easyckpt(config)``,
    ``TrainerWrapper(trainer, config=...)``, ``Checkpointer(config)``); the adapter supplies ``naming``."""

    save_dir: str
    save_mem_interval: int = 1
    # every how many iterations the newest snapshot is persisted too: a number given is kept exactly, never
    # skipped. Left at its default, 5 (rounded up to a multiple of save_mem_interval), spaced further apart while
    # the agent's writing costs the loop more than half of max_overhead (engine/save/persistpace.py)
    save_storage_interval: int = STORAGE_DEFAULT
    max_ckpt_num: Optional[int] = 5
    # the audit log (every snapshot, persist, commit, load and delete): None = SAVE_DIR/easyckpt.log,
    # a path = there, False = off (the data-safety record is on unless asked otherwise)
    log_file_path: Union[str, bool, None] = None
    job_name: Optional[str] = None
    commit_timeout: float = 600.0       # seconds the coordinator waits for every rank's shard
    agent_idle_timeout: float = 60.0    # seconds the agent keeps snapshots after its trainers died
    agent_start_timeout: float = 60.0
    # SIGTERM (preemption, maintenance): all ranks agree on a step at the next safe point, save and
    # commit it; then exit (exit_after_ondemand_checkpoint) or train on. grace_deadline: seconds from the
    # signal until the machine is expected to go (Cloud TPU: up to 5 minutes); when the trainers cannot
    # reach a safe point by then, the node agent persists their newest complete snapshot itself.
    autocheckpoint_on_sigterm: bool = True
    exit_after_ondemand_checkpoint: bool = False
    grace_deadline: float = 300.0
    # copy the tensors the optimizer owns while the next forward/backward runs (engine/save/overlap.py);
    # None = auto: when they are on a GPU, or when the CPU has a core the training does not compute on
    snapshot_overlap: Optional[bool] = None
    # the share of step time memory snapshots may cost the training loop (measured: step time with and
    # without one); the snapshot is then taken every k-th save_mem_interval, the loss bound said on the
    # console (engine/save/budget.py). None: a snapshot on every save_mem_interval, whatever it costs
    max_overhead: Optional[float] = 0.02
    # the agent writes checkpoint files with O_DIRECT (around the page cache) where the file system
    # allows it, plain writes elsewhere; False: always plain writes (storage/direct.py says why)
    direct_io: bool = True
    # peer replicas (agent/replicas.py), in jobs of several nodes: each node's newest snapshot is also
    # held in the memory of replication_factor - 1 other nodes (1: none), node i's on nodes i + jump,
    # i + 2*jump, ...; every replica_interval-th snapshot is sent, at replica_bandwidth bytes/s at most
    # (0: no cap), pausing while a snapshot is being copied
    replication_factor: int = 2
    replication_jump: int = 1
    replica_interval: int = 1
    replica_bandwidth: float = 1e9
    # committed steps of this job exist and no rank can restore any of them (each corrupt or incompatible):
    # "error" stops before training, listing each with its verdict; "start_fresh" sets them aside
    # (quarantined-<name>-<stamp>, kept whole) and trains from the beginning, never reusing their names
    on_no_valid_checkpoint: str = "error"
    # an S3-compatible store's endpoint for an s3:// save_dir (None: AWS_ENDPOINT_URL or the AWS config files,
    # else AWS itself); credentials come from where boto3 looks (AWS_ACCESS_KEY_ID..., ~/.aws/credentials)
    endpoint_url: Optional[str] = None
    # a node-local directory for what belongs to this node, not to the checkpoints: the audit log, the agent's
    # log and the job lock. None: the save dir itself, or for an s3:// save_dir ~/.cache/easyckpt/<job id>
    local_dir: Optional[str] = None
    # a fast tier on this node's disk (agent/localtier.py): every save_local_interval-th step (a multiple of
    # save_mem_interval; None: no tier) each rank's snapshot is also written under node_dir, where it outlives
    # the agent and the node's memory; the loader takes it when it is the newest state every rank has there.
    # The newest max_local_ckpt_num steps stay
    save_local_interval: Optional[int] = None
    max_local_ckpt_num: int = 2
    naming: Naming = field(default_factory=Naming)

    @property
    def job_id(self) -> str:
        """Stable across restarts of the same job (same save dir and job name), so that a restarted
        trainer finds its agent and its shared-memory snapshots again."""
        where = self.save_dir.rstrip("/") if self.in_store else os.path.realpath(self.save_dir)
        key = f"{where}\0{self.job_name or ''}"
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    @property
    def in_store(self) -> bool:
        """Whether save_dir is an object store's URL (s3://bucket/prefix; storage/resolve.py's schemes)."""
        return resolve.is_store_url(self.save_dir)

    @property
    def node_dir(self) -> str:
        """Where this node's own files go (audit log, agent log, job lock): local_dir, else the save dir, or for
        an object store a directory under ~/.cache/easyckpt named after the job."""
        if self.local_dir:
            return str(self.local_dir)
        return default_local_dir(self.job_id) if self.in_store else self.save_dir

    @property
    def audit_log(self) -> Optional[str]:
        """Where the audit log goes, or None when it is off."""
        if self.log_file_path is False:
            return None
        if self.log_file_path is None or self.log_file_path is True:
            return os.path.join(self.node_dir, DEFAULT_LOG_NAME)
        return str(self.log_file_path)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Config":
        data = dict(data)
        naming = dict(data["naming"])
        data["naming"] = Naming(**naming)
        return cls(**data)


# the keyword arguments every adapter's initialize_easyckpt accepts besides its own
ADVANCED = ("job_name", "commit_timeout", "agent_idle_timeout", "agent_start_timeout",
            "autocheckpoint_on_sigterm", "exit_after_ondemand_checkpoint", "grace_deadline",
            "snapshot_overlap", "max_overhead", "direct_io", "replication_factor", "replication_jump", "replica_interval",
            "replica_bandwidth", "on_no_valid_checkpoint", "endpoint_url", "local_dir", "save_local_interval",
            "max_local_ckpt_num")


def check_advanced(verb: str, advanced: Mapping[str, Any]) -> None:
    """UnknownSettingError naming any keyword of ``advanced`` that is no setting."""
    _unknown(verb, advanced, ADVANCED)


def adapter_config(verb: str, naming: Naming, config: Optional[Config], settings: Mapping[str, Any],
                   advanced: Mapping[str, Any]) -> Config:
    """The Config of an adapter's ``initialize_easyckpt``: ``config`` when one is given (with the adapter's
    naming: the framework decides its layout), else one built from the verb's keywords ``settings`` and
    ``advanced``. A config together with a keyword that is not at its default is refused, naming it:
    which of the two should win would be a guess."""
    check_advanced(verb, advanced)
    if config is None:
        built = dict(settings, log_file_path=log_setting(settings.get("log_file_path")))
        if built.get("save_dir") is not None:
            built["save_dir"] = str(built["save_dir"])
        return Config(naming=naming, **built, **advanced)
    if not isinstance(config, Config):
        raise ConfigError(f"{verb}: config={config!r} must be an easyckpt.Config")
    defaults = {f.name: None if f.default is MISSING else f.default for f in fields(Config)}
    both = sorted([k for k, v in settings.items() if v != defaults.get(k)] + list(advanced))
    if both:
        raise ConfigError(f"{verb} got config= and also {both}: set them in the Config "
                          f"(dataclasses.replace(config, ...)) and pass only config=")
    return replace(config, naming=naming)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be a positive integer (number of iterations)")
    if value < 1:
        raise ConfigError(f"{name}={value} must be at least 1")
    return value


def storage_unset(cfg: Config) -> bool:
    """Whether save_storage_interval was left at its default (the budget may then pace the persists)."""
    return isinstance(cfg.save_storage_interval, UnsetInterval)


def storage_interval(cfg: Config) -> int:
    """Every how many iterations the storage persists start: save_storage_interval as given, or where it was left
    at its default 5, rounded up to a multiple of save_mem_interval (5 is not one of 2: only snapshots persist)."""
    if not storage_unset(cfg):
        return cfg.save_storage_interval
    mem = cfg.save_mem_interval if isinstance(cfg.save_mem_interval, int) and cfg.save_mem_interval > 0 else 1
    return mem * -(-int(cfg.save_storage_interval) // mem)


def check_values(cfg: Config) -> None:
    """validate() without the file system: the types and ranges of every setting but save_dir."""
    mem = _positive_int("save_mem_interval", cfg.save_mem_interval)
    sto = _positive_int("save_storage_interval", storage_interval(cfg))
    if sto % mem:
        lower, upper = (sto // mem) * mem, (sto // mem + 1) * mem
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ConfigError(
            f"save_storage_interval={sto} is not a multiple of save_mem_interval={mem}: only memory "
            f"snapshots can be persisted; use save_storage_interval={hint}")
    if cfg.save_local_interval is not None:
        local = _positive_int("save_local_interval", cfg.save_local_interval)
        if local % mem:
            raise ConfigError(f"save_local_interval={local} is not a multiple of save_mem_interval={mem}: only memory "
                              f"snapshots go to the local tier; use save_local_interval={(local // mem + 1) * mem}")
    for name in ("replication_factor", "replication_jump", "replica_interval", "max_local_ckpt_num"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer"
                              + (" (1: no replicas on other nodes)" if name == "replication_factor" else ""))
    bw = cfg.replica_bandwidth
    if isinstance(bw, bool) or not isinstance(bw, (int, float)) or bw < 0:
        raise ConfigError(f"replica_bandwidth={bw!r} must be a number of bytes per second (0: no cap)")
    if cfg.max_ckpt_num is not None:
        if isinstance(cfg.max_ckpt_num, bool) or not isinstance(cfg.max_ckpt_num, int) or cfg.max_ckpt_num < 1:
            raise ConfigError(f"max_ckpt_num={cfg.max_ckpt_num!r} must be a positive integer "
                              f"(how many committed checkpoints to keep), or None to keep all")
    for name in ("autocheckpoint_on_sigterm", "exit_after_ondemand_checkpoint", "direct_io"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name}={getattr(cfg, name)!r} must be True or False")
    if cfg.on_no_valid_checkpoint not in NO_VALID_CHECKPOINT:
        raise ConfigError(f"on_no_valid_checkpoint={cfg.on_no_valid_checkpoint!r} must be one of "
                          f"{', '.join(map(repr, NO_VALID_CHECKPOINT))}")
    if cfg.snapshot_overlap is not None and not isinstance(cfg.snapshot_overlap, bool):
        raise ConfigError(f"snapshot_overlap={cfg.snapshot_overlap!r} must be True, False or None (auto)")
    budget = cfg.max_overhead
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not 0 < budget <= 1):
        raise ConfigError(f"max_overhead={budget!r} must be a share of step time above 0 and at most 1 (0.02 = "
                          f"2 %), or None to snapshot on every save_mem_interval whatever it costs")
    for name in ("commit_timeout", "agent_idle_timeout", "agent_start_timeout", "grace_deadline"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive number of seconds")
    if cfg.log_file_path is not None and not isinstance(cfg.log_file_path, (bool, str)):
        raise ConfigError(f"log_file_path={cfg.log_file_path!r} must be a path, None (SAVE_DIR/{DEFAULT_LOG_NAME}) "
                          f"or False (no audit log)")


def validate(cfg: Config, names: Optional[Mapping[str, str]] = None) -> Config:
    """Check every setting and prepare the save directory; raise ConfigError naming the fix. ``names``: how a
    message names ``save_dir`` / ``local_dir`` where the user set them as something else (the Trainer's
    output_dir): the setting to change is the one the user wrote."""
    names = names or {}
    check_values(cfg)
    if not cfg.save_dir or not isinstance(cfg.save_dir, (str, os.PathLike)):
        raise ConfigError(f"save_dir={cfg.save_dir!r} must be a directory path")
    for name in ("endpoint_url", "local_dir"):
        if getattr(cfg, name) is not None and not isinstance(getattr(cfg, name), str):
            raise ConfigError(f"{name}={getattr(cfg, name)!r} must be a string or None")
    if cfg.in_store:
        _check_store(cfg)
    elif resolve.is_url(cfg.save_dir):
        # (without this, "xy://bucket/ckpt" would become a local directory named "xy:")
        raise ConfigError(f"save_dir={str(cfg.save_dir)!r} is a URL easyckpt cannot write: object stores are "
                          f"reached through {', '.join(resolve.schemes())} (s3://: an S3-compatible endpoint, "
                          f"endpoint_url=...); else give a local or network file system directory")
    if not cfg.in_store:
        _check_dir(names.get("save_dir", "save_dir"), cfg.save_dir)
    if cfg.node_dir != cfg.save_dir:
        _check_dir(names.get("local_dir", "local_dir"), cfg.node_dir)
    _check_own_files(cfg)
    if cfg.audit_log is not None:
        log = Path(cfg.audit_log)
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            os.close(paths.open_own(str(log), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        except OSError as exc:
            raise ConfigError(f"log_file_path={str(log)!r} cannot be appended to ({exc.strerror or exc}; a symlink is "
                              f"never followed, nor a file of another user); choose a writable path, or False for "
                              f"no audit log") from exc
    return cfg


def existing_files(directories: Iterable[str]) -> Dict[str, FrozenSet[str]]:
    """The names in the directories a job will write to, noted before ``validate`` prepares them, for
    ``take_back`` (storage/firstfiles.py)."""
    from easyckpt.storage import firstfiles
    return firstfiles.existing(directories)


def take_back(cfg: Config, before: Mapping[str, FrozenSet[str]]) -> List[str]:
    """``validate``'s counterpart for a run that failed before its first snapshot, once its trainers have said
    bye: the job's own files this run made (audit log, agent log, job lock) are removed (storage/firstfiles.py)."""
    from easyckpt.storage import firstfiles
    from easyckpt.storage.joblock import LOCK_NAME, JobLock

    if cfg.in_store:          # the lock is a lease object in the store, not a file here: nothing is taken back
        return []
    files = [os.path.join(cfg.node_dir, layout.agent_log_name(socket.gethostname())),
             os.path.join(cfg.save_dir, LOCK_NAME)] + _audit_logs(cfg)
    return firstfiles.take_back(files, JobLock(cfg.save_dir, cfg.job_id, cfg.job_name), before)


def _audit_logs(cfg: Config) -> List[str]:
    """The audit log and the history log beside it (storage/auditlog.py), when the audit log is on."""
    from easyckpt.storage.auditlog import history_path
    return [cfg.audit_log, history_path(cfg.audit_log)] if cfg.audit_log else []


def _check_own_files(cfg: Config) -> None:
    """The files easyckpt keeps beside the steps, as far as they exist: each a regular file, and the ones it
    appends to or locks its own user's, that no one else can write (docs/reliability.md promise 15). Refused
    here, naming the file, what it is and its owner, rather than found out mid-run: a directory planted as the
    lock let a second job run beside the first, one as the agent's log kept the agent from starting. The
    damaged record and the tracker of another user are only hints: read, they are refused and said (SaveDir)."""
    from easyckpt.storage.joblock import LOCK_NAME

    # (the audit log itself is checked where it is opened, with log_file_path's own error; the history log is
    # opened only at its first line, so it is checked here)
    history = _audit_logs(cfg)[1:]
    node_files = [os.path.join(cfg.node_dir, layout.agent_log_name(socket.gethostname()))] + history
    hints = []
    if not cfg.in_store:
        node_files.append(os.path.join(cfg.save_dir, LOCK_NAME))
        hints = [os.path.join(cfg.save_dir, name) for name in (layout.DAMAGED_NAME, cfg.naming.tracker) if name]
    for path in node_files + hints:
        problem = paths.describe(path, own=path in node_files)
        if problem is not None:
            raise ConfigError(problem)


def _check_store(cfg: Config) -> None:
    """An object store's save_dir: its client library installed, a well-formed URL, and the bucket reachable with
    these credentials (the back-end's ``check`` names what to fix), before anything trains."""
    resolve.set_endpoint(cfg.endpoint_url)
    try:
        resolve.storage_for(cfg.save_dir).check(cfg.save_dir)
    except ConfigError:
        raise
    except ValueError as exc:      # the URL is malformed
        raise ConfigError(f"save_dir: {exc}") from None


def _check_dir(name: str, where: str) -> None:
    """A directory of ours: made if missing, and writable."""
    save_dir = Path(where)
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{name}={str(save_dir)!r} does not exist and cannot be created "
                          f"({exc.strerror}); create it or point {name} at a writable location") from exc
    if not save_dir.is_dir():
        raise ConfigError(f"{name}={str(save_dir)!r} is not a directory")
    try:
        probe_writable(save_dir)
    except OSError as exc:
        raise ConfigError(f"{name}={str(save_dir)!r} is not writable ({exc.strerror}); "
                          f"fix its permissions or mount, or choose another {name}") from exc
