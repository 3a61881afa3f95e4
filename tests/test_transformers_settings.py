"""TrainerWrapper and EasyCkptCallback take every adapter's keywords, reconciled with the Trainer's own arguments,
and refuse a wrong one when they are built (real Trainers around a tiny GPT-2; nothing is trained here but
the one run that proves two wrappers of one Trainer train in turn). Wrapping twice fails when built."""
from __future__ import annotations

import inspect
import os
import sys
import textwrap

import pytest
import torch
from harness import events, run, wait_no_agent

from easyckpt import Config, ConfigError
from easyckpt.config import ADVANCED
from easyckpt.errors import UnknownSettingError

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64}


def trainer(out, callbacks=None, **args):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    targs = TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=4, **args)
    return Trainer(model=GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)), args=targs,
                   train_dataset=Tokens(), eval_dataset=Tokens(), callbacks=callbacks)


def build(form, out, easyckpt, **args):
    """Attach easyckpt to a Trainer in ``form``; returns what was built (its errors come from this call)."""
    from easyckpt.transformers import EasyCkptCallback, TrainerWrapper
    if form == "wrapper":
        return TrainerWrapper(trainer(out, **args), **easyckpt)
    callback = EasyCkptCallback(**easyckpt)
    trainer(out, callbacks=[callback], **args)
    return callback


FORMS = ["wrapper", "callback"]
BEST = dict(save_strategy="best", eval_strategy="steps", eval_steps=2, metric_for_best_model="loss")

AGREE = [
    ({}, {}),
    ({"save_steps": 7}, {"save_storage_interval": 7}),
    ({"save_total_limit": 3}, {"max_ckpt_num": 3}),
    ({}, {"max_ckpt_num": None}),                      # save_total_limit=None keeps every checkpoint
    ({}, {"save_dir": "OUT"}),
    ({"save_steps": 7, "save_total_limit": 2}, {"config": ("OUT", 7, 2)}),
    ({"save_steps": 7}, {"config": ("OUT", 5, 5)}),    # a Config's defaults stand for "not given"
]

CONFLICT = [
    ({"save_steps": 7}, {"save_storage_interval": 5},
     r"save_storage_interval=5 but the Trainer's save_steps=7: .* set TrainingArguments\(save_steps=5\), or leave "
     r"save_storage_interval out"),
    ({"save_strategy": "epoch"}, {"save_storage_interval": 5},
     r"save_storage_interval=5 has no equivalent with the Trainer's save_strategy='epoch' \(it saves at the end of "
     r"each epoch\); to persist every 5 steps set TrainingArguments\(save_strategy='steps', save_steps=5\)"),
    ({"save_strategy": "no"}, {"save_storage_interval": 5}, r"save_strategy='no' \(it saves nothing\)"),
    (BEST, {"save_storage_interval": 2}, r"save_strategy='best' \(it saves when the evaluation metric improves\)"),
    ({}, {"max_ckpt_num": 2}, r"max_ckpt_num=2 but the Trainer's save_total_limit=None \(keeps every checkpoint\): "
                              r".* set TrainingArguments\(save_total_limit=2\), or leave max_ckpt_num out"),
    ({"save_total_limit": 3}, {"max_ckpt_num": None}, r"set TrainingArguments\(save_total_limit=None\)"),
    ({}, {"save_dir": "ELSEWHERE"}, r"save_dir='.*elsewhere' is not the Trainer's output_dir='.*out': .* set "
                                    r"TrainingArguments\(output_dir='.*elsewhere'\), or leave save_dir out"),
    ({"save_steps": 7}, {"config": ("OUT", 4, 5)}, r"config.save_storage_interval=4 but the Trainer's save_steps=7"),
    ({}, {"config": ("ELSEWHERE", 5, 5)}, r"config.save_dir='.*elsewhere' is not the Trainer's output_dir"),
    # an object store is the one save_dir beside output_dir; another scheme is refused, naming s3://
    ({}, {"save_dir": "hdfs://bucket/run"}, r"save_dir='hdfs://bucket/run'.* reached through s3://"),
    # accepted as a save_dir, and checked at once: a store that does not answer is refused when built
    ({}, {"save_dir": "s3://bucket/run", "endpoint_url": "http://127.0.0.1:9"}, r"127.0.0.1:9"),
]


@pytest.mark.parametrize("form", FORMS)
def test_an_object_store_as_output_dir_is_refused_naming_save_dir(tmp_path, monkeypatch, form):
    monkeypatch.chdir(tmp_path)     # the Trainer makes its output_dir, here ./s3:/bucket/out, before easyckpt sees it
    with pytest.raises(ConfigError, match=r"output_dir='s3://bucket/out'\): the Trainer writes its logs and runs to "
                                          r"output_dir, a local directory; .* give save_dir='s3://bucket/prefix'"):
        build(form, "s3://bucket/out", {})


