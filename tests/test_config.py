"""Configuration errors are raised at initialisation, naming the argument and the fix (row 5 too)."""
from __future__ import annotations

import importlib.util
import subprocess

import pytest

import easyckpt
from easyckpt import ConfigError


@pytest.mark.parametrize("kwargs,needle", [
    ({"save_mem_interval": 0}, "save_mem_interval=0 must be at least 1"),
    ({"save_mem_interval": -3}, "save_mem_interval=-3"),
    ({"save_mem_interval": 1.5}, "save_mem_interval=1.5 must be a positive integer"),
    ({"save_storage_interval": 0}, "save_storage_interval=0"),
    ({"save_mem_interval": 2, "save_storage_interval": 7},
     "save_storage_interval=7 is not a multiple of save_mem_interval=2: only memory snapshots can be "
     "persisted; use save_storage_interval=6 or 8"),
    ({"max_ckpt_num": 0}, "max_ckpt_num=0 must be a positive integer"),
    ({"max_ckpt_num": True}, "max_ckpt_num=True"),
    ({"agent_idle_timeout": -1}, "agent_idle_timeout=-1 must be a positive number of seconds"),
    ({"on_no_valid_checkpoint": "restart"}, "on_no_valid_checkpoint='restart' must be one of 'error', 'start_fresh'"),
])
def test_bad_argument_names_itself_and_the_fix(tmp_path, kwargs, needle):
    with pytest.raises(ConfigError) as err:
        easyckpt.initialize_easyckpt(str(tmp_path / "ckpt"), **kwargs)
    assert needle in str(err.value)


def test_unknown_keyword_is_refused(tmp_path):
    with pytest.raises(TypeError, match="save_intervall"):
        easyckpt.initialize_easyckpt(str(tmp_path), save_intervall=3)


def test_save_dir_that_cannot_be_created_fails_at_initialisation(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="does not exist and cannot be created"):
        easyckpt.initialize_easyckpt(str(blocker / "ckpt"))


def test_an_object_store_url_is_never_made_a_local_directory_and_an_unreachable_store_is_refused(tmp_path, monkeypatch):
    """A URL easyckpt cannot write (hdfs://) is refused, saying how object stores are reached; an s3://, gs:// or
    az:// one with no credentials is refused at initialisation, naming them; none becomes a local directory."""
    from easyckpt.config import Config, validate
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))       # the default local_dir of an s3:// job
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="is a URL easyckpt cannot write: object stores are reached through s3://"):
        validate(Config(save_dir="hdfs://bucket/ckpt"))
    for name in ("STORAGE_EMULATOR_HOST", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
                 "AZURE_STORAGE_ACCOUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "none.json"))
    if importlib.util.find_spec("google.cloud.storage") is not None:
        with pytest.raises(ConfigError, match="no Google Cloud credentials.*set GOOGLE_APPLICATION_CREDENTIALS"):
            validate(Config(save_dir="gs://bucket/ckpt"))
    if importlib.util.find_spec("azure.storage.blob") is not None:
        with pytest.raises(ConfigError, match="no Azure storage account: set AZURE_STORAGE_CONNECTION_STRING"):
            validate(Config(save_dir="az://container/ckpt"))
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e .[s3])")
    with pytest.raises(ConfigError, match="no credentials: set AWS_ACCESS_KEY_ID"):
        validate(Config(save_dir="s3://bucket/ckpt", endpoint_url="http://127.0.0.1:9"))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(":")], list(tmp_path.iterdir())


def test_log_file_that_cannot_be_written_fails_at_initialisation(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="log_file_path="):
        easyckpt.initialize_easyckpt(str(tmp_path / "ckpt"), log_file_path=str(blocker / "log.jsonl"))


def test_read_only_save_dir_fails_at_initialisation_and_stays_untouched(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "existing").write_text("keep")
    if subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True,
                      timeout=30).returncode != 0:
        pytest.skip("cannot make a read-only bind mount here (needs root): read-only case not exercised")
    try:
        with pytest.raises(ConfigError, match="is not writable .*Read-only file system"):
            easyckpt.initialize_easyckpt(str(ro), log_file_path=None)
    finally:
        subprocess.run(["umount", str(ro)], timeout=30)
    assert sorted(p.name for p in ro.iterdir()) == ["existing"]


def test_verbs_before_initialisation_say_what_to_call(tmp_path):
    import torch
    with pytest.raises(easyckpt.EasyCkptError, match="initialize_easyckpt"):
        easyckpt.save_checkpoint_if_needed(1, torch.nn.Linear(2, 2))
