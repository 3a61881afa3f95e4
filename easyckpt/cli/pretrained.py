"""A Hugging Face Trainer checkpoint → a folder that ``from_pretrained`` reads, as ``save_pretrained`` writes it.

The weights are consolidate.py's (the Trainer's stored weights, or under DeepSpeed ZeRO the fp32 masters
merged from every rank), written as ``model.safetensors``, or above ``max_shard_bytes`` as
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` (save_pretrained's names and
50 GB default). Next to them go the step's model files as the Trainer wrote them — config.json,
generation_config.json, the tokenizer's or processor's files — but none of its training state (optimizer,
scheduler, RNG, trainer_state, DeepSpeed's global_stepN/). config.json gets ``dtype`` = the dtype of the
weights written (fp32 masters of a bf16 run load as fp32 with ``dtype="auto"``, as save_pretrained of that
model would say); its ``architectures`` (the model class, which pipelines and the Hub read) is kept, and
named in a warning when the checkpoint lacks it (TrainerWrapper writes it since 0.1.0's config.json fix).

Readers: config.json is written last, so a folder with a config.json holds its weights; weight files of an
earlier conversion that this one does not rewrite (another shard count) are removed, as save_pretrained does.

A PEFT model's checkpoint (a LoRA adapter: ``adapter_model.safetensors`` + ``adapter_config.json``, no model
weights, as the Trainer and easyckpt write it) becomes the folder ``PeftModel.from_pretrained`` reads: the
two files, checked against the manifest and the weights parsed before anything is written. Given the base
model (``base_model``: the folder or name ``from_pretrained`` reads; the checkpoint does not hold it), the
adapter is merged into it instead (PEFT's ``merge_and_unload``) and the folder is the merged model as
``save_pretrained`` writes it. The base is checked first against the checksum of the frozen weights the
training recorded: an adapter is never merged into another base model.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Dict, List, Optional

import torch

from easyckpt.cli import outputs
from easyckpt.cli.consolidate import Source, Weights, open_step
from easyckpt.cli.outputs import ProgressFactory
from easyckpt.engine import scratch
from easyckpt.formats import manifest as mf
from easyckpt.storage import stepfiles
from easyckpt.storage.resolve import remote

logger = logging.getLogger("easyckpt")
MAX_SHARD_BYTES = 50 * 10 ** 9         # save_pretrained's default max_shard_size ("50GB")
FOLDER = "consolidated"                # the default output, inside the step directory
WEIGHTS, INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"
ADAPTER, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"     # PeftModel.save_pretrained's
_WEIGHT_FILE = re.compile(r"(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json)")
# the Trainer's training state and weights (rewritten here) at the top of checkpoint-N: not the model's files
_NOT_MODEL = re.compile(r"(trainer_state\.json|training_args\.bin|optimizer\.pt|scheduler\.pt|scaler\.pt"
                        r"|rng_state(_\d+)?\.pth|latest|zero_to_fp32\.py|(model|pytorch_model)\S*\.(safetensors|bin)"
                        r"|\S+\.index\.json)")


def to_pretrained(step_dir: str, output_dir: Optional[str] = None, progress: Optional[ProgressFactory] = None,
                  max_shard_bytes: int = MAX_SHARD_BYTES, base_model: Optional[str] = None) -> Dict[str, Any]:
    """Write the committed Trainer step ``step_dir`` as a from_pretrained-ready folder ``output_dir``
    (default: ``consolidated/`` inside the step, listed in its manifest). Returns ``{"output": folder,
    "written": [paths], "tensors", "bytes", "kind"}``. ValueError, with what to do, when the step is not a
    Trainer checkpoint with a config.json, or the folder is the step directory itself. ``base_model``: for a
    PEFT adapter's checkpoint, the model to merge the adapter into (the folder is then the merged model)."""
    if base_model is not None:
        return _merged(step_dir, output_dir, base_model, progress)
    adapter = _adapter(step_dir, output_dir, progress)
    if adapter is not None:
        return adapter
    source = open_step(step_dir)
    if source.plan.framework != "hf":
        raise ValueError(f"{source.step_dir} is a DeepSpeed engine checkpoint: it holds no model config, so there "
                         f"is nothing from_pretrained could read; give --output a file name ending in .safetensors "
                         f"(the default is consolidated.safetensors in the step directory)")
    if CONFIG not in source.manifest.files:
        raise ValueError(f"{source.step_dir} has no {CONFIG} (the model is not a transformers model): "
                         f"from_pretrained cannot read it; give --output a file name ending in .safetensors")
    folder = _folder(source.step_dir, output_dir)
    model_files = sorted(rel for rel in source.manifest.files
                         if "/" not in rel and rel != mf.MANIFEST_NAME and not _NOT_MODEL.fullmatch(rel)
                         and not source.manifest.files[rel].derived_by)
    for rel in model_files + [WEIGHTS, INDEX]:
        source.refuse_replacing(os.path.join(folder, rel))
    kind, weights = source.merged(progress)
    files = _weight_files(weights, folder, max_shard_bytes, {"format": "pt", "easyckpt_kind": kind,
                                                             "easyckpt_step": str(source.step)})
    for rel in model_files:
        if rel != CONFIG:
            files[os.path.join(folder, rel)] = source.reader.bytes(rel)
    files[os.path.join(folder, CONFIG)] = _config(source.reader.bytes(CONFIG), weights, source.step_dir)
    source.write(files, progress, _stale_weights(folder, files, source))
    return {"output": folder, "written": list(files), "tensors": len(weights), "kind": kind,
            "bytes": sum(t.numel() * t.element_size() for t in weights.values())}