def keywords(tmp_path, easyckpt):
    paths = {"OUT": str(tmp_path / "out"), "ELSEWHERE": str(tmp_path / "elsewhere")}
    out = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in easyckpt.items()}
    if "config" in out:
        save_dir, interval, limit = out["config"]
        out["config"] = Config(save_dir=paths[save_dir], save_storage_interval=interval, max_ckpt_num=limit)
    return out


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("args,easyckpt", AGREE)
def test_keywords_that_agree_with_the_trainers_arguments_are_accepted(tmp_path, form, args, easyckpt):
    built = build(form, tmp_path / "out", keywords(tmp_path, easyckpt), **args)
    assert built.engine is None            # nothing starts before train()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("args,easyckpt,message", CONFLICT)
def test_a_keyword_that_conflicts_with_the_trainer_is_refused_when_built_naming_the_argument_to_set(
        tmp_path, form, args, easyckpt, message):
    with pytest.raises(ConfigError, match=message) as err:
        build(form, tmp_path / "out", keywords(tmp_path, easyckpt), **args)
    assert str(err.value).startswith("TrainerWrapper: " if form == "wrapper" else "EasyCkptCallback: ")


BAD = [
    ({"save_mem_interval": 0}, r"save_mem_interval=0 must be at least 1"),
    ({"save_mem_interval": "2"}, r"save_mem_interval='2' must be a positive integer"),
    ({"save_storage_interval": -5}, r"save_storage_interval=-5 must be at least 1"),
    ({"max_ckpt_num": 0}, r"max_ckpt_num=0 must be a positive integer"),
    ({"grace_deadline": -1}, r"grace_deadline=-1 must be a positive number of seconds"),
    ({"agent_idle_timeout": 0}, r"agent_idle_timeout=0 must be a positive number of seconds"),
    ({"exit_after_ondemand_checkpoint": "yes"}, r"exit_after_ondemand_checkpoint='yes' must be True or False"),
    ({"snapshot_overlap": 1}, r"snapshot_overlap=1 must be True, False or None"),
    ({"config": "cfg"}, r"config='cfg' must be an easyckpt.Config"),
    ({"config": "CONFIG", "grace_deadline": 5}, r"config= and also \['grace_deadline'\]"),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("easyckpt,message", BAD)
def test_a_wrong_value_is_refused_when_built(tmp_path, form, easyckpt, message):
    from easyckpt.transformers import EasyCkptCallback, TrainerWrapper
    if easyckpt.get("config") == "CONFIG":
        easyckpt = dict(easyckpt, config=Config(save_dir=str(tmp_path / "out")))
    t = trainer(tmp_path / "out")
    with pytest.raises(ConfigError, match=message):
        # the callback needs no Trainer to check its values: its own construction refuses them
        TrainerWrapper(t, **easyckpt) if form == "wrapper" else EasyCkptCallback(**easyckpt)
    with pytest.raises(UnknownSettingError, match=r"'save_dri' \(did you mean 'save_dir'\?\)"):
        TrainerWrapper(t, save_dri=".") if form == "wrapper" else EasyCkptCallback(save_dri=".")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name,meant", [("output_dir", "save_dir"), ("save_total_limit", "max_ckpt_num"),
                                        ("save_steps", "save_storage_interval"),
                                        ("save_mem_intervall", "save_mem_interval")])
def test_an_unknown_keyword_is_refused_naming_the_setting_meant(tmp_path, form, name, meant):
    """The Trainer's and other checkpointers' names for a setting (output_dir) are too far from easyckpt's for a
    spelling match: each is refused with the keyword it stands for."""
    from easyckpt.transformers import EasyCkptCallback, TrainerWrapper
    with pytest.raises(UnknownSettingError, match=rf"'{name}' \(did you mean '{meant}'\?"):
        TrainerWrapper(trainer(tmp_path / "out"), **{name: 1}) if form == "wrapper" else EasyCkptCallback(**{name: 1})


