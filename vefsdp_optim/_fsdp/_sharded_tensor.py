"""ShardedParameter: a tensor with a global shape whose data is one rank's ragged slice.

Like FSDP2's DTensor, but the placement is a :class:`RaggedShard` of the flattened
storage and the local data is a 1-D view into its store's DistributedBuffer. Elementwise
ops (and torch's fused optimizer kernels) run on the local slices; norms are partial
sums and one all_reduce; any other op gathers its sharded operands and returns a plain
replicated tensor, as DTensor does. The rules are [Note: sharded dispatch], in
``_sharded_dispatch.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from vefsdp_optim._torch_compat import make_wrapper_subclass
from vefsdp_optim.comm import ShardedView, all_gather_flat
from vefsdp_optim.sharding import BoxShard, RaggedShard
from vefsdp_optim.sharding._box import flat_range_boxes

from ._sharded_dispatch import dispatch

if TYPE_CHECKING:
    from vefsdp_optim._flat_store import FlatStore

__all__ = ["OutsideUse", "ShardedParameter", "flat_range_boxes"]


class OutsideUse(Protocol):
    """How fully_shard routes a parameter's uses outside its module's forward
    ([Note: use outside forward] in _state.py)."""

    def forward(self) -> None:
        """A differentiable ``full_tensor()`` of the parameter was taken."""

    def backward(self, grad: torch.Tensor) -> None:
        """Its gradient (a plain tensor of the global shape), into the shard group's reduction."""


class _FullTensor(torch.autograd.Function):
    """``full_tensor()`` of a fully_shard parameter under grad mode: the gathered copy;
    its gradient goes to the shard group, none to the sharded face."""

    @staticmethod
    def forward(p: ShardedParameter, use: OutsideUse) -> torch.Tensor:  # noqa: ANN205
        return p._gather_full()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
        ctx.use = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        ctx.use.backward(grad)
        return None, None


