"""Hugging Face's Trainer on a model sharded by fully_shard, with Muon on the matrices.

Shard the model first (FSDP2's ``torch.distributed.fsdp.fully_shard`` or
``vefsdp_optim.fully_shard``: the same calls), then hand it to
``vefsdp_optim.hf.Trainer``, which is ``transformers.Trainer`` with the saving and
resuming a sharded model needs. Muon's parameters come from ``muon_param_groups`` (the
embeddings, the head and the vectors go to its AdamW). Runs on CPUs with gloo or GPUs
with NCCL:

    torchrun --nproc-per-node 3 examples/hf_trainer.py            # or: accelerate launch --num_processes 3
    torchrun --nproc-per-node 3 examples/hf_trainer.py --resume   # from the last checkpoint

Needs the hf extra: ``pip install 'vefsdp-optim[hf]'``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import vefsdp_optim
from vefsdp_optim.hf import Trainer


class Tokens(torch.utils.data.Dataset):
    """Random token rows: a stand-in for a tokenized corpus."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="hf_trainer_out")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    p.add_argument("--torch-fsdp2", action="store_true", help="shard with torch's fully_shard instead of ours")
    p.add_argument("--optim", choices=("muon", "adamw8bit"), default="muon",
                   help="Muon on muon_param_groups (default), or AdamW8bit built by the Trainer (its decay groups)")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    with torch.device(mesh.device_type):
        model = LlamaForCausalLM(cfg)
    if args.torch_fsdp2:
        from torch.distributed.fsdp import fully_shard
    else:
        from vefsdp_optim import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    if args.optim == "muon":
        # Muon on the hidden matrices, its AdamW on the rest (every choice with its reason:
        # print(vefsdp_optim.muon_param_report(model))); the Trainer builds the schedule
        chosen = {"optimizers": (vefsdp_optim.Muon(vefsdp_optim.muon_param_groups(model), lr=2e-2), None)}
        lr = 2e-2
    else:  # the Trainer builds it from the class, with its weight-decay groups
        chosen = {"optimizer_cls_and_kwargs": (vefsdp_optim.AdamW8bit, {"betas": (0.9, 0.95)})}
        lr = 1e-3
    training = TrainingArguments(output_dir=args.out, per_device_train_batch_size=4, max_steps=args.steps,
                                 learning_rate=lr, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=2,
                                 max_grad_norm=1.0, logging_steps=5, save_strategy="steps", save_steps=10,
                                 report_to="none", use_cpu=not cuda)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(4096, 64, cfg.vocab_size), **chosen)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model()  # the full weights: LlamaForCausalLM.from_pretrained(args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
