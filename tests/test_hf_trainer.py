"""``vefsdp_optim.hf.Trainer``: Hugging Face's Trainer on a model sharded before it (FSDP2's
``fully_shard`` or ours), at W = 2 and 3 on gloo, against the same Trainer on one device
fed the ranks' average (every rank sees the same batch, and the one-device run's
gradients are replaced by the sum of W copies over W before each step): the parameters
after the steps are bit-identical, and so are they after a resume from the Trainer's own
checkpoint (the model's and optimizer's shards, the scheduler, the step).
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import average_like_ranks, run_distributed

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, SEQ, BATCH, STEPS = 61, 8, 2, 4  # 61 rows: uneven at W = 2 and 3


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


class _Same(torch.utils.data.Dataset):
    """Step k's batch on every rank: Accelerate gives rank r of W the sequential sampler's
    batches r, r + W, ... (index i of step k is (k W + r) B + j), so index i maps to the
    base batch k's row j."""

    def __init__(self, world: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.rows = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(STEPS * BATCH)]
        self.world = world

    def __len__(self) -> int:
        return len(self.rows) * self.world

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[(i // (self.world * BATCH)) * BATCH + i % BATCH]
        return {"input_ids": row, "labels": row}


def _args(out: str, steps: int = STEPS, **kw):
    from transformers import TrainingArguments

    base = {"output_dir": out, "per_device_train_batch_size": BATCH, "max_steps": steps,
            "learning_rate": 1e-2, "lr_scheduler_type": "linear", "warmup_steps": 1, "weight_decay": 0.1,
            "max_grad_norm": 0.0, "train_sampling_strategy": "sequential", "use_cpu": True,
            "report_to": "none", "logging_steps": 1000, "save_strategy": "no", "seed": 0,
            "dataloader_num_workers": 0, "disable_tqdm": True,
            # the default (True) divides a rank's token sum by all W ranks' count and
            # multiplies the loss by W: a rounding one device does not have (the clipping
            # test keeps the default, compared to rounding)
            "average_tokens_across_devices": False}
    return TrainingArguments(**{**base, **kw})


def _optim(name: str, model):
    """(optimizers, optimizer_cls_and_kwargs) for the Trainer: AdamW built by the Trainer
    (its decay groups), Muon on muon_param_groups handed in built."""
    import vefsdp_optim

    if name == "AdamW":
        return {"optimizer_cls_and_kwargs": (vefsdp_optim.AdamW, {"betas": (0.9, 0.95)})}
    return {"optimizers": (vefsdp_optim.Muon(vefsdp_optim.muon_param_groups(model), lr=1e-2), None)}


def _params(model) -> dict[str, torch.Tensor]:
    # FSDP2's DTensors and our ShardedParameters both gather with full_tensor()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()


def _recording(base: type, world: int = 0) -> type:
    """``base`` (a Trainer class) that records each step's loss and gradient norm; with
    ``world``, it also replaces the gradients by the ranks' average right after backward
    (before clipping and the norm): the one-device replay."""

    class Recording(base):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            self.losses: list[torch.Tensor] = []
            self.norms: list[torch.Tensor] = []

        def training_step(self, model, inputs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
            loss = super().training_step(model, inputs, *args, **kwargs)
            if world:
                for p in model.parameters():
                    p.grad = average_like_ranks(p.grad, world)
            self.losses.append(loss.detach().clone())
            return loss

        def _get_grad_norm(self, model, grad_norm=None):  # noqa: ANN001, ANN201
            if grad_norm is not None:
                self.norms.append(torch.as_tensor(grad_norm).detach().clone())
            return super()._get_grad_norm(model, grad_norm=grad_norm)

    return Recording


def _one_device(name: str, world: int, out: str, clip: float = 0.0) -> tuple[dict, list, list]:
    # clip > 0 also keeps the Trainer's default average_tokens_across_devices
    from transformers import Trainer

    model = _model()
    _reset_accelerate()
    try:
        trainer = _recording(Trainer, world)(model=model, args=_args(out, max_grad_norm=clip,
                                                                         average_tokens_across_devices=clip > 0),
                                             train_dataset=_Same(1), **_optim(name, model))
        trainer.train()
    finally:
        _reset_accelerate()
    return _params(model), trainer.losses, trainer.norms


def _shard(model, kind: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from vefsdp_optim import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _sharded(kind: str, name: str, out: str, resume: bool, clip: float = 0.0) -> tuple[dict, list, list]:
    import torch.distributed as dist

    from vefsdp_optim.hf import SHARDED_CHECKPOINT, Trainer

    w, r = dist.get_world_size(), dist.get_rank()
    env = {"RANK": str(r), "WORLD_SIZE": str(w), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(w)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _reset_accelerate()
    trainer_cls = _recording(Trainer)
    try:
        if resume:  # a checkpoint at step 2, then a fresh model and Trainer resume from it
            model = _shard(_model(), kind)
            first = trainer_cls(model=model, args=_args(out, save_strategy="steps", save_steps=2),
                                train_dataset=_Same(w), **_optim(name, model))
            first.train()
            ckpt = os.path.join(out, "checkpoint-2")
            assert os.path.isdir(os.path.join(ckpt, SHARDED_CHECKPOINT)), os.listdir(ckpt)
            torch.manual_seed(123)
            model = _shard(_model(), kind)
            with torch.no_grad():  # other values than the checkpoint's: all must come from it
                for p in model.parameters():
                    p.add_(1.0)
            _reset_accelerate()
            os.environ.update(env)
            trainer = trainer_cls(model=model, args=_args(out), train_dataset=_Same(w), **_optim(name, model))
            trainer.train(resume_from_checkpoint=ckpt)
            losses = first.losses[:2] + trainer.losses  # steps 1-2, then 3-4 from the checkpoint
        else:
            model = _shard(_model(), kind)
            training = _args(out, max_grad_norm=clip, average_tokens_across_devices=clip > 0)
            trainer = trainer_cls(model=model, args=training, train_dataset=_Same(w), **_optim(name, model))
            trainer.train()
            trainer.save_model(os.path.join(out, "final"))  # every rank gathers, rank 0 writes
            losses = trainer.losses
        got = _params(model)  # full_tensor: a collective every rank joins
        if r != 0:
            return {}, [], []
        if not resume:  # the Trainer's saved weights are the sharded model's, for from_pretrained
            from transformers import LlamaForCausalLM

            back = dict(LlamaForCausalLM.from_pretrained(os.path.join(out, "final")).named_parameters())
            bad = [n for n in got if not torch.equal(back[n].detach(), got[n])]
            assert not bad and sorted(back) == sorted(got), ("save_model", bad)
        return got, losses, trainer.norms
    finally:
        _reset_accelerate()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _same(want: tuple, got: tuple) -> None:
    (wp, wl, _), (gp, gl, _) = want, got
    bad = [n for n in wp if not torch.equal(wp[n], gp[n])]
    assert not bad and sorted(gp) == sorted(wp), bad
    assert len(gl) == len(wl) == STEPS and all(torch.equal(a, b) for a, b in zip(gl, wl, strict=True)), (gl, wl)


# slow tier: each pool worker imports transformers' Trainer (~10 s of CPU each on this
# machine); the quick tier keeps the resume case with our fully_shard, which also trains
# against one device and shards a PreTrainedModel root
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["fsdp2", "ours"])
def test_trainer_on_a_sharded_model_equals_one_device(tmp_path, kind: str, world: int) -> None:
    for name in ("AdamW", "Muon"):
        want = _one_device(name, world, str(tmp_path / f"one-{name}"))
        got = run_distributed(_sharded, world, kind, name, str(tmp_path / f"{kind}-{name}"), False, timeout=120)[0]
        _same(want, got)


@pytest.mark.slow  # ~3 s after the imports
@pytest.mark.parametrize("kind", ["fsdp2", "ours"])
def test_trainer_clips_by_the_global_norm(tmp_path, kind: str) -> None:
    # the Trainer's default max_grad_norm = 1.0 clips here (norms ~3): the norm over all
    # shards is summed in another order than one device's, so equal to rounding, not bits.
    # AdamW, whose update moves by about that rounding: Muon's bfloat16 Newton-Schulz turns
    # a last-bit change of the clip factor into a bfloat16 rounding step of a whole matrix
    # where an input sits on a rounding boundary (seen on an AMD EPYC: 522 of 1,408
    # elements of one matrix off by up to 2e-5, the other Muon matrices bit for bit)
    want = _one_device("AdamW", 3, str(tmp_path / "one"), clip=1.0)
    got = run_distributed(_sharded, 3, kind, "AdamW", str(tmp_path / kind), False, 1.0, timeout=120)[0]
    assert len(got[2]) == len(want[2]) == STEPS and all(n > 1.0 for n in want[2]), want[2]
    torch.testing.assert_close(torch.stack(got[2]), torch.stack(want[2]), rtol=1e-5, atol=0)
    for n in want[0]:
        torch.testing.assert_close(got[0][n], want[0][n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("kind", [pytest.param("fsdp2", marks=pytest.mark.slow), "ours"])  # ~2.5 s each
def test_trainer_resumes_from_its_sharded_checkpoint(tmp_path, kind: str) -> None:
    want = _one_device("Muon", 3, str(tmp_path / "one"))
    _same(want, run_distributed(_sharded, 3, kind, "Muon", str(tmp_path / kind), True, timeout=120)[0])


def _refused_twice(out: str) -> str:
    from vefsdp_optim.hf import Trainer

    model = _shard(_model(), "ours")
    with pytest.raises(ValueError, match="TrainingArguments.fsdp asks Accelerate to shard it again") as e:
        Trainer(model=model, args=_args(out, fsdp=True))
    return str(e.value)


def test_an_unsharded_model_is_refused(tmp_path) -> None:
    from vefsdp_optim.hf import Trainer

    with pytest.raises(ValueError, match="takes a model sharded by fully_shard"):
        Trainer(model=_model(), args=_args(str(tmp_path)))


@pytest.mark.slow  # a pool worker imports transformers' Trainer
def test_a_second_sharding_is_refused(tmp_path) -> None:
    # on CPU ranks Accelerate ignores fsdp=True without a word: refused before it can
    run_distributed(_refused_twice, 1, str(tmp_path))


@pytest.mark.slow  # ~40 s: three fresh processes import transformers' Trainer
@pytest.mark.parametrize("kind", ["fsdp2", "ours"])
def test_accelerate_launch_resumes_and_equals_one_device(tmp_path, kind: str) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_launch_job.py")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"}  # no user accelerate config
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "3",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(port), job, kind, str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    got = torch.load(tmp_path / "result.pt", weights_only=True)
    want = _one_device("Muon", 3, str(tmp_path / "one"))
    _same(want, (got["params"], got["losses"], []))
