"""DistributedBuffer: a set of tensors of one dtype in one flat sharded buffer.

The layout comes from a ``BufferPlan``: rank r holds elements ``[r*m, (r+1)*m)`` of a
W * m buffer. Parameters are all-gathered and gradients reduce-scattered with one
collective each, straight between the flat buffers; every per-tensor tensor handed out
is a view (see the comment above ``DistributedBuffer``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vefsdp_optim.sharding import BufferPlan

from ._collectives import FlatWork, all_gather_flat, check_plan_consistent, reduce_scatter_flat

__all__ = ["DistributedBuffer"]

# The local shard (`local`, m elements) and the global buffer (`global_buffer`, W * m)
# are separate storages, and the collectives are out of place:
# all_gather_single(global_buffer, local), reduce_scatter_single(local_grad, grad_global).
# The collective itself moves this rank's m elements to their slot, so nothing is copied
# or allocated per tensor (the in-place form, and FSDP2's copies: docs/decisions.md).
# Per-tensor views (local_view, full_view, ...) are made once and cached; global views are
# made on the first alloc and survive free/alloc, which resize the one global storage to 0
# bytes and back (FSDP2's free_storage / alloc_storage), so the view objects see the new
# storage. With W == 1, or no process group, the global buffers *are* the local ones and
# no collective runs.


class DistributedBuffer:
    """Flat sharded storage for tensors of one dtype planned together, laid out by ``plan``.

    ``process_group=None`` means a single process: the plan must be for W = 1, unless ``rank``
    is given, which makes a *detached* buffer of that rank's shard (local storage and
    views only; the global buffers and collectives then raise RuntimeError).
    ``validate`` runs ``check_plan_consistent`` (one all-reduce of two int64) so that ranks
    with different plans raise ValueError instead of hanging in the first collective.
    ``pin_memory``: the local shards in page-locked host memory (a CPU ``device``).
    """

    plan: BufferPlan
    process_group: dist.ProcessGroup | None
    rank: int
    world_size: int
    dtype: torch.dtype
    device: torch.device
    local: torch.Tensor  # 1-D, m elements: this rank's shard of the parameters
    local_grad: torch.Tensor  # 1-D, m elements: this rank's reduced gradient shard

    def __init__(
        self,
        plan: BufferPlan,
        process_group: dist.ProcessGroup | None,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        rank: int | None = None,
        validate: bool = True,
        pin_memory: bool = False,
    ) -> None:
        if not isinstance(plan, BufferPlan):
            raise TypeError(f"plan must be a BufferPlan, got {type(plan).__name__}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError("process_group must be a ProcessGroup or None, got "
                            f"{type(process_group).__name__}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise TypeError(f"rank must be an int or None, got {rank!r}")
        self.plan = plan
        self.dtype = dtype
        self.device = torch.device(device)
        if process_group is None:
            self.process_group = None
            self.world_size = plan.world_size
            if rank is None and plan.world_size != 1:
                raise ValueError(
                    "process_group=None needs a plan for 1 rank, got one for "
                    f"{plan.world_size} ranks; pass the process group, or rank=... for a detached "
                    "local-only buffer")
            self.rank = 0 if rank is None else rank
            if not 0 <= self.rank < self.world_size:
                raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        else:
            self.process_group = process_group
            self.world_size = process_group.size()
            self.rank = process_group.rank()
            if rank is not None and rank != self.rank:
                raise ValueError(f"rank={rank} but this process is rank {self.rank} of the "
                                 "process group")
            if validate:
                check_plan_consistent(plan, process_group)
            elif plan.world_size != self.world_size:
                raise ValueError(
                    f"plan is for {plan.world_size} ranks but the process group has "
                    f"{self.world_size} ranks")
        self._detached = process_group is None and self.world_size != 1
        self._collective = process_group is not None and self.world_size > 1
        m = plan.shard_size
        self._offsets = plan.offsets
        self._layouts = {s.name: plan.layout(s.name) for s in plan.specs}
        # pin_memory: page-locked host shards, for asynchronous copies to and from an
        # accelerator (fully_shard's CPUOffloadPolicy)
        self.local = torch.zeros(m, dtype=dtype, device=self.device, pin_memory=pin_memory)
        self.local_grad = torch.zeros(m, dtype=dtype, device=self.device, pin_memory=pin_memory)
        self._local_views = self._make_local_views(self.local)
        self._local_grad_views = self._make_local_views(self.local_grad)
        if self._collective:
            # allocated on the first alloc_*; views are made then (see the comment above the class)
            self._global = torch.empty(0, dtype=dtype, device=self.device)  # 1-D, W*m once alloc'd
            self._grad_global = torch.empty(0, dtype=dtype, device=self.device)  # 1-D, W*m
            self._full_views: dict[str, torch.Tensor] | None = None
            self._grad_full_views: dict[str, torch.Tensor] | None = None
        elif not self._detached:
            self._global, self._grad_global = self.local, self.local_grad
            self._full_views = self._make_full_views(self.local)
            self._grad_full_views = self._make_full_views(self.local_grad)

    # -- local shard ----------------------------------------------------------------

    def _make_local_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        m, lo = self.plan.shard_size, self.rank * self.plan.shard_size
        views = {}
        for s in self.plan.specs:
            off = self._offsets[s.name]
            a, b = min(max(off - lo, 0), m), min(max(off + s.numel - lo, 0), m)
            views[s.name] = flat[a:b]
        return views

    def _name(self, name: str) -> str:
        if name not in self._offsets:
            raise KeyError(f"no tensor named {name!r} in this buffer's plan; names: "
                           f"{list(self._offsets)}")
        return name

    def local_view(self, name: str) -> torch.Tensor:
        """1-D view into ``local`` of this rank's slice of tensor ``name`` (may be empty)."""
        return self._local_views[self._name(name)]

    def local_grad_view(self, name: str) -> torch.Tensor:
        """1-D view into ``local_grad`` of this rank's slice of ``name``'s gradient."""
        return self._local_grad_views[self._name(name)]

    def local_extent(self, name: str) -> tuple[int, int]:
        """``(start in tensor, length)`` of this rank's slice: ``plan.layout(name).local(rank)``."""
        return self._layouts[self._name(name)].local(self.rank)

    # -- global buffers -------------------------------------------------------------

    def _make_full_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for s in self.plan.specs:
            off = self._offsets[s.name]
            views[s.name] = flat[off:off + s.numel].view(s.shape)
        return views

    def _need_global(self, what: str) -> None:
        if self._detached:
            raise RuntimeError(
                f"{what}: this buffer is detached (process_group=None, plan for "
                f"{self.world_size} ranks); it holds rank {self.rank}'s shard only")

    def _alloc(self, flat: torch.Tensor, zero: bool) -> bool:
        """Give ``flat`` storage for W * m elements; True if it had none."""
        n = self.plan.global_size
        nbytes = n * flat.element_size()
        storage = flat.untyped_storage()
        if flat.numel() == n and storage.nbytes() == nbytes:
            return False
        if flat.numel() != n:  # first allocation: size the tensor itself
            flat.resize_(n)
        else:
            storage.resize_(nbytes)
        if zero:
            flat.zero_()
        return True

    @staticmethod
    def _free(flat: torch.Tensor) -> None:
        storage = flat.untyped_storage()
        if storage.nbytes() != 0:
            storage.resize_(0)

    @property
    def global_allocated(self) -> bool:
        """Whether the W * m parameter buffer has storage now."""
        if not self._collective:
            return not self._detached
        return self._global.untyped_storage().nbytes() > 0

    @property
    def grad_global_allocated(self) -> bool:
        """Whether the W * m gradient buffer has storage now."""
        if not self._collective:
            return not self._detached
        return self._grad_global.untyped_storage().nbytes() > 0

    def alloc_global(self) -> None:
        """(Re)allocate the W * m parameter buffer's storage; no-op if allocated.

        Contents are undefined until the next ``all_gather``.
        """
        self._need_global("alloc_global")
        if self._collective:
            self._alloc(self._global, zero=False)
            if self._full_views is None:
                self._full_views = self._make_full_views(self._global)

    def free_global(self) -> None:
        """Release the W * m parameter buffer's storage (views stay valid objects)."""
        self._need_global("free_global")
        if self._collective:
            self._free(self._global)

    def alloc_grad_global(self) -> None:
        """(Re)allocate the W * m gradient buffer, zero-filled; no-op if allocated."""
        self._need_global("alloc_grad_global")
        if self._collective:
            self._alloc(self._grad_global, zero=True)
            if self._grad_full_views is None:
                self._grad_full_views = self._make_full_views(self._grad_global)

    def free_grad_global(self) -> None:
        """Release the W * m gradient buffer's storage (views stay valid objects)."""
        self._need_global("free_grad_global")
        if self._collective:
            self._free(self._grad_global)

    @property
    def global_buffer(self) -> torch.Tensor:  # 1-D, W * m elements
        self._need_global("global_buffer")
        if self._collective and not self.global_allocated:
            raise RuntimeError("global_buffer has no storage; call alloc_global() first")
        return self._global

    @property
    def grad_global(self) -> torch.Tensor:  # 1-D, W * m elements; padding stays zero
        self._need_global("grad_global")
        if self._collective and not self.grad_global_allocated:
            raise RuntimeError("grad_global has no storage; call alloc_grad_global() first")
        return self._grad_global

    def full_view(self, name: str) -> torch.Tensor:
        """View of the global buffer with tensor ``name``'s global shape (same object each call)."""
        self._need_global("full_view")
        if self._full_views is None:
            raise RuntimeError("full_view needs the global buffer allocated once; call "
                               "alloc_global() first")
        return self._full_views[self._name(name)]

    def grad_full_view(self, name: str) -> torch.Tensor:
        """View of the global gradient buffer with tensor ``name``'s global shape."""
        self._need_global("grad_full_view")
        if self._grad_full_views is None:
            raise RuntimeError("grad_full_view needs alloc_grad_global() called once first")
        return self._grad_full_views[self._name(name)]

    # -- collectives ----------------------------------------------------------------

    def all_gather(self, async_op: bool = False) -> FlatWork | None:
        """All-gather ``local`` into ``global_buffer`` with one collective, in place.

        Allocates the global buffer if it was freed. Returns a handle to ``wait()`` on
        when ``async_op`` (None when there is no collective: W == 1).
        """
        self._need_global("all_gather")
        if not self._collective:
            return None
        self.alloc_global()
        return all_gather_flat(self._global, self.local, self.process_group, async_op=async_op)

    def reduce_scatter(self, op: str = "avg", async_op: bool = False) -> FlatWork | None:
        """Reduce-scatter ``grad_global`` into ``local_grad`` with one collective.

        ``op`` is ``"sum"`` or ``"avg"`` over the W ranks. The gradient buffer must be
        allocated (it holds the gradients to reduce). Returns a handle to ``wait()`` on
        when ``async_op`` (None when there is no collective: W == 1).
        """
        if op not in ("sum", "avg"):
            raise ValueError(f"reduce op must be 'sum' or 'avg', got {op!r}")
        self._need_global("reduce_scatter")
        if not self._collective:
            return None
        if not self.grad_global_allocated:
            raise RuntimeError("reduce_scatter needs grad_global allocated and filled; call "
                               "alloc_grad_global()")
        return reduce_scatter_flat(self.local_grad, self._grad_global, self.process_group, op=op,
                                   async_op=async_op)

    def __repr__(self) -> str:
        return (f"DistributedBuffer(tensors={len(self.plan.specs)}, W={self.world_size}, "
                f"rank={self.rank}, m={self.plan.shard_size}, dtype={self.dtype}, "
                f"device={self.device}, global_allocated={self.global_allocated})")
