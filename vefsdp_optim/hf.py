"""Hugging Face ``transformers.Trainer`` for a model sharded before the Trainer sees it.

Accelerate shards a model itself only where its FSDP plugin is active, and on CPU ranks
(gloo) it ignores the plugin and wraps the model in DDP (see below). A model sharded by
FSDP2's ``fully_shard`` or ours before the Trainer is the path that works on every
device: ``vefsdp_optim.hf.Trainer`` takes such a model, keeps Accelerate from wrapping
it again, and saves and resumes it the way a sharded model needs: the weights gathered
once for ``save_pretrained`` (every rank joins, rank 0 writes), and the model and
optimizer state as one distributed checkpoint of each rank's shards
(``vefsdp_optim.save``), loadable at another world size.

``transformers.Trainer``'s own paths assume an unsharded model on every rank where no
FSDP plugin is set: ``save_model`` calls ``state_dict()`` on rank 0 alone (a collective
the other ranks never join: a hang), and the optimizer state it saves is rank 0's shard
only. This subclass replaces exactly those four methods: ``save_model``,
``_save_optimizer_and_scheduler``, ``_load_from_checkpoint`` (the weights come from the
sharded checkpoint, with the optimizer's state) and ``_load_optimizer_and_scheduler``.
Everything else (the loop, gradient accumulation, clipping, schedulers, callbacks,
logging, RNG state per rank) is the Trainer's.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

try:
    import transformers
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("vefsdp_optim.hf needs transformers: pip install 'vefsdp-optim[hf]'") from e

__all__ = ["Trainer", "SHARDED_CHECKPOINT", "is_sharded"]

# the folder of a Trainer checkpoint that holds the model's and optimizer's shards
SHARDED_CHECKPOINT = "vefsdp_sharded"
_SCHEDULER = "scheduler.pt"


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or a submodule) was sharded by FSDP2's or our ``fully_shard``, or
    holds DTensor parameters (tensor parallelism)."""
    from torch.distributed.fsdp import FSDPModule  # ours subclasses it

    from ._checkpoint._full_export import _is_sharded

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        _is_sharded(p) for p in model.parameters())


def _full_state_dict(model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """The model's whole tensors on the CPU, one all-gather per sharded tensor (every rank
    joins; DTensor and ShardedParameter both gather with ``full_tensor()``; torch's
    ``get_model_state_dict(full_state_dict=True)`` knows only DTensor). Only a rank with
    ``keep`` holds them, one at a time on the others."""
    from ._checkpoint._full_export import _is_sharded

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, value in model.state_dict().items():
            if _is_sharded(value):
                value = value.full_tensor()
            if keep:
                out[name] = value.detach().cpu()
    return out


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for a model already sharded by ``fully_shard`` (FSDP2's or
    ``vefsdp_optim.fully_shard``); the arguments are the Trainer's.

    Raises ValueError when the model is not sharded (use ``transformers.Trainer``) or when
    the TrainingArguments ask Accelerate to shard it again (``fsdp`` or ``deepspeed``).
    """

    def __init__(self, model: nn.Module | None = None, *args: Any, **kwargs: Any) -> None:
        if model is None or not is_sharded(model):
            raise ValueError("vefsdp_optim.hf.Trainer takes a model sharded by fully_shard "
                             "(FSDP2's or vefsdp_optim's) before the Trainer; got "
                             f"{'no model' if model is None else type(model).__name__ + ' with no sharded module'}"
                             ": shard it first, or use transformers.Trainer")
        training = kwargs.get("args", args[0] if args else None)
        asked = [what for what, on in (
            ("TrainingArguments.fsdp", bool(getattr(training, "fsdp", None))),
            ("TrainingArguments.deepspeed", bool(getattr(training, "deepspeed", None))),
            ("ACCELERATE_USE_FSDP",
             os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")),
            ("ACCELERATE_USE_DEEPSPEED",
             os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")),
        ) if on]
        if asked:  # on CPU ranks Accelerate would ignore them without a word
            raise ValueError(f"the model is sharded already, but {', '.join(asked)} asks "
                             "Accelerate to shard it again: leave fsdp / fsdp_config and deepspeed "
                             "out of the TrainingArguments and the accelerate config for "
                             "vefsdp_optim.hf.Trainer")
        # Accelerate's own guard against preparing a model twice: it would wrap the sharded
        # model in DDP (CPU ranks) or refuse its DTensors
        model._is_accelerate_prepared = True
        super().__init__(model, *args, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise ValueError("the model is sharded already: leave fsdp / fsdp_config and "
                             "deepspeed out of the TrainingArguments (and the accelerate config) "
                             "for vefsdp_optim.hf.Trainer")

    # -- what the Trainer's checkpoints hold --------------------------------------------------

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        opt = self.optimizer
        return getattr(opt, "optimizer", opt)  # Accelerate's AcceleratedOptimizer wraps it

    def _sharded_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        return {"model": get_model_state_dict(self.model),
                "optim": get_optimizer_state_dict(self.model, self._inner_optimizer())}

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The full weights for ``from_pretrained``: gathered on every rank (a collective),
        written by rank 0 (``save_pretrained``, as the Trainer's own save)."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        full = _full_state_dict(self.model, keep=self.args.should_save)
        if self.args.should_save:  # what the Trainer's own save writes, through public calls
            os.makedirs(output_dir, exist_ok=True)
            if isinstance(self.model, transformers.PreTrainedModel):
                self.model.save_pretrained(output_dir, state_dict=full)
            else:
                from safetensors.torch import save_file

                save_file(full, os.path.join(output_dir, "model.safetensors"),
                          metadata={"format": "pt"})
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from . import save

        save(self._sharded_state(), os.path.join(output_dir, SHARDED_CHECKPOINT))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        # the weights are loaded with the optimizer's state (_load_optimizer_and_scheduler):
        # here only check that the checkpoint is one this Trainer wrote
        where = os.path.join(resume_from_checkpoint, SHARDED_CHECKPOINT)
        if not os.path.isdir(where):
            raise ValueError(f"{resume_from_checkpoint!r} has no {SHARDED_CHECKPOINT!r} folder: "
                             "vefsdp_optim.hf.Trainer resumes from checkpoints it saved "
                             "(save_only_model=False)")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from . import load

        self._load_from_checkpoint(checkpoint)
        state = self._sharded_state()
        load(state, os.path.join(checkpoint, SHARDED_CHECKPOINT))
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self._inner_optimizer(), state["optim"])
        path = os.path.join(checkpoint, _SCHEDULER)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, map_location="cpu",
                                                         weights_only=True))
