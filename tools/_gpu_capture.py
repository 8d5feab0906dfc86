"""Every optimizer with ``capturable=True``: one ``opt.step()`` captured in a CUDA graph and
replayed, bit for bit against eager steps (``make gpu-check``'s part ``capture``).

[Note: captured steps against eager steps]
For each optimizer config (the rows of tests/test_capturable.py's ``CASES``, at their
defaults here, so the 8-bit Adams run their Triton kernel; SOAP and Shampoo with a
``precondition_frequency`` that puts no refresh among the captured steps) and each kind of
parameter (plain CUDA tensors, our ``fully_shard`` and FSDP2's at W = 1, the exchange
included), two copies A and B of one model, each with a 0-d CUDA ``lr`` tensor:

- the gradients are static: each step copies its gradient into the ``.grad`` tensors made
  once by a backward (the sharded ``.grad`` of fully_shard / FSDP2), and fills the ``lr``
  tensor in place;
- A takes ``STEPS`` eager steps; B takes ``WARMUP`` eager steps on a side stream (torch's
  CUDA graph pattern), then one ``opt.step()`` is captured and replayed for the rest;
- every parameter (whole) and every state tensor of A and B must be the same bits;
- then ``TIMED`` eager steps against ``TIMED`` replays (CUDA events, medians).

A case that fails records its error and the next case runs; a CUDA error that leaves the
device unusable ends the part with what it has ([Note: part results survive the part]).
On the CPU (the dry run) the same flow runs with eager ``opt.step()`` calls in place of
the capture and the replays, the CPU let into torch's capturable devices meanwhile.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten_with_path

import tools._checkout  # noqa: F401 - before vefsdp_optim: [Note: checkout imports]
import vefsdp_optim
from tools._gpu_correct import Bag
from tools._gpu_parts import progress, run_on_ranks

__all__ = ["CASES", "KINDS", "capture_part", "capture_case"]

Factory = Callable[..., torch.optim.Optimizer]
NO_REFRESH = 10_000  # SOAP / Shampoo: no preconditioner refresh after the first step here
CASES: dict[str, Factory] = {  # tests/test_capturable.py's rows, at the optimizers' defaults
    "AdamW": lambda ps, **kw: vefsdp_optim.AdamW(ps, weight_decay=0.1, **kw),
    "AdamW-amsgrad": lambda ps, **kw: vefsdp_optim.AdamW(ps, amsgrad=True, **kw),
    "AdamW8bit": lambda ps, **kw: vefsdp_optim.AdamW8bit(ps, **kw),
    "Adam8bit": lambda ps, **kw: vefsdp_optim.Adam8bit(ps, weight_decay=0.1, **kw),
    "Muon": lambda ps, **kw: vefsdp_optim.Muon(ps, **kw),
    "NorMuon": lambda ps, **kw: vefsdp_optim.NorMuon(ps, **kw),
    "Muon-int8": lambda ps, **kw: vefsdp_optim.Muon(ps, momentum_dtype=torch.int8, **kw),
    "NorMuon-int8": lambda ps, **kw: vefsdp_optim.NorMuon(ps, momentum_dtype=torch.int8, **kw),
    "Shampoo": lambda ps, **kw: vefsdp_optim.Shampoo(ps, max_preconditioner_dim=64, precondition_frequency=NO_REFRESH,
                                                     start_preconditioning_step=1, **kw),
    "SOAP": lambda ps, **kw: vefsdp_optim.SOAP(ps, precondition_frequency=NO_REFRESH, **kw),
}
KINDS = ("plain", "fully_shard", "fsdp2")
# two matrices of one shape (batched Newton-Schulz), an uneven one, vectors; "gpu": the
# matrices over the 8-bit Adams' default min_8bit_size (4096), so their 8-bit path runs
SHAPES = {"gpu": [(256, 192), (256, 192), (160, 130), (1000,), (7,)],
          "tiny": [(64, 48), (64, 48), (40, 33), (300,), (7,)]}
STEPS, WARMUP, TIMED = 8, 3, 20
LR = 1e-2


def _lr(k: int) -> float:
    return LR * 0.9**k  # a schedule: the lr tensor is filled in place before each step


@contextlib.contextmanager
def capturable_on_cpu() -> Iterator[None]:
    """Within: ``capturable=True`` accepted on CPU tensors (tests/capturable_utils.py's patch
    of torch's list of capturable devices, which torch's Adam(W) and our checks read)."""
    import torch.optim.adam as torch_adam
    import torch.optim.optimizer as torch_optimizer

    modules = (torch_optimizer, torch_adam)
    originals = [m._get_capturable_supported_devices for m in modules]

    def devices(supports_xla: bool = True) -> list[str]:
        return [*originals[0](supports_xla), "cpu"]

    for m in modules:
        m._get_capturable_supported_devices = devices
    try:
        yield
    finally:
        for m, f in zip(modules, originals, strict=True):
            m._get_capturable_supported_devices = f


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds ``t``'s data on this rank (a DTensor's or a
    ShardedParameter's local part; the whole tensor at W = 1)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t._local_tensor
    if isinstance(t, vefsdp_optim.ShardedParameter):
        return t._local
    return t


def _full(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.full_tensor().detach() if hasattr(t, "full_tensor") else t.detach()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _model(kind: str, shapes: list[tuple[int, ...]], device: str) -> Bag:
    model = Bag(shapes).to(device)
    if kind != "plain":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (dist.get_world_size(),))
        if kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            from vefsdp_optim import fully_shard
        fully_shard(model, mesh=mesh)
    return model


class _Copy:
    """One model, its optimizer (``capturable=True``, a 0-d ``lr`` tensor on the device)
    and its static gradients."""

    def __init__(self, name: str, kind: str, shapes: list[tuple[int, ...]], device: str) -> None:
        self.model = _model(kind, shapes, device)
        self.params = self.model.params()
        # the .grad tensors, made once by a backward (fully_shard / FSDP2: the sharded ones)
        self.model([torch.zeros(s, device=device) for s in shapes]).backward()
        self.lr = torch.full((), _lr(0), dtype=torch.float32, device=device)
        self.opt = CASES[name](self.params, lr=self.lr, capturable=True)
        # after the constructor, which may lay the parameters and their .grad out anew (our
        # fully_shard: a matrix optimizer's whole matrices)
        self.grads = [_local(p.grad) for p in self.params]

    def feed(self, grads: list[torch.Tensor], k: int) -> None:
        """Step ``k``'s gradients and lr, copied into the existing tensors (a graph reads
        the ones it captured: a step must not replace them)."""
        for i, (p, mine, g) in enumerate(zip(self.params, self.grads, grads, strict=True)):
            if _local(p.grad).data_ptr() != mine.data_ptr():
                raise AssertionError(f"p{i}.grad was replaced before step {k}: a captured step would read "
                                     "the gradient it was captured with")
            mine.copy_(g.reshape(mine.shape))
        self.lr.fill_(_lr(k))

    def state(self) -> list[tuple[str, Any]]:
        out = []
        for i, p in enumerate(self.params):
            for path, v in tree_flatten_with_path(self.opt.state.get(p, {}))[0]:
                out.append((f"p{i}{keystr(path)}", v))
        return out


_VALUES = (bool, int, float, str, type(None), slice, torch.dtype, torch.Size, torch.device)


def _compare(a: _Copy, b: _Copy) -> dict[str, Any] | None:
    """The first difference of A and B (parameters whole, then state), or None."""
    for i, (pa, pb) in enumerate(zip(a.params, b.params, strict=True)):
        fa, fb = _full(pa), _full(pb)
        if not torch.equal(_bits(fa), _bits(fb)):
            d = (fa.double() - fb.double()).abs()
            return {"what": f"parameter p{i}", "n_diff": int((fa != fb).sum()), "numel": fa.numel(),
                    "max_abs": float(d.max())}
    sa, sb = a.state(), b.state()
    if [k for k, _ in sa] != [k for k, _ in sb]:
        return {"what": "state keys", "a": [k for k, _ in sa], "b": [k for k, _ in sb]}
    for (key, va), (_, vb) in zip(sa, sb, strict=True):
        if isinstance(va, torch.Tensor):
            la, lb = _local(va), _local(vb)
            if la.dtype != lb.dtype or la.shape != lb.shape or not torch.equal(_bits(la), _bits(lb)):
                return {"what": f"state {key}", "n_diff": int((la != lb).sum()) if la.shape == lb.shape else None,
                        "numel": la.numel()}
        elif type(va) is not type(vb) or (isinstance(va, _VALUES) and va != vb):  # other objects: by type
            return {"what": f"state {key}", "a": repr(va), "b": repr(vb)}
    return None


def _usable(device: str) -> str | None:
    """None where the device still runs work; else why not (a poisoned CUDA context)."""
    if device != "cuda":
        return None
    try:
        torch.ones(4, device=device).sum().item()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any error here ends the part
        return f"{type(e).__name__}: {e}"
    return None


def capture_case(name: str, kind: str, size: str, device: str) -> dict[str, Any]:
    """One optimizer on one kind of parameter ([Note: captured steps against eager steps])."""
    cuda = device == "cuda"
    shapes = SHAPES[size]
    grads = [[torch.randn(s, generator=torch.Generator().manual_seed(1000 * k + i)).to(device)
              for i, s in enumerate(shapes)] for k in range(STEPS)]  # on the device before any step
    a = _Copy(name, kind, shapes, device)
    b = _Copy(name, kind, shapes, device)
    for k in range(STEPS):
        a.feed(grads[k], k)
        if k == 0:  # the copies reach the gradients the optimizer reads
            for i, (p, g) in enumerate(zip(a.params, grads[0], strict=True)):
                if not torch.equal(_full(p.grad), g):
                    raise AssertionError(f"p{i}.grad is not the gradient copied into it: the static "
                                         "gradients do not reach the optimizer")
        a.opt.step()
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        warm: Any = torch.cuda.stream(side)
    else:
        warm = contextlib.nullcontext()
    with warm:
        for k in range(WARMUP):
            b.feed(grads[k], k)
            b.opt.step()
    if cuda:
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            b.opt.step()  # captured, not run: its first replay is step WARMUP
        replay = graph.replay
    else:
        graph = None
        replay = b.opt.step
    for k in range(WARMUP, STEPS):
        b.feed(grads[k], k)
        replay()
    replays = STEPS - WARMUP
    if cuda and hasattr(b.opt, "count_replays"):
        b.opt.count_replays(replays - 1)  # the captured step() counted the first one
    mismatch = _compare(a, b)
    eager_ms, replay_ms = _time(a.opt.step, cuda), _time(replay, cuda)
    if cuda and hasattr(b.opt, "count_replays"):
        b.opt.count_replays(TIMED)
    del graph
    return dict(equal=mismatch is None, mismatch=mismatch, steps=STEPS, captured=cuda,
                eager_ms=eager_ms, replay_ms=replay_ms,
                ratio=round(eager_ms / replay_ms, 3) if replay_ms else None)


def _time(fn: Callable[[], Any], cuda: bool) -> float:
    """Median milliseconds of ``TIMED`` calls (CUDA events on the GPU)."""
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(TIMED)]
        for e0, e1 in events:
            e0.record()
            fn()
            e1.record()
        torch.cuda.synchronize()
        return round(statistics.median(e0.elapsed_time(e1) for e0, e1 in events), 4)
    times = []
    for _ in range(TIMED):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 4)


def _cases(size: str, device: str, optimizers: list[str] | None) -> list[dict[str, Any]]:
    # a name selects its row and its variants ("AdamW": AdamW and AdamW-amsgrad), in CASES' order
    want = optimizers or list(CASES)
    names = [n for n in CASES if any(n == w or n.startswith(w + "-") for w in want)]
    unknown = sorted(w for w in want if not any(n == w or n.startswith(w + "-") for n in CASES))
    if unknown:
        raise ValueError(f"optimizers: unknown {unknown}; accepted: {', '.join(CASES)}")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        if dist.is_initialized():  # NCCL's communicator made before any capture
            t = torch.ones(1, device=device)
            dist.all_reduce(t)
            torch.cuda.synchronize()
    patch = capturable_on_cpu() if device == "cpu" else contextlib.nullcontext()
    out: list[dict[str, Any]] = []
    with patch:
        for kind in KINDS:
            for name in names:
                case = f"{name} on {kind}"
                progress({"start": case})
                t0 = time.monotonic()
                try:
                    res = capture_case(name, kind, size, device)
                    res["error"] = None
                except Exception:  # noqa: BLE001 - recorded in the case; the next one runs
                    res = dict(equal=False, mismatch=None, error=traceback.format_exc()[-4000:])
                res = dict(optimizer=name, kind=kind, world=1, ok=res["error"] is None and res["equal"], **res,
                           wall_s=round(time.monotonic() - t0, 2))
                progress(res)
                print(f"capture: {case}: " + ("ok" if res["ok"] else "FAIL") + f" ({res['wall_s']} s)", flush=True)
                out.append(res)
                if res["error"] is not None:
                    why = _usable(device)
                    if why is not None:
                        out.append(dict(optimizer="(stopped)", kind=kind, world=1, ok=False, equal=False,
                                        mismatch=None, error=f"the device is unusable after {case}: {why}"))
                        progress(out[-1])
                        return out
    return out


def capture_part(part: str, world: int, device: str, size: str, part_dir: Path,
                 optimizers: list[str] | None = None) -> dict[str, Any]:
    """The part ``capture`` (W = 1: a process group of one, NCCL or gloo)."""
    if world != 1:
        raise ValueError(f"the capture part runs at world size 1, got {world}")
    (cases,) = run_on_ranks(_cases, 1, device, part_dir, size, device, optimizers)
    return dict(kind="correctness", world=1, captures=cases,
                status="pass" if cases and all(c["ok"] for c in cases) else "fail")
