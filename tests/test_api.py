"""The public surface: one Checkpointer built from a Config behind every adapter, every adapter's verbs
also taking a Config, unknown settings named as ConfigErrors, one exception hierarchy, and adapters that
hold no file I/O and import neither each other nor the agent or storage side."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import wait_no_agent

import easyckpt
from easyckpt import CheckpointError, Config, ConfigError, EasyCkptError
from easyckpt.errors import UnknownSettingError

ROOT = Path(__file__).resolve().parent.parent
ADAPTERS = ["easyckpt/pytorch.py", "easyckpt/deepspeed/__init__.py", "easyckpt/transformers/__init__.py", "easyckpt/transformers/session.py",
            "easyckpt/transformers/settings.py",
            *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "easyckpt" / "megatron").glob("*.py"))]


# ---- settings -------------------------------------------------------------------------------------

def test_unknown_setting_of_config_is_a_config_error_naming_it_and_the_nearest_one(tmp_path):
    with pytest.raises(ConfigError, match=r"'save_intervall' \(did you mean 'save_mem_interval'\?\)|"
                                          r"'save_intervall' \(did you mean 'save_storage_interval'\?\)"):
        Config(save_dir=str(tmp_path), save_intervall=3)


@pytest.mark.parametrize("verb", ["pytorch", "deepspeed", "megatron", "transformers"])
def test_unknown_keyword_of_every_adapter_is_a_config_error_naming_it(tmp_path, verb):
    with pytest.raises(UnknownSettingError, match="grace_deadlin") as err:
        if verb == "pytorch":
            easyckpt.initialize_easyckpt(str(tmp_path), grace_deadlin=3)
        elif verb == "deepspeed":
            import easyckpt.deepspeed as eds
            eds.initialize_easyckpt(str(tmp_path), grace_deadlin=3)
        elif verb == "megatron":
            import easyckpt.megatron as em
            em.initialize_easyckpt(save_dir=str(tmp_path), grace_deadlin=3)
        else:
            from easyckpt.transformers import TrainerWrapper
            TrainerWrapper(object(), grace_deadlin=3)
    assert isinstance(err.value, ConfigError) and isinstance(err.value, TypeError)
    assert "did you mean 'grace_deadline'" in str(err.value)


def test_config_together_with_a_keyword_names_the_keyword(tmp_path):
    import easyckpt.deepspeed as eds
    with pytest.raises(ConfigError, match=r"config= and also \['max_ckpt_num', 'snapshot_overlap'\]"):
        eds.initialize_easyckpt(config=Config(save_dir=str(tmp_path)), max_ckpt_num=2, snapshot_overlap=False)


def test_trainer_wrapper_takes_a_config_and_refuses_one_for_another_directory(tmp_path):
    from easyckpt.transformers import TrainerWrapper
    trainer = SimpleNamespace(args=SimpleNamespace(save_total_limit=None, output_dir=str(tmp_path / "out")))
    wrapped = TrainerWrapper(trainer, config=Config(save_dir=str(tmp_path / "out"), save_mem_interval=2))
    base = wrapped._attached.settings.base
    assert base.save_mem_interval == 2 and base.naming.framework == "transformers"
    with pytest.raises(ConfigError, match="is not the Trainer's output_dir"):     # when built, not at train()
        TrainerWrapper(trainer, config=Config(save_dir=str(tmp_path / "elsewhere"), save_mem_interval=2))
    with pytest.raises(ConfigError, match=r"config= and also \['save_mem_interval'\]"):
        TrainerWrapper(trainer, save_mem_interval=3, config=Config(save_dir=str(tmp_path / "out")))


@pytest.mark.parametrize("module,framework", [("easyckpt.deepspeed", "deepspeed"), ("easyckpt.megatron", "megatron")])
def test_deepspeed_and_megatron_verbs_start_from_a_config(tmp_path, module, framework):
    verbs = importlib.import_module(module)
    cfg = Config(save_dir=str(tmp_path), save_mem_interval=2, save_storage_interval=4, job_name=framework,
                 agent_idle_timeout=1)
    verbs.initialize_easyckpt(cfg)        # a Config where the first setting goes
    try:
        ckpt = verbs._default.require()
        assert ckpt.config.save_storage_interval == 4 and ckpt.config.naming.framework == framework
    finally:
        assert verbs.finalize_easyckpt() is None       # nothing was saved
    wait_no_agent(tmp_path, job_name=framework)


def test_plain_pytorch_saves_and_resumes_through_a_config(tmp_path):
    import torch
    cfg = Config(save_dir=str(tmp_path), save_mem_interval=1, save_storage_interval=1, job_name="api",
                 agent_idle_timeout=1)
    model = torch.nn.Linear(3, 2)
    easyckpt.initialize_easyckpt(config=cfg)
    easyckpt.save_checkpoint_if_needed(1, model, extra={"data_pos": 7})
    assert easyckpt.finalize_easyckpt() == 1
    assert (tmp_path / "step_00000001" / "easyckpt_manifest.json").is_file()
    fresh = torch.nn.Linear(3, 2)
    easyckpt.initialize_easyckpt(cfg)
    try:
        assert easyckpt.load_checkpoint(fresh) == (1, {"data_pos": 7})
    finally:
        easyckpt.finalize_easyckpt()
    assert torch.equal(fresh.weight, model.weight)
    wait_no_agent(tmp_path, job_name="api")


def test_every_adapter_state_is_a_framework_state():
    from easyckpt.deepspeed import DeepSpeedState
    from easyckpt.megatron import MegatronState
    from easyckpt.pytorch import PytorchState
    from easyckpt.transformers import _Session
    for cls in (PytorchState, DeepSpeedState, MegatronState, _Session):
        assert all(callable(getattr(cls, verb, None)) for verb in ("collect", "needed", "restore")), cls
    assert isinstance(easyckpt.pytorch.PytorchState(None, None), easyckpt.FrameworkState)


def test_public_signatures_of_the_readme_are_kept():
    import easyckpt.deepspeed as eds
    import easyckpt.megatron as em
    from easyckpt.transformers import TrainerWrapper
    params = inspect.signature(em.initialize_easyckpt).parameters
    assert list(params)[:4] == ["save_mem_interval", "save_storage_interval", "max_ckpt_num", "log_file_path"]
    assert [params[n].default for n in list(params)[:4]] == [1, 5, 5, None]
    assert list(inspect.signature(em.load_checkpoint).parameters)[:6] == [
        "model", "optimizer", "opt_param_scheduler", "load_arg", "strict", "concat"]
    for verbs in (easyckpt, eds):
        assert list(inspect.signature(verbs.initialize_easyckpt).parameters)[:5] == [
            "save_dir", "save_mem_interval", "save_storage_interval", "max_ckpt_num", "log_file_path"]
    assert list(inspect.signature(TrainerWrapper).parameters)[:3] == ["trainer", "save_mem_interval", "log_file_path"]


# ---- errors ---------------------------------------------------------------------------------------

def _modules():
    for info in pkgutil.walk_packages(easyckpt.__path__, "easyckpt."):
        if info.name in ("easyckpt.megatron.hook",) or info.name.endswith("__main__"):
            continue                   # the hook patches Megatron-LM at import; __main__ runs a program
        yield importlib.import_module(info.name)


def test_every_exception_type_lives_in_errors_and_derives_from_one_base():
    seen = set()
    for module in _modules():
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("easyckpt"):
                assert obj.__module__ == "easyckpt.errors", f"{module.__name__}.{name} is defined outside errors.py"
                assert issubclass(obj, EasyCkptError), name
                seen.add(obj)
    assert len(seen) >= 10


def test_a_damaged_shard_or_an_unlisted_file_raises_the_checkpoint_error(tmp_path):
    from easyckpt.engine.shards import shardload
    from easyckpt.formats.manifest import build
    from easyckpt.storage import stepfiles
    with pytest.raises(CheckpointError, match="shorter than its 8-byte header"):
        shardload.decode(bytearray(b"abc"))
    with pytest.raises(CheckpointError, match="not in the manifest"):
        stepfiles.read_verified(str(tmp_path), "model.safetensors", build(1, "job", "pytorch", 1, {}))
    assert issubclass(CheckpointError, ValueError) and issubclass(CheckpointError, RuntimeError)


# ---- adapters: no file I/O, no threads, no imports of each other, the agent or storage ----------

FORBIDDEN_MODULES = ("easyckpt.agent", "easyckpt.storage", "easyckpt.cli", "shutil", "subprocess", "threading",
                     "easyckpt.pytorch", "easyckpt.deepspeed", "easyckpt.transformers")
# the one import between adapters: the Trainer runs DeepSpeed engines (TrainingArguments(deepspeed=...)) and
# uses the DeepSpeed adapter's helpers for them (their files in memory, the universal conversion, the CPU
# switch) rather than a second copy (.importlinter says the same)
SHARED = {"easyckpt.transformers": ("easyckpt.deepspeed.state", "easyckpt.deepspeed.universal",
                                    "easyckpt.deepspeed.cpu")}
OS_IO = {"listdir", "scandir", "walk", "makedirs", "mkdir", "remove", "unlink", "rmdir", "rename", "replace",
         "open", "write", "read", "fsync"}


@pytest.mark.parametrize("path", ADAPTERS)
def test_adapters_hold_no_file_io_and_import_no_other_adapter_nor_agent_nor_storage(path):
    tree = ast.parse((ROOT / path).read_text())
    own = path.replace("/", ".")[:-len(".py")].replace(".__init__", "")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            names = []
        for name in names:
            shared = SHARED.get(own.rsplit(".session", 1)[0].rsplit(".settings", 1)[0], ())
            bad = [f for f in FORBIDDEN_MODULES if (name == f or name.startswith(f + ".")) and not own.startswith(f)
                   and not any(name == m or name.startswith(m + ".") for m in shared)]
            assert not bad, f"{path} imports {name}"
        if isinstance(node, ast.Call):
            fn = node.func
            assert not (isinstance(fn, ast.Name) and fn.id == "open"), f"{path}:{node.lineno} opens a file"
            assert not (isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "os"
                        and fn.attr in OS_IO), f"{path}:{node.lineno} calls os.{fn.attr}"