class ShardedParameter(torch.Tensor):
    """A tensor of global ``shape`` stored as this rank's part under ``layout``: its slice
    ``layout.local(rank)`` of a RaggedShard, or its box (or run of one) of a BoxShard
    ([Note: boxes in flat order]; tensor-parallel optimizer state).

    ``_local`` is a 1-D view of the flat row-major storage (may be empty);
    ``nn.Parameter(ShardedParameter(...))`` keeps the subclass, as for DTensor.
    """

    _local: torch.Tensor  # 1-D, layout.local_numel(rank) elems
    _layout: RaggedShard | BoxShard
    _process_group: dist.ProcessGroup | None  # None iff layout.world_size == 1
    _rank: int
    _store: FlatStore | None = None  # fully_shard's parameters: the store they live in
    _outside_use: OutsideUse | None = None  # fully_shard's parameters: [Note: use outside forward]

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        layout: RaggedShard | BoxShard,
        process_group: dist.ProcessGroup | None,
        shape: Sequence[int],
        rank: int,
        requires_grad: bool = False,
    ) -> ShardedParameter:
        shape = torch.Size(shape)
        if local.dim() != 1 or local.numel() != layout.local_numel(rank):
            raise ValueError(
                f"local data must be 1-D with {layout.local_numel(rank)} elements for "
                f"rank {rank} of layout {layout}, got shape {tuple(local.shape)}")
        if math.prod(shape) != layout.numel:
            raise ValueError(f"shape {tuple(shape)} has {math.prod(shape)} elements, layout has "
                             f"{layout.numel}")
        t = make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=requires_grad)
        t._local = local
        t._layout = layout
        t._process_group = process_group
        t._rank = rank
        return t

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # state set in __new__
        super().__init__()

    # -- public accessors -------------------------------------------------------------

    @property
    def ragged_layout(self) -> RaggedShard | BoxShard:
        """The layout of this tensor over its shard process group: a :class:`RaggedShard`, or a
        :class:`BoxShard` for tensor-parallel optimizer state."""
        return self._layout

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._process_group

    @property
    def shard_rank(self) -> int:
        """This rank's index in :attr:`process_group` (0 at W = 1)."""
        return self._rank

    def flat_store(self) -> FlatStore | None:
        """The ``FlatStore`` this parameter's local data live in ([Note: flat store
        contract]); None for tensors that are not a fully_shard parameter."""
        return self._store

    def bind_store(self, store: FlatStore) -> None:
        """Declare the store this parameter lives in (fully_shard, once)."""
        self._store = store

    def bind_outside_use(self, use: OutsideUse) -> None:
        """Declare where this parameter's uses outside its module's forward go (fully_shard,
        once)."""
        self._outside_use = use

    def rebind_(self, local: torch.Tensor, layout: RaggedShard,
                process_group: dist.ProcessGroup | None, rank: int) -> None:
        """Point this same object at new local data and layout (a re-plan)."""
        if (local.dim() != 1 or local.numel() != layout.local_numel(rank)
                or layout.numel != self.numel()):
            raise ValueError(f"local data of shape {tuple(local.shape)} is not rank "
                             f"{rank}'s slice of layout {layout.extents} of a tensor of shape "
                             f"{tuple(self.shape)}")
        self._local, self._layout, self._process_group, self._rank = (local, layout, process_group,
                                                                      rank)

    def with_local(self, local: torch.Tensor) -> ShardedParameter:
        """A new ShardedParameter of this one's shape and layout over ``local`` (e.g. its
        gradient, a view of the gradient buffer)."""
        return self._same(local)

    def to_local(self) -> torch.Tensor:
        """This rank's 1-D slice (a view of the shared storage, no copy)."""
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, gathered from every rank (a plain tensor, new storage).

        For a fully_shard parameter that requires grad, under grad mode, differentiable
        as FSDP2's ``DTensor.full_tensor()``: its gradient joins the shard group's
        reduction ([Note: use outside forward] in _state.py).
        """
        use = self._outside_use
        if use is not None and self.requires_grad and torch.is_grad_enabled():
            use.forward()
            return _FullTensor.apply(self, use)
        return self._gather_full()

    def _gather_full(self) -> torch.Tensor:
        """``full_tensor()`` outside autograd (one all-gather)."""
        w = self._layout.world_size
        local = self._local.detach()
        if w == 1:
            return local.clone().view(self.shape)
        lay = self._layout
        n = max(lay.local_numel(r) for r in range(w))
        padded = local.new_zeros(n)
        padded[: local.numel()] = local
        out = local.new_empty(w * n)
        all_gather_flat(out, padded, self._process_group)
        parts = [out[r * n: r * n + lay.local_numel(r)] for r in range(w)]
        if isinstance(lay, RaggedShard):
            return torch.cat(parts).view(self.shape)
        full = local.new_empty(lay.numel)
        for r, part in enumerate(parts):
            full[lay.local_index(r, full.device)] = part
        return full.view(self.shape)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedParameter:
        """A copy with its own local data over the same layout and process group (a
        process group is shared, never copied; as for DTensor and its mesh): what
        ``copy.deepcopy(optimizer.state_dict())`` needs. The copy is bound to no store."""
        if id(self) in memo:
            return memo[id(self)]
        local = self._local.detach().clone()
        out = ShardedParameter(local, self._layout, self._process_group, self.shape, self._rank,
                               requires_grad=self.requires_grad)
        if isinstance(self, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    def untyped_storage(self) -> torch.UntypedStorage:
        """The storage of this rank's local data, its store's buffer (no copy).

        A wrapper tensor has no storage of its own; asking for its data pointer raises
        "invalid python storage". Frameworks that compare storages (torchtitan's
        checkpoint ``ModelWrapper``) look through FSDP2's DTensor to its local tensor;
        this answers the same question for ours. ``data_ptr()`` stays 0, as DTensor's.
        """
        return self._local.untyped_storage()

    def __sharded_view__(self) -> ShardedView:
        return ShardedView(
            local=self._local.detach() if self._local.requires_grad else self._local,
            layout=self._layout, process_group=self._process_group, shape=self.shape,
            rank=self._rank)

    def _same(self, local: torch.Tensor) -> ShardedParameter:
        return ShardedParameter(local, self._layout, self._process_group, self.shape, self._rank)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (f"ShardedParameter(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"rank={self._rank}, layout={self._layout}, local={self._local!r})")

    def __reduce_ex__(self, protocol: int) -> Any:
        raise NotImplementedError("ShardedParameter does not pickle; call full_tensor() first")

    # -- torch.distributed.checkpoint protocol (see ``flat_range_boxes`` in sharding/_box.py) -----

    def _boxes(self) -> list[tuple[torch.Size, torch.Size, int]]:
        lay = self._layout
        if isinstance(lay, RaggedShard):
            start, length = lay.local(self._rank)
            return flat_range_boxes(self.shape, start, length)
        b = lay.boxes[self._rank]  # a run of a box: the run's boxes in the box, shifted
        return [(torch.Size(o + a for o, a in zip(offsets, b.offsets, strict=True)), sizes, f)
                for offsets, sizes, f in flat_range_boxes(b.sizes, b.start, b.length)]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self._local)
        return [
            WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                  properties=props, size=self.shape))
            for offsets, sizes, _ in self._boxes()
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets, sizes) for offsets, sizes, _ in self._boxes()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        """The view of the local data that holds the box at ``index.offset`` (no copy:
        DCP's load writes into it, so the parameter is loaded in place)."""
        for offsets, sizes, flat in self._boxes():
            if index.offset is not None and torch.Size(index.offset) == offsets:
                return self._local.detach()[flat: flat + math.prod(sizes)].view(sizes)
        raise ValueError(
            f"{index.fqn}: no box at offset {index.offset} on rank {self._rank}; this rank "
            f"holds {[tuple(o) for o, _, _ in self._boxes()]} of shape {tuple(self.shape)}")

    # -- dispatch ---------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        return dispatch(cls, func, args, kwargs or {})  # [Note: sharded dispatch]
