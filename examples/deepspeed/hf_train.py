"""Fine-tune a small GPT-2 with the Hugging Face Trainer (optionally under DeepSpeed ZeRO 1-3) and easyckpt.

    torchrun --standalone --nproc_per_node 2 examples/deepspeed/hf_train.py --output-dir /tmp/hf --zero 2

Relaunch the same command after an interruption: ``TrainerWrapper(trainer).train(resume_from_checkpoint=True)``
resumes from the newest complete state (memory or storage) and starts from scratch when there is none.
``--callback`` gives easyckpt to the Trainer as ``Trainer(callbacks=[EasyCkptCallback(...)])`` instead
(``trainer.train(resume_from_checkpoint=True)`` resumes the same way). ``--plain`` runs the unwrapped
Trainer instead (``--resume PATH`` to resume it from a given checkpoint), to show that both read each
other's ``checkpoint-N``. ``--lora`` trains a LoRA adapter (PEFT) instead of the whole model. Runs on GPUs
as is, and on CPU (gloo): the model is a randomly initialised tiny GPT-2 and the data synthetic, so nothing
is downloaded. Each step's loss goes to ``--loss-file`` (per process, exact float hex).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from easyckpt.deepspeed.cpu import deepspeed_on_cpu


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--save-dir", default=None,
                   help="where checkpoint-N go when not output_dir: an object store, s3://bucket/prefix")
    p.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage; none: DDP")
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--save-strategy", default="steps", choices=("no", "steps", "epoch"))
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--mem-interval", type=int, default=1)
    p.add_argument("--eval-best", action="store_true", help="evaluate every save and keep the best (eval loss)")
    p.add_argument("--best-greater", action="store_true",
                   help="with --eval-best: the highest eval loss is the best (a best checkpoint that is not the last)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--global-batch", type=int, default=8, help="kept fixed when the process count changes")
    p.add_argument("--plain", action="store_true", help="the Trainer alone, without easyckpt")
    p.add_argument("--callback", action="store_true",
                   help="easyckpt as Trainer(callbacks=[EasyCkptCallback(...)]) instead of TrainerWrapper")
    p.add_argument("--resume", default="true", help="true | none | a checkpoint path")
    p.add_argument("--log-file", default=None)
    p.add_argument("--loss-file", default=None, help="prefix; process r appends to PREFIX.rank{r}")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, to leave time for a kill")
    p.add_argument("--no-exit-on-sigterm", action="store_true",
                   help="after the SIGTERM checkpoint, train on (default: exit, as before a maintenance)")
    p.add_argument("--idle-timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--fsdp", action="store_true",
                   help="the Trainer's FSDP2 (fsdp=True, fsdp_config={'fsdp_version': 2}); on a CPU through "
                        "easyckpt.transformers.cpu.fsdp_on_cpu()")
    p.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter (PEFT) on the attention projections; the embeddings stay tied")
    p.add_argument("--dump-weights", default=None,
                   help="after training, torch.save the model's full state dict (process 0)")
    return p.parse_args()


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences with a learnable pattern (each token predicts the next)."""

    def __init__(self, n: int, length: int = 16, vocab: int = 128, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + step * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def dump_weights(trainer, path: str, gather: bool) -> None:
    """The model's full state dict after training (gathered under ZeRO-3; a collective, so every process
    calls it), saved by process 0: an independent ground truth for checkpoint converters."""
    import contextlib
    model = trainer.model
    context = contextlib.nullcontext()
    if gather:
        import deepspeed
        context = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with context:
        if trainer.args.process_index == 0:
            torch.save({name: t.detach().clone() for name, t in model.state_dict().items()}, path)


def main() -> int:
    args = parse()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    world = int(os.environ.get("WORLD_SIZE", 1))
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    extra = {}
    if args.zero is not None:
        deepspeed_on_cpu()   # no-op with CUDA
        if not torch.cuda.is_available():
            # accelerate picks no backend for DeepSpeed on CPU: every rank would think it is alone
            from accelerate import PartialState
            os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
            PartialState(backend="gloo")
            extra["accelerator_config"] = {"use_configured_state": True}
        extra["deepspeed"] = {
            "zero_optimization": {"stage": args.zero},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 10 ** 9,
        }
    if args.fsdp:
        from easyckpt.transformers.cpu import fsdp_on_cpu
        fsdp_on_cpu()        # no-op with CUDA: accelerate runs FSDP on accelerator process groups only
        extra["fsdp"] = True
        # the layout easyckpt writes (each rank its shards): a plain Trainer reads it with this setting
        extra["fsdp_config"] = {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}
    eval_args = {}
    if args.eval_best:
        eval_args = dict(eval_strategy="steps", eval_steps=args.save_steps, load_best_model_at_end=True,
                         metric_for_best_model="loss", greater_is_better=args.best_greater)
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.global_batch // world,
        per_device_eval_batch_size=4, learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=3,
        logging_steps=1, save_strategy=args.save_strategy, save_steps=args.save_steps,
        save_total_limit=args.save_total_limit, seed=args.seed, data_seed=args.seed, report_to=[],
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True, **eval_args, **extra)

    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                       resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout))
    if args.lora:      # the Trainer saves a PeftModel's adapter only: checkpoint-N loads with PeftModel.from_pretrained
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.05,
                                                 fan_in_fan_out=True, task_type="CAUSAL_LM"))

    class LossFile(TrainerCallback):
        def __init__(self):
            self.f = None

        def on_log(self, a, state, control, logs=None, **kw):
            if args.loss_file and logs and "loss" in logs:
                if self.f is None:
                    self.f = open(f"{args.loss_file}.rank{a.process_index}", "a", buffering=1)
                    self.f.write(f"# start {state.global_step - 1} world {a.world_size}\n")
                self.f.write(f"{state.global_step} {float(logs['loss']).hex()}\n")

        def on_step_end(self, a, state, control, **kw):
            if args.step_sleep:
                import time
                time.sleep(args.step_sleep)

    easyckpt_settings = dict(save_mem_interval=args.mem_interval, log_file_path=args.log_file,
                             agent_idle_timeout=args.idle_timeout,
                             exit_after_ondemand_checkpoint=not args.no_exit_on_sigterm)
    if args.save_dir:
        easyckpt_settings["save_dir"] = args.save_dir
    callbacks = [LossFile()]
    if args.callback:
        from easyckpt.transformers import EasyCkptCallback
        callbacks.append(EasyCkptCallback(**easyckpt_settings))
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(64, seed=1),
                      eval_dataset=Tokens(16, seed=2) if args.eval_best else None, callbacks=callbacks)
    resume = {"true": True, "none": None}.get(args.resume, args.resume)
    if args.plain or args.callback:
        trainer.train(resume_from_checkpoint=resume)
    else:
        from easyckpt.transformers import TrainerWrapper
        TrainerWrapper(trainer, **easyckpt_settings).train(resume_from_checkpoint=resume)
    if args.dump_weights:
        dump_weights(trainer, args.dump_weights, gather=args.zero == 3)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