def _adapter(step_dir: str, output_dir: Optional[str], progress: Optional[ProgressFactory]) -> Optional[Dict[str, Any]]:
    """A PEFT adapter's checkpoint as PeftModel.from_pretrained's folder; None when the step holds model weights
    or no adapter."""
    try:
        man = stepfiles.load(step_dir)
    except (OSError, ValueError):
        return None                         # open_step says what is wrong
    if ADAPTER not in man.files or ADAPTER_CONFIG not in man.files or WEIGHTS in man.files:
        return None
    from safetensors.torch import load
    folder = _folder(step_dir, output_dir)
    for rel in (ADAPTER, ADAPTER_CONFIG):          # before anything is read
        outputs.refuse_replacing(step_dir, man, os.path.join(folder, rel))
    files = {os.path.join(folder, rel): stepfiles.read_verified(step_dir, rel, man) for rel in (ADAPTER, ADAPTER_CONFIG)}
    try:
        weights = load(files[os.path.join(folder, ADAPTER)])
        config = json.loads(files[os.path.join(folder, ADAPTER_CONFIG)])
    except Exception as exc:  # noqa: BLE001 - a listed file whose checksum matched and does not parse
        raise ValueError(f"{step_dir}: its adapter files do not load ({exc}); nothing was written") from None
    outputs.write(step_dir, man, files, progress)      # the config last: a folder with it holds the weights
    return {"output": folder, "written": list(files), "tensors": len(weights), "kind": "peft-adapter",
            "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
            "load": _adapter_load(folder, config if isinstance(config, dict) else {})}


def _adapter_load(folder: str, config: Dict[str, Any]) -> str:
    """The call that loads the adapter folder. Only PEFT loads an adapter, onto its base model: by the name in
    adapter_config.json where it has one; where it has none (a base built from a config in training:
    base_model_name_or_path null), from_pretrained of the folder looks the folder up on the Hub and fails, so
    the hint says to build the base as training did."""
    auto = _AUTO_CLASS.get(str(config.get("task_type") or "CAUSAL_LM"), "AutoModel")
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base:
        return f"PeftModel.from_pretrained({auto}.from_pretrained({base!r}), {folder!r})"
    return (f"PeftModel.from_pretrained(base, {folder!r}), with base the model the adapter was trained on, built "
            f"as in training ({ADAPTER_CONFIG} names no base model: base_model_name_or_path is null, so "
            f"{auto}.from_pretrained cannot load this folder); or --base-model with that model saved by "
            f"save_pretrained writes the merged model instead")


# PEFT's task types -> the transformers Auto class that loads their base model (PEFT's own AutoPeftModel* pairs)
_AUTO_CLASS = {"CAUSAL_LM": "AutoModelForCausalLM", "SEQ_CLS": "AutoModelForSequenceClassification",
               "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM", "TOKEN_CLS": "AutoModelForTokenClassification",
               "QUESTION_ANS": "AutoModelForQuestionAnswering", "FEATURE_EXTRACTION": "AutoModel"}


