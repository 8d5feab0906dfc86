"""The sharded harness of the matrix optimizers' tests (Muon's blocks and batching,
NorMuon, SOAP): named parameters in one module, sharded by FSDP2 or our
``fully_shard`` over every rank, each rank's ``.grad`` its slice of one full gradient,
and the full parameters read back for comparison with one device.

The functions that shard run inside ``run_distributed``'s ranks (tests/dist_utils.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

import vefsdp_optim

__all__ = ["Bag", "full_params", "local_grad", "owner_moves", "set_full_grads", "set_grads", "shard_bag"]


class Bag(nn.Module):
    """One parameter per entry of ``init`` (a copy), under the entry's name."""

    def __init__(self, init: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in init.items():
            setattr(self, k, nn.Parameter(v.clone()))


def shard_bag(kind: str, init: Mapping[str, torch.Tensor]) -> Bag:
    """A ``Bag`` of ``init`` sharded over every rank: ``"fsdp2"`` (torch's fully_shard on
    a 1-D CPU mesh) or ``"fully_shard"`` (ours)."""
    model = Bag(init)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    elif kind == "fully_shard":
        vefsdp_optim.fully_shard(model)
    else:
        raise ValueError(f"kind {kind!r}: expected 'fsdp2' or 'fully_shard'")
    return model


def local_grad(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full gradient ``g`` of ``p``, in ``p``'s own kind: a
    ``ShardedParameter`` slice, a DTensor with ``p``'s placements, or ``g`` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from vefsdp_optim import ShardedParameter

    if isinstance(p, ShardedParameter):
        s, n = p.ragged_layout.local(p._rank)
        return ShardedParameter(g.reshape(-1)[s: s + n].clone(), p.ragged_layout, p.process_group,
                                p.shape, p._rank)
    if isinstance(p, DTensor):
        return distribute_tensor(g, p.device_mesh, p.placements)
    return g


def set_grads(params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor]) -> None:
    """Every rank's ``.grad``: its slice of the same full gradient (the averaged one)."""
    for p, g in zip(params, grads, strict=True):
        p.grad = local_grad(p, g)


def set_full_grads(model: nn.Module, grad: Callable[[str], torch.Tensor]) -> None:
    """``set_grads`` for named parameters: ``grad(name)`` is the full gradient."""
    for k, p in model.named_parameters():
        p.grad = local_grad(p, grad(k))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name (on every rank)."""
    return {k: p.full_tensor().detach() for k, p in model.named_parameters()}


def owner_moves(sharded: bool = True, name: str = "SOAP") -> dict[str, torch.Tensor]:
    """Three matrices (FSDP2 at W = 2, or one device): with no gradient for the largest
    at the second step, the balance alone would move a small one to another owner, which
    lacks its owner-kept state (SOAP's factors, NorMuon's row second moments); owners
    stay ([Note: owners stay]), so the step is one device's."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    model = Bag({"a": torch.randn(16, 16), "b": torch.randn(8, 8), "c": torch.randn(8, 8)})
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    opt = getattr(vefsdp_optim, name)(model.parameters())
    for step in range(3):
        for k, p in model.named_parameters():
            g = torch.randn(p.shape)
            p.grad = None if step == 1 and k == "a" else (
                distribute_tensor(g, p.device_mesh, p.placements) if sharded else g)
        opt.step()
    return {k: (p.full_tensor() if sharded else p).detach() for k, p in model.named_parameters()}