@pytest.mark.parametrize("form", FORMS)
def test_a_read_only_output_dir_is_refused_as_output_dir_not_as_save_dir(tmp_path, form):
    """The user set output_dir, not save_dir: the error names the setting to change."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if run_quiet(["mount", "--bind", "-o", "ro", str(ro), str(ro)]) != 0:
        pytest.skip("cannot make a read-only bind mount here (needs root): read-only case not exercised")
    try:
        with pytest.raises(ConfigError) as err:
            build(form, ro, {})
        assert "output_dir=" in str(err.value) and "save_dir" not in str(err.value), str(err.value)
        assert "is not writable" in str(err.value) and "choose another output_dir" in str(err.value)
        with pytest.raises(ConfigError, match=r"save_dir='.*' is not writable"):     # given, it is named
            build(form, ro, {"save_dir": str(ro)})
    finally:
        run_quiet(["umount", str(ro)])


def run_quiet(cmd):
    import subprocess
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode


def test_both_forms_take_every_setting_as_a_typed_keyword_with_its_default():
    from easyckpt.transformers import FROM_TRAINER, EasyCkptCallback, TrainerWrapper
    wrapper = dict(inspect.signature(TrainerWrapper).parameters)
    callback = dict(inspect.signature(EasyCkptCallback).parameters)
    assert list(wrapper)[0] == "trainer" and list(wrapper)[1:] == list(callback)
    assert all(str(wrapper[n]) == str(callback[n]) for n in callback)
    named = {n for n, p in callback.items() if p.kind is p.KEYWORD_ONLY}
    assert set(ADVANCED) | {"save_dir", "save_storage_interval", "max_ckpt_num", "config"} <= named
    default = Config(save_dir=".")
    for name in ADVANCED:
        assert callback[name].default == getattr(default, name) and callback[name].annotation not in ("Any", "")
    assert all(callback[n].default is FROM_TRAINER for n in ("save_dir", "save_storage_interval", "max_ckpt_num"))


def test_wrapping_twice_is_refused_when_built(tmp_path):
    from easyckpt.transformers import EasyCkptCallback, TrainerWrapper
    with pytest.raises(ConfigError, match=r"already a TrainerWrapper; wrap the Trainer once"):
        TrainerWrapper(TrainerWrapper(trainer(tmp_path / "a")))
    with pytest.raises(ConfigError, match=r"already has an EasyCkptCallback"):
        TrainerWrapper(trainer(tmp_path / "b", callbacks=[EasyCkptCallback()]))
    shared = EasyCkptCallback()
    trainer(tmp_path / "c", callbacks=[shared])
    with pytest.raises(ConfigError, match=r"already serves another Trainer"):
        trainer(tmp_path / "d", callbacks=[shared])


# a tiny Trainer over output_dir=argv[1], max_steps=argv[2], a checkpoint every step: the scripts below add to it
A_TRAINER = textwrap.dedent("""
    import sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from easyckpt.transformers import EasyCkptCallback, TrainerWrapper

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64}

    args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to=[], max_steps=int(sys.argv[2]),
                             save_steps=1, per_device_train_batch_size=2, disable_tqdm=True)
    t = Trainer(model=GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)), args=args,
                train_dataset=Tokens())
""")
ADDED_LATER = A_TRAINER + textwrap.dedent("""
    t.add_callback(EasyCkptCallback(agent_idle_timeout=2))
    t.train(resume_from_checkpoint=True)
""")


def test_a_callback_added_after_the_trainer_was_built_takes_over_train(tmp_path):
    """trainer.add_callback(EasyCkptCallback()) then train(resume_from_checkpoint=True) on an empty output_dir:
    easyckpt chooses (nothing: from scratch), not the Trainer's "No valid checkpoint found"; a relaunch resumes."""
    out = tmp_path / "out"
    first = run([sys.executable, "-c", ADDED_LATER, str(out), "2"], extra_env={"HF_HUB_OFFLINE": "1"}, timeout=300)
    assert "No valid checkpoint" not in first.stderr + first.stdout
    wait_no_agent(out)
    run([sys.executable, "-c", ADDED_LATER, str(out), "3"], extra_env={"HF_HUB_OFFLINE": "1"}, timeout=300)
    wait_no_agent(out)
    loads = [(e["source"], e["step"]) for e in events(out / "easyckpt.log") if e["event"] == "load"]
    assert loads == [("none", 0), ("storage", 2)], loads
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_train_called_past_the_callback_refuses_to_train(tmp_path):
    """Trainer.train(trainer) goes past the instance's train (the Trainer chose its checkpoint itself): said,
    not trained past."""
    from transformers import Trainer

    from easyckpt.transformers import EasyCkptCallback
    t = trainer(tmp_path / "out", callbacks=[EasyCkptCallback()])
    with pytest.raises(ConfigError, match=r"train\(\) was called past the Trainer's own"):
        Trainer.train(t)
    assert t.state.global_step == 0


SEQUENTIAL = A_TRAINER + textwrap.dedent("""
    first, second = (TrainerWrapper(t, agent_idle_timeout=2) for _ in range(2))
    first.train(resume_from_checkpoint=True)
    t.args.max_steps = 3
    second.train(resume_from_checkpoint=True)
""")


def test_two_wrappers_of_one_trainer_train_in_turn(tmp_path):
    out = tmp_path / "out"
    run([sys.executable, "-c", SEQUENTIAL, str(out), "2"], extra_env={"HF_HUB_OFFLINE": "1"}, timeout=300)
    wait_no_agent(out)
    loads = [(e["source"], e["step"]) for e in events(out / "easyckpt.log") if e["event"] == "load"]
    assert loads[0] == ("none", 0) and loads[1][1] == 2 and loads[1][0] in ("memory", "storage"), loads
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