def _merged(step_dir: str, output_dir: Optional[str], base_model: str,
            progress: Optional[ProgressFactory]) -> Dict[str, Any]:
    """The adapter of ``step_dir`` merged into ``base_model``, as the folder save_pretrained writes; ValueError
    (nothing written) when the step holds no adapter, the base does not load, or it is not the base the adapter
    was trained on (the checksum of its frozen weights in the manifest)."""
    import transformers
    from peft import PeftModel

    from easyckpt.transformers import peftmodel

    man = stepfiles.load(step_dir)
    if ADAPTER not in man.files or ADAPTER_CONFIG not in man.files:
        raise ValueError(f"{step_dir} holds no PEFT adapter ({ADAPTER}, {ADAPTER_CONFIG}): --base-model merges an "
                         f"adapter into its base model; leave it out for this checkpoint")
    folder = _folder(step_dir, output_dir)
    adapter = {rel: stepfiles.read_verified(step_dir, rel, man) for rel in (ADAPTER, ADAPTER_CONFIG)}
    task = str(json.loads(adapter[ADAPTER_CONFIG]).get("task_type") or "CAUSAL_LM")
    auto = getattr(transformers, _AUTO_CLASS.get(task, "AutoModel"))
    # PEFT and transformers read and write only by path: scratch directories in the save directory (beside the
    # step, never inside it), removed after
    near = os.path.dirname(folder) if remote(step_dir) is not None else os.path.dirname(os.path.abspath(step_dir))
    tag = str(os.getpid())
    adapter_dir = scratch.fresh(scratch.path(near, "adapter", tag))
    try:
        for rel, data in adapter.items():
            scratch.staged_file(adapter_dir, rel, data)
        try:
            base = auto.from_pretrained(base_model)
        except Exception as exc:  # noqa: BLE001 - any failure of the base model's loading: said, nothing written
            raise ValueError(f"--base-model {base_model} does not load with {auto.__name__}.from_pretrained "
                             f"({exc}); nothing was written") from None
        model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)    # trainable: the checksum's split
    finally:
        scratch.remove(adapter_dir)
    recorded = man.info.get(peftmodel.BASE_KEY)
    if recorded is None:
        logger.warning("%s records no checksum of its base model: the merge into %s is not checked",
                       step_dir, base_model)
    elif recorded != peftmodel.base_checksum(model):
        raise ValueError(f"--base-model {base_model} is not the model this adapter was trained on (the checksum "
                         f"of its frozen weights differs from the one step {man.step} recorded); nothing was written")
    merged = model.merge_and_unload()
    written = scratch.files_written_by(merged.save_pretrained, scratch.path(near, "merged", tag))
    written.sort(key=lambda f: (f[0] == CONFIG, f[0]))          # config.json last: a folder with it is whole
    for name, _ in written:
        outputs.refuse_replacing(step_dir, man, os.path.join(folder, name))
    files = {os.path.join(folder, name): data for name, data in written}
    state = merged.state_dict()
    outputs.write(step_dir, man, files, progress)
    return {"output": folder, "written": list(files), "tensors": len(state), "kind": "peft-merged",
            "bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "load": f"{auto.__name__}.from_pretrained({folder!r})"}


def _folder(step_dir: str, output_dir: Optional[str]) -> str:
    """The output folder (default: FOLDER inside the step); ValueError when it is the step directory itself."""
    folder = os.path.abspath(output_dir or os.path.join(step_dir, FOLDER))
    if os.path.realpath(folder) == os.path.realpath(step_dir):
        raise ValueError(f"{folder} is the checkpoint itself; choose another --output folder (the default is "
                         f"{FOLDER}/ in the step directory)")
    return folder


def _weight_files(weights: Weights, folder: str, max_shard_bytes: int, metadata: Dict[str, str]) -> Dict[str, bytes]:
    from safetensors.torch import save
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in weights.items():        # in order, as save_pretrained fills its shards
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        return {os.path.join(folder, WEIGHTS): save(weights, metadata=metadata)}
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    files = {os.path.join(folder, name): save(part, metadata=metadata) for name, part in zip(names, shards)}
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
             "weight_map": {key: name for name, part in zip(names, shards) for key in part}}
    files[os.path.join(folder, INDEX)] = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    return files


def _config(data: bytes, weights: Weights, step_dir: str) -> bytes:
    try:
        config = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{os.path.join(step_dir, CONFIG)} is not JSON ({exc})") from exc
    floating = [t for t in weights.values() if t.is_floating_point()]
    if floating:
        by_dtype: Dict[torch.dtype, int] = {}
        for t in floating:
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel() * t.element_size()
        config["dtype"] = str(max(by_dtype, key=by_dtype.__getitem__)).removeprefix("torch.")
        config.pop("torch_dtype", None)        # transformers 5's name is dtype; two would disagree
    if not config.get("architectures"):
        logger.warning("easyckpt: %s names no architectures (written before easyckpt recorded the model class): "
                       "AutoModel* classes load the folder by its model_type; pipelines and the Hub want "
                       "\"architectures\": [\"<ModelClass>\"] added to its config.json", step_dir)
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()    # to_json_string's format


def _stale_weights(folder: str, files: Dict[str, bytes], source: Source) -> List[str]:
    """Weight files of an earlier conversion into this folder that this one does not rewrite (another shard
    count): from_pretrained would read them with the new ones. Inside a step, only our own outputs."""
    stale = [os.path.join(folder, n) for n in (os.listdir(folder) if os.path.isdir(folder) else [])
             if _WEIGHT_FILE.fullmatch(n) and os.path.join(folder, n) not in files]
    for path in stale:
        source.refuse_replacing(path)
    return stale
