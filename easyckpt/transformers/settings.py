"""easyckpt's settings under the Hugging Face Trainer: the keywords every adapter takes, reconciled with the
TrainingArguments that already mean the same thing.

The Trainer has three of easyckpt's settings, and keeps deciding them:

    save_dir               = output_dir        checkpoint-N go there (or to an object store, s3://bucket/prefix,
                                               given as save_dir: output_dir stays local for the Trainer's logs)
    save_storage_interval  = save_steps        only with save_strategy="steps" ("epoch", "best", "no": none)
    max_ckpt_num           = save_total_limit  None (or <= 0): every checkpoint stays

A keyword (or, in a Config, a value that is not the Config's default) that agrees is accepted; one that
disagrees, or has no equivalent, is refused with a ConfigError naming the TrainingArguments field to set.
``resolve`` is called when TrainerWrapper / EasyCkptCallback is attached to a Trainer and again at every
``train()``, since the arguments may change in between.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, Literal, Mapping, Optional

from easyckpt.config import (
    ADVANCED,
    Config,
    _positive_int,
    _unknown,
    adapter_config,
    check_values,
    is_url,
    validate,
)
from easyckpt.errors import ConfigError
from easyckpt.transformers.session import NAMING

if TYPE_CHECKING:
    from transformers import TrainingArguments


class _FromTrainer(enum.Enum):
    FROM_TRAINER = "from the TrainingArguments"

    def __repr__(self) -> str:
        return "<from the TrainingArguments>"


FROM_TRAINER = _FromTrainer.FROM_TRAINER
"""The default of save_dir, save_storage_interval and max_ckpt_num under the Trainer: its own argument decides."""
FromTrainer = Literal[_FromTrainer.FROM_TRAINER]

# every setting's default, for the signatures (the values are Config's, written once there)
DEFAULT = Config(save_dir=".")
PARITY = ("save_dir", "save_storage_interval", "max_ckpt_num")
_WHY_NOT = {"epoch": "it saves at the end of each epoch", "best": "it saves when the evaluation metric improves",
            "no": "it saves nothing"}


@dataclass(frozen=True)
class Settings:
    """What TrainerWrapper or EasyCkptCallback was given, checked as far as it can be without a Trainer."""

    verb: str
    base: Config                     # save_dir, save_storage_interval, max_ckpt_num: set by resolve()
    parity: Mapping[str, Any]        # the given ones of PARITY, each to agree with its TrainingArguments field
    labels: Mapping[str, str]        # how a message names each: "max_ckpt_num" or "config.max_ckpt_num"


def settings(verb: str, config: Optional[Config], unknown: Mapping[str, Any], **given: Any) -> Settings:
    """The adapter's keywords (``given``: every parameter of its signature) as Settings: unknown keywords,
    config together with keywords and wrong values are refused now, before any Trainer is involved."""
    _unknown(verb, unknown, [*given, "config"])     # named, with the nearest setting
    advanced = {k: given[k] for k in ADVANCED if given[k] != getattr(DEFAULT, k)}
    own = dict(save_mem_interval=given["save_mem_interval"], log_file_path=given["log_file_path"])
    parity = {k: given[k] for k in PARITY if given[k] is not FROM_TRAINER}
    if config is None:
        base = adapter_config(verb, NAMING, None, dict(own, save_dir="."), advanced)
        labels = {k: k for k in PARITY}
    else:
        base = adapter_config(verb, NAMING, config, dict(own, **parity), advanced)
        # a Config always holds all three: its defaults stand for "not given", save_dir is always given
        parity = {k: getattr(config, k) for k in PARITY
                  if k == "save_dir" or getattr(config, k) != getattr(DEFAULT, k)}
        labels = {k: f"config.{k}" for k in PARITY}
    if "save_storage_interval" in parity:
        _positive_int(labels["save_storage_interval"], parity["save_storage_interval"])
    limit = parity.get("max_ckpt_num")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"{verb}: {labels['max_ckpt_num']}={limit!r} must be a positive integer (how many "
                          f"checkpoint-N to keep), or None to keep all")
    if "save_dir" in parity and not isinstance(parity["save_dir"], (str, os.PathLike)):
        raise ConfigError(f"{verb}: {labels['save_dir']}={parity['save_dir']!r} must be a directory path")
    # types and ranges now; the directory when a Trainer names it (resolve)
    check_values(replace(base, save_storage_interval=base.save_mem_interval))
    return Settings(verb, base, parity, labels)


def trainer_limit(args: "TrainingArguments") -> Optional[int]:
    """How many checkpoint-N the Trainer keeps (None: all)."""
    limit = args.save_total_limit
    return limit if limit and limit > 0 else None


def resolve(s: Settings, args: "TrainingArguments") -> Config:
    """The job's Config for a Trainer with these arguments; ConfigError naming the TrainingArguments field to
    set where a given setting disagrees with it. Prepares the save directory (validate)."""
    output_dir = str(args.output_dir)
    verb, labels = s.verb, s.labels
    if is_url(output_dir):
        raise ConfigError(f"{verb}: TrainingArguments(output_dir={output_dir!r}): the Trainer writes its logs and "
                          f"runs to output_dir, a local directory; for checkpoints in an object store keep a local "
                          f"output_dir and give {labels['save_dir']}='s3://bucket/prefix' beside it")
    save_dir, local_dir = output_dir, s.base.local_dir
    if "save_dir" in s.parity:
        given = str(s.parity["save_dir"])
        if is_url(given):      # an object store (validate refuses a scheme it does not serve): checkpoint-N go there,
            # the Trainer's logs, runs and this node's own files (audit log, agent log) stay in output_dir
            save_dir, local_dir = given, local_dir or output_dir
        elif os.path.realpath(given) != os.path.realpath(output_dir):
            raise ConfigError(f"{verb}: {labels['save_dir']}={given!r} is not the Trainer's output_dir="
                              f"{output_dir!r}: the Trainer writes checkpoint-N to output_dir; set "
                              f"TrainingArguments(output_dir={given!r}), or leave {labels['save_dir']} out (an "
                              f"object store, s3://bucket/prefix, is the one save_dir beside output_dir)")
    if "save_storage_interval" in s.parity:
        n, name = s.parity["save_storage_interval"], labels["save_storage_interval"]
        strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
        if strategy != "steps":
            raise ConfigError(f"{verb}: {name}={n} has no equivalent with the Trainer's save_strategy={strategy!r} "
                              f"({_WHY_NOT.get(strategy, 'it does not save every N steps')}); to persist every "
                              f"{n} steps set TrainingArguments(save_strategy='steps', save_steps={n}), or "
                              f"leave {name} out")
        if args.save_steps != n:
            raise ConfigError(f"{verb}: {name}={n} but the Trainer's save_steps={args.save_steps}: the Trainer "
                              f"decides which steps reach storage; set TrainingArguments(save_steps={n}), or "
                              f"leave {name} out")
    limit = trainer_limit(args)
    if "max_ckpt_num" in s.parity and s.parity["max_ckpt_num"] != limit:
        m, name = s.parity["max_ckpt_num"], labels["max_ckpt_num"]
        keeps = "keeps every checkpoint" if limit is None else f"keeps {limit}"
        raise ConfigError(f"{verb}: {name}={m!r} but the Trainer's save_total_limit={args.save_total_limit!r} "
                          f"({keeps}): the Trainer decides how many checkpoint-N stay; set "
                          f"TrainingArguments(save_total_limit={m!r}), or leave {name} out")
    # the Trainer's save points decide what is persisted (save_now); the checkpointer's own storage interval
    # goes unused and only has to be a multiple of the memory interval
    # a directory the user gave only as the Trainer's output_dir is named so, not as the save_dir it stands for
    names = {} if "save_dir" in s.parity else {"save_dir": "output_dir"}
    if local_dir == output_dir and not s.base.local_dir:
        names["local_dir"] = "output_dir"
    try:
        return validate(replace(s.base, save_dir=save_dir, local_dir=local_dir, max_ckpt_num=limit,
                                save_storage_interval=s.base.save_mem_interval), names)
    except ConfigError as exc:      # (a directory that cannot be made, a store that does not answer) said as ours
        if str(exc).startswith(f"{verb}: "):
            raise
        raise ConfigError(f"{verb}: {exc}") from None


def signature_keywords(local: Dict[str, Any]) -> Dict[str, Any]:
    """A constructor's own parameters out of its ``locals()``: each is listed only in its signature (the two
    signatures, TrainerWrapper's and EasyCkptCallback's, are held equal by a test)."""
    return {k: v for k, v in local.items() if k not in ("self", "trainer", "config", "unknown", "__class__")}
