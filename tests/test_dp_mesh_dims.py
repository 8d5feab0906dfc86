"""fully_shard(dp_mesh_dims=...): FSDP2's named data-parallel dims of a larger SPMD mesh.

The group shards over the submesh the names pick (several shard names flattened into
one dim, as FSDP2 does). Checked at W = 2 and 3 against one device fed the averaged
gradient and bitwise against the same model sharded with the 1-D submesh passed
directly; bad names, replicate-only dims and DTensor parameters raise before any
collective. On torch 2.11, which has no DataParallelMeshDims (2.12 brought it), the
argument raises NotImplementedError naming 2.12 (see vefsdp_optim/_torch_compat.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_distributed
from fsdp_harness import RTOL, _build, _close, _full, _train

from vefsdp_optim._torch_compat import SINCE, DataParallelMeshDims

_DIMS_SINCE = SINCE["torch.distributed.fsdp.DataParallelMeshDims"]


def _case() -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Replicate, distribute_tensor

    from vefsdp_optim._fsdp import fully_shard

    w = dist.get_world_size()
    out: dict[str, object] = {}
    spmd = init_device_mesh("cpu", (w, 1), mesh_dim_names=("dp_shard", "cp"))
    for label, dims in (("one_name", DataParallelMeshDims(shard="dp_shard")),
                        ("flattened", DataParallelMeshDims(shard=("dp_shard", "cp")))):
        base, _, tok = _build("transformer")
        named, direct, ref = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
        for b in named.blocks:
            fully_shard(b, mesh=spmd, dp_mesh_dims=dims)
        fully_shard(named, mesh=spmd, dp_mesh_dims=dims)
        for b in direct.blocks:
            fully_shard(b, mesh=spmd["dp_shard"])
        fully_shard(direct, mesh=spmd["dp_shard"])
        out[f"{label}_local"] = sum(p.to_local().numel() for p in named.parameters())
        out["total"] = sum(p.numel() for p in base.parameters())
        _train(named, tok, 3)
        _train(direct, tok, 3)
        _train(ref, tok, 3, average_over=w)
        out[f"{label}_bitwise_vs_direct"] = all(
            torch.equal(a, b) for a, b in zip(_full(named), _full(direct), strict=True))
        out[f"{label}_vs_one_device"] = max(_close(_full(named), _full(ref)))
    base, _, _ = _build("transformer")
    errors = {}
    for label, kwargs in (
            ("bad_name", {"dp_mesh_dims": DataParallelMeshDims(shard="dp")}),
            ("ddp_only", {"dp_mesh_dims": DataParallelMeshDims(replicate="dp_shard")}),
            ("not_dims", {"dp_mesh_dims": "dp_shard"})):
        try:
            fully_shard(copy.deepcopy(base).blocks[0], mesh=spmd, **kwargs)
            errors[label] = "no error"
        except (ValueError, TypeError, NotImplementedError) as e:
            errors[label] = f"{type(e).__name__}: {e}"
    lin = torch.nn.Linear(4, 4)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), spmd, [Replicate(), Replicate()]))
    try:
        fully_shard(lin, mesh=spmd, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
        errors["dtensor"] = "no error"
    except NotImplementedError as e:
        errors["dtensor"] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


@pytest.mark.skipif(DataParallelMeshDims is None, reason=f"torch {torch.__version__} has no "
                    f"DataParallelMeshDims (torch {_DIMS_SINCE} added it)")
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])  # W = 3 quick
def test_dp_mesh_dims_picks_the_data_parallel_submesh(world_size: int) -> None:
    results = run_distributed(_case, world_size)
    for label in ("one_name", "flattened"):  # sharded over the W ranks, not replicated
        assert sum(r[f"{label}_local"] for r in results) == results[0]["total"], results
    for res in results:
        for label in ("one_name", "flattened"):
            assert res[f"{label}_bitwise_vs_direct"] is True, res
            assert res[f"{label}_vs_one_device"] < RTOL, res
        e = res["errors"]
        assert e["bad_name"].startswith("ValueError") and "'dp'" in e["bad_name"], e
        assert e["ddp_only"].startswith("NotImplementedError") and "shard" in e["ddp_only"], e
        assert e["not_dims"].startswith("TypeError") and "DataParallelMeshDims" in e["not_dims"], e
        assert e["dtensor"].startswith("NotImplementedError") and "weight" in e["dtensor"], e


def _without_dims_case() -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from vefsdp_optim._fsdp import fully_shard

    spmd = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_shard", "cp"))
    try:
        fully_shard(torch.nn.Linear(4, 4), mesh=spmd, dp_mesh_dims=("dp_shard",))
    except NotImplementedError as e:
        return f"NotImplementedError: {e}"
    return "no error"


@pytest.mark.skipif(DataParallelMeshDims is not None, reason=f"torch {torch.__version__} has "
                    "DataParallelMeshDims: the test above runs instead")
def test_dp_mesh_dims_on_a_torch_without_them_names_the_release() -> None:
    for msg in run_distributed(_without_dims_case, 2):
        assert msg.startswith("NotImplementedError"), msg
        assert f"torch {_DIMS_SINCE} added" in msg and torch.__version__ in msg, msg
        assert "dp_mesh_dims" in msg and "mesh=" in msg, msg
