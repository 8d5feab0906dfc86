"""QK-clip (MuonClip) on Muon and NorMuon: the math against an independent per-head
reference and against the logits themselves (MHA, GQA, MLA with its shared rotary key, a
fused QKV weight), every rank's piece of a row against the whole row on simulated
layouts (flat slices cut inside rows, tensor-parallel boxes and runs of them), and, at
W = 1, 2 and 3, plain, FSDP2, fully_shard and tensor-parallel weights after real steps,
bit for bit equal to one device; no host sync; the errors."""

from __future__ import annotations

import math
import types

import pytest
import torch
from dist_utils import run_distributed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import vefsdp_optim
from vefsdp_optim._math._qk_clip import (
    QKClipHeads,
    qk_clip_,
    qk_clip_gamma,
    qk_clip_row_scales,
    scale_rows_,
)
from vefsdp_optim._qk_clip import _scale_view_
from vefsdp_optim.sharding import Box, BoxShard, RaggedShard

TAU = 10.0
# attention -> (head layout, in_features); odd head and row counts, so cuts land inside heads
ATTN: dict[str, tuple[dict, int]] = {
    "gqa": (dict(num_heads=6, head_dim=3, num_kv_heads=3), 7),  # q 18 x 7, k 9 x 7
    "mla": (dict(num_heads=3, head_dim=2, rope_head_dim=1, v_head_dim=3), 5),  # q 9 x 5, kv 15 x 5
    "fused": (dict(num_heads=3, head_dim=3, num_kv_heads=1), 7),  # qkv 15 x 7: split_sizes (9, 3, 3)
    "mha": (dict(num_heads=5, head_dim=3), 13),  # q, k: 15 x 13
}
# per round: each head's max logit (below, at, above tau; a non-finite one leaves its group alone)
LOGITS = [
    {"mha": [3.0, 10.0, 25.0, 12.5, 40.0], "gqa": [3.0, 30.0, 9.0, 10.0, 50.0, 11.0],
     "mla": [100.0, 2.0, 13.0], "fused": [15.0, 8.0, 12.0]},
    {"mha": [11.0, float("inf"), 9.0, 10.0, 1e4], "gqa": [float("nan"), 30.0, 10.0, 10.0, -5.0, 20.0],
     "mla": [10.5, 64.0, 1.0], "fused": [1.0, 2.0, 3.0]},
]


def _heads(name: str) -> QKClipHeads:
    h = dict(ATTN[name][0])
    return QKClipHeads(h["num_heads"], h["head_dim"], h.get("num_kv_heads", h["num_heads"]),
                       h.get("rope_head_dim", 0), h.get("v_head_dim", 0))


def _shapes() -> dict[str, tuple[int, int]]:
    out = {}
    for name, (_, cols) in ATTN.items():
        h = _heads(name)
        if name == "fused":
            out["fused_qkv"] = (h.qkv_rows, cols)
        else:
            out[f"{name}_q"], out[f"{name}_k"] = (h.q_rows, cols), (h.k_rows, cols)
    return out


def _weights(name: str, ws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The registered weights of attention ``name`` among ``ws`` (by parameter name)."""
    return {"qkv": ws["fused_qkv"]} if name == "fused" else {"q": ws[f"{name}_q"], "k": ws[f"{name}_k"]}


def reference_clip_(ws: dict[str, torch.Tensor], logits: torch.Tensor, layout: dict, tau: float,
                    alpha: float) -> None:
    """QK-clip written head by head from the paper's rule (Kimi K2, Algorithm 1; GQA as
    Megatron-LM's group factor; MLA: q^C, k^C by gamma^alpha / gamma^(1 - alpha), q^R by
    gamma, values and the shared k^R untouched); each row multiplied in float32."""
    nh, d = layout["num_heads"], layout["head_dim"]
    nkv, r, v = layout.get("num_kv_heads", nh), layout.get("rope_head_dim", 0), layout.get("v_head_dim", 0)
    per = nh // nkv
    s = logits.float().view(nkv, per).amax(1)
    t = torch.full_like(s, tau)
    gamma = torch.where(torch.isfinite(s) & (s > t), t / s, torch.ones_like(s))
    fq, fk = gamma.pow(alpha), gamma.pow(1 - alpha)
    if "qkv" in ws:
        q, k = ws["qkv"][:nh * d], ws["qkv"][nh * d:(nh + nkv) * d]
    else:
        q, k = ws["q"], ws["k"]

    def mul(w: torch.Tensor, lo: int, hi: int, f: torch.Tensor) -> None:
        w[lo:hi] = (w[lo:hi].to(torch.promote_types(w.dtype, f.dtype)) * f).to(w.dtype)

    for h in range(nh):
        mul(q, h * (d + r), h * (d + r) + d, fq[h // per])
        if r:
            mul(q, h * (d + r) + d, (h + 1) * (d + r), gamma[h // per])
    for g in range(nkv):
        mul(k, g * (d + v), g * (d + v) + d, fk[g])


def _init(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in _shapes().items()}


# -- the math on whole weights ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_math_equals_reference(dtype: torch.dtype, alpha: float) -> None:
    for rnd, logits in enumerate(LOGITS):
        ws, want = _init(dtype, rnd), _init(dtype, rnd)
        for name in ATTN:
            ml = torch.tensor(logits[name])
            got = _weights(name, ws)
            qk_clip_(got.get("q"), got.get("k"), ml, TAU, alpha, _heads(name), qkv=got.get("qkv"))
            reference_clip_(_weights(name, want), ml, ATTN[name][0], TAU, alpha)
        for k in ws:
            assert torch.equal(ws[k], want[k]), (rnd, k)
        changed = [k for k in ws if not torch.equal(ws[k], _init(dtype, rnd)[k])]
        assert changed, "no head was clipped: the test would pass with no clip at all"


def _qkv_proj(w: torch.Tensor, x: torch.Tensor, heads: int, rows: int) -> torch.Tensor:
    return (x @ w.T).view(x.shape[0], heads, rows).transpose(0, 1)  # (heads, tokens, rows)


def test_logits_land_at_the_threshold() -> None:
    """The max logit of a clipped head (GQA: of its group) becomes tau, the others stay;
    MLA's rotary part scales by the whole factor with the shared rotary key untouched."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 7, generator=g, dtype=torch.float64)
    for name, h, nkv in (("mha", 4, 4), ("gqa", 6, 2)):
        d = 3
        wq, wk = 4 * torch.randn(h * d, 7, generator=g, dtype=torch.float64), \
            4 * torch.randn(nkv * d, 7, generator=g, dtype=torch.float64)

        def logits(wq: torch.Tensor = wq, wk: torch.Tensor = wk, h: int = h, nkv: int = nkv) -> torch.Tensor:
            q, k = _qkv_proj(wq, x, h, 3), _qkv_proj(wk, x, nkv, 3).repeat_interleave(h // nkv, 0)
            return (q @ k.transpose(1, 2) / math.sqrt(3)).amax((1, 2))

        before = logits()
        group = before.view(nkv, -1).amax(1).repeat_interleave(h // nkv)  # each head's group maximum
        tau = float(group.min() + group.max()) / 2
        qk_clip_(wq, wk, before, tau, 0.5, QKClipHeads(h, d, nkv))
        after = logits()
        assert (group > tau).any() and (group <= tau).any(), name
        torch.testing.assert_close(after.view(nkv, -1).amax(1), torch.where(group > tau, tau, group)
                                   .view(nkv, -1).amax(1), rtol=1e-12, atol=0)
        assert torch.equal(after[group <= tau], before[group <= tau]), name
    # MLA: 3 heads of 2 content + 1 rotary query rows; key up-projection 2 key + 3 value rows per head
    h, dc, dr, dv = 3, 2, 1, 3
    wq = 4 * torch.randn(h * (dc + dr), 7, generator=g, dtype=torch.float64)
    wkv = 4 * torch.randn(h * (dc + dv), 7, generator=g, dtype=torch.float64)
    wkr = 4 * torch.randn(dr, 7, generator=g, dtype=torch.float64)  # the shared rotary key
    wkr0 = wkr.clone()

    def mla_logits() -> torch.Tensor:
        q = _qkv_proj(wq, x, h, dc + dr)
        kv = _qkv_proj(wkv, x, h, dc + dv)
        k = torch.cat([kv[..., :dc], (x @ wkr.T).expand(h, -1, -1)], -1)
        return (q @ k.transpose(1, 2)).amax((1, 2))

    before = mla_logits()
    tau = float(before.median())
    qk_clip_(wq, wkv, before, tau, 0.5, QKClipHeads(h, dc, h, dr, dv))
    torch.testing.assert_close(mla_logits(), before.clamp(max=tau), rtol=1e-12, atol=0)
    assert torch.equal(wkr, wkr0)


# -- pieces of rows on simulated layouts ----------------------------------------------


def _layouts(shape: tuple[int, int], seed: int) -> list[RaggedShard | BoxShard]:
    rows, cols = shape
    n = rows * cols
    g = torch.Generator().manual_seed(seed)
    out: list[RaggedShard | BoxShard] = []
    for w in (2, 3, 4):  # flat slices with cuts anywhere (inside rows, inside heads), empty ones too
        cuts = sorted(torch.randint(0, n + 1, (w - 1,), generator=g).tolist())
        out.append(RaggedShard.from_boundaries([0, *cuts, n]))
    out.append(RaggedShard.from_boundaries([0, cols + 1, n - 1, n]))
    out.append(BoxShard.nested_chunks(shape, (3,), ((0,), ())))  # colwise tensor parallel: Shard(0)
    out.append(BoxShard.nested_chunks(shape, (2,), ((), (0,))))  # Shard(1)
    out.append(BoxShard.nested_chunks(shape, (2, 2), ((0,), (1,))))  # 2-D boxes
    # fully_shard over tensor parallel: each Shard(0) box cut into two runs of its row-major order
    boxes = []
    for b in BoxShard.nested_chunks(shape, (2,), ((0,), ())).boxes:
        cut = int(torch.randint(0, b.length + 1, (), generator=g))
        boxes += [Box(b.offsets, b.sizes, 0, cut), Box(b.offsets, b.sizes, cut, b.length - cut)]
    out.append(BoxShard(shape, tuple(boxes)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_equal_the_whole_row(dtype: torch.dtype) -> None:
    cut_inside = 0
    for name in ATTN:
        heads = _heads(name)
        qs, ks = qk_clip_row_scales(qk_clip_gamma(torch.tensor(LOGITS[0][name]), TAU, heads.num_kv_heads), 0.3, heads)
        for pname, shape in _shapes().items():
            if not pname.startswith(name):
                continue
            kind = pname.rsplit("_", 1)[1]
            if kind == "qkv":  # query, key, then value rows (factor 1)
                scale = torch.cat([qs, ks, torch.ones(shape[0] - qs.numel() - ks.numel())])
            else:
                scale = qs if kind == "q" else ks
            full = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])).to(dtype)
            want = full.clone()
            scale_rows_(want.view(-1), scale, 0, shape[1])
            for seed, layout in enumerate(_layouts(shape, seed=len(pname))):
                got = full.clone().view(-1)
                for r in range(layout.world_size):
                    idx = layout.local_index(r)
                    local = got[idx].clone()
                    if isinstance(layout, RaggedShard):
                        cut_inside += layout.local(r)[0] % shape[1] != 0
                    _scale_view_(types.SimpleNamespace(local=local, layout=layout, rank=r, shape=shape), scale)
                    got[idx] = local
                assert torch.equal(got.view(shape), want), (pname, seed, layout)
    assert cut_inside > 10


# -- no host sync ----------------------------------------------------------------------


class _NoSync(TorchDispatchMode):
    SYNC = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
            torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default, torch.ops.aten.nonzero.default,
            torch.ops.aten.masked_select.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in self.SYNC:
            raise AssertionError(f"host sync in the clip: {func}")
        return func(*args, **(kwargs or {}))


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    model = nn.Module()
    for k, v in _init(dtype).items():
        model.register_parameter(k, nn.Parameter(v))
    return model


def _register(opt: vefsdp_optim.Muon, params: dict[str, nn.Parameter]) -> None:
    for name, (layout, _) in ATTN.items():
        opt.register_qk_clip(name, **_weights(name, params), **layout)


def _groups(params: dict[str, nn.Parameter]) -> list[dict]:
    """Muon on GQA and MLA (whole matrices: fully_shard's re-plan puts each on one rank),
    on the fused QKV by split_sizes, and Muon's AdamW on MHA (elementwise: fully_shard
    keeps its cuts inside rows and heads)."""
    return [{"params": [params[k] for k in ("gqa_q", "gqa_k", "mla_q", "mla_k")]},
            {"params": [params["fused_qkv"]], "split_sizes": (9, 3, 3)},
            {"params": [params["mha_q"], params["mha_k"]], "use_muon": False}]


def test_no_host_sync() -> None:
    params = dict(_model().named_parameters())
    opt = vefsdp_optim.Muon(_groups(params), qk_clip_threshold=TAU)
    _register(opt, params)
    logits = {k: torch.tensor(v) for k, v in LOGITS[0].items()}
    with _NoSync():
        opt.qk_clip_(logits)
    if torch.version.cuda is None:
        return  # fake CUDA tensors need a CUDA build of torch (the -lo / -hi venvs)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):  # raises on any data-dependent op
        fake = {k: nn.Parameter(torch.empty(s, device="cuda")) for k, s in _shapes().items()}
        opt = vefsdp_optim.NorMuon(_groups(fake), qk_clip_threshold=TAU)
        _register(opt, fake)
        opt.qk_clip_({k: torch.empty(len(v), device="cuda") for k, v in LOGITS[0].items()})


# -- the optimizers, sharded ------------------------------------------------------------

HP = dict(lr=0.02, weight_decay=0.1)


def _grad(step: int, name: str) -> torch.Tensor:
    return torch.randn(_shapes()[name], generator=torch.Generator().manual_seed(1000 * step + len(name)
                                                                              + sum(map(ord, name))))


def _one_device(kind: str, steps: int) -> dict[str, torch.Tensor]:
    """Steps of the optimizer on plain weights, each followed by the reference clip."""
    params = dict(_model().named_parameters())
    opt = getattr(vefsdp_optim, kind)(_groups(params), **HP)
    for step in range(steps):
        for k, p in params.items():
            p.grad = _grad(step, k)
        opt.step()
        with torch.no_grad():
            for name in ATTN:
                reference_clip_(_weights(name, params), torch.tensor(LOGITS[step][name]), ATTN[name][0], TAU, 0.5)
    return {k: p.detach() for k, p in params.items()}


def _sharded(kind: str, sharding: str, steps: int) -> tuple[dict[str, bool], int]:
    """(each weight equal to one device's bits, how many of this rank's slices start inside a row)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    world = dist.get_world_size()
    model = _model()
    if sharding == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    elif sharding == "fully_shard":
        vefsdp_optim.fully_shard(model)
    elif sharding == "tp":  # colwise query / fused weights (heads across ranks), rowwise-split keys (boxes)
        mesh = init_device_mesh("cpu", (world,))
        for k, p in list(model.named_parameters()):
            placement = Shard(1) if k.endswith("_k") else Shard(0)
            setattr(model, k, nn.Parameter(distribute_tensor(p.detach(), mesh, [placement])))
    params = dict(model.named_parameters())
    opt = getattr(vefsdp_optim, kind)(_groups(params), qk_clip_threshold=TAU, **HP)
    _register(opt, params)
    inside = 0
    for step in range(steps):
        for k, p in params.items():
            g = _grad(step, k)
            if isinstance(p, vefsdp_optim.ShardedParameter):
                p.grad = p.with_local(g.reshape(-1)[p.ragged_layout.local_index(p.shard_rank)].clone())
                start = p.ragged_layout.local(p.shard_rank)[0]
                inside += bool(p.ragged_layout.local_numel(p.shard_rank)) and start % p.shape[1] != 0
            elif isinstance(p, DTensor):
                p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            else:
                p.grad = g
        opt.step()
        opt.qk_clip_({k: torch.tensor(v) for k, v in LOGITS[step].items()})
    want = _one_device(kind, steps)
    full = {k: p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for k, p in params.items()}
    return {k: torch.equal(full[k], want[k]) for k in want}, inside


def _debug_check_refuses_different_logits() -> str:
    """Under the debug switch, logits that differ between the ranks of a shard process group raise."""
    import torch.distributed as dist

    from vefsdp_optim import _debug

    model = _model()
    vefsdp_optim.fully_shard(model)
    params = dict(model.named_parameters())
    opt = vefsdp_optim.Muon(_groups(params), qk_clip_threshold=TAU)
    _register(opt, params)
    logits = {"mha": torch.tensor(LOGITS[0]["mha"]) + dist.get_rank()}
    _debug.DEBUG = True
    try:
        opt.qk_clip_(logits)
    except ValueError as e:
        return str(e)
    finally:
        _debug.DEBUG = False
    return "no error"


def _all_cases(world: int) -> dict:
    out: dict = {}
    for sharding in ("plain", "fsdp2", "fully_shard", "tp"):
        out["Muon", sharding] = _sharded("Muon", sharding, steps=2)
    for sharding in ("fsdp2", "fully_shard"):  # the same clip after NorMuon's step
        out["NorMuon", sharding] = _sharded("NorMuon", sharding, steps=2)
    if world > 1:
        out["debug"] = _debug_check_refuses_different_logits()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sharded_equals_one_device(world_size: int) -> None:
    results = run_distributed(_all_cases, world_size, world_size)
    for rank, res in enumerate(results):
        for case, value in res.items():
            if case == "debug":
                assert "given different max logits" in value, (rank, value)
                continue
            equal, _ = value
            assert all(equal.values()), (rank, case, equal)
    if world_size > 1:  # fully_shard cut some weight inside a row on some rank
        assert sum(res["Muon", "fully_shard"][1] + res["NorMuon", "fully_shard"][1] for res in results) > 0


# -- errors ----------------------------------------------------------------------------


def test_errors() -> None:
    params = dict(_model().named_parameters())
    q, k = params["mha_q"], params["mha_k"]
    for bad in (-1.0, 0.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="qk_clip_threshold must be None .* or a finite number > 0"):
            vefsdp_optim.Muon([q], qk_clip_threshold=bad)
    with pytest.raises(ValueError, match="qk_clip_alpha must be a number in \\[0, 1\\]"):
        vefsdp_optim.NorMuon([q], qk_clip_threshold=1.0, qk_clip_alpha=1.5)
    with pytest.raises(ValueError, match="qk_clip_threshold must be"):
        vefsdp_optim.Muon([{"params": [q], "qk_clip_threshold": -3.0}])
    off = vefsdp_optim.Muon([q, k])
    with pytest.raises(ValueError, match="qk_clip_threshold=None"):
        off.register_qk_clip("a", q=q, k=k, num_heads=5, head_dim=3)
    opt = vefsdp_optim.Muon([q, k, params["gqa_q"]], qk_clip_threshold=TAU)
    with pytest.raises(ValueError, match="the q weight has 15 rows .* num_heads=4 x \\(head_dim=3"):
        opt.register_qk_clip("a", q=q, k=k, num_heads=4, head_dim=3)
    with pytest.raises(ValueError, match="the k weight has 15 rows .* num_kv_heads=5 x \\(head_dim=3 \\+ v_head_dim=1"):
        opt.register_qk_clip("a", q=params["mha_q"], k=k, num_heads=5, head_dim=3, v_head_dim=1)
    with pytest.raises(ValueError, match="num_kv_heads=2 does not divide num_heads=5"):
        opt.register_qk_clip("a", q=q, k=k, num_heads=5, head_dim=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="head_dim must be an int >= 1, got 0"):
        opt.register_qk_clip("a", q=q, k=k, num_heads=5, head_dim=0)
    with pytest.raises(ValueError, match="is not a parameter of this Muon"):
        opt.register_qk_clip("a", q=q, k=params["gqa_k"], num_heads=5, head_dim=3)
    with pytest.raises(ValueError, match="pass both the query weight q and the key weight k"):
        opt.register_qk_clip("a", q=q, num_heads=5, head_dim=3)
    with pytest.raises(ValueError, match="q and k are the same tensor"):
        opt.register_qk_clip("a", q=q, k=q, num_heads=5, head_dim=3)
    with pytest.raises(NotImplementedError, match="2-D .* shape \\(15, 7, 1\\)"):
        three = nn.Parameter(torch.zeros(15, 7, 1))
        vefsdp_optim.Muon([{"params": [three, k], "flatten": True}], qk_clip_threshold=TAU).register_qk_clip(
            "a", q=three, k=k, num_heads=5, head_dim=3)
    opt.register_qk_clip("a", q=q, k=k, num_heads=5, head_dim=3)
    with pytest.raises(ValueError, match="'a' is already registered"):
        opt.register_qk_clip("a", q=q, k=k, num_heads=5, head_dim=3)
    with pytest.raises(ValueError, match="the q weight is already registered for attention 'a'"):
        opt.register_qk_clip("b", q=q, k=params["gqa_q"], num_heads=5, head_dim=3)
    ok = torch.tensor(LOGITS[0]["mha"])
    with pytest.raises(ValueError, match="\\['b'\\] is not registered .* registered: \\['a'\\]"):
        opt.qk_clip_({"b": ok})
    with pytest.raises(ValueError, match="max logits of shape \\(4,\\); .* num_heads=5 .* shape \\(5,\\)"):
        opt.qk_clip_({"a": ok[:4]})
    with pytest.raises(ValueError, match="max logits of shape \\(1, 5\\)"):
        opt.qk_clip_({"a": ok[None]})
    with pytest.raises(ValueError, match="floating point, got torch.int64"):
        opt.qk_clip_({"a": ok.long()})
    with pytest.raises(ValueError, match="max logits on meta, the q weight's local data on cpu"):
        opt.qk_clip_({"a": ok.to("meta")})
    with pytest.raises(TypeError, match="plain torch.Tensor of shape \\(5,\\), got list"):
        opt.qk_clip_({"a": [1.0] * 5})
    with pytest.raises(TypeError, match="takes a mapping"):
        opt.qk_clip_(ok)
    opt.param_groups[0]["qk_clip_threshold"] = None
    with pytest.raises(ValueError, match="qk_clip_threshold=None \\(QK-clip off\\)"):
        opt.qk_clip_({"a": ok})
    two = vefsdp_optim.Muon([{"params": [q]}, {"params": [k], "qk_clip_alpha": 0.3}], qk_clip_threshold=TAU)
    two.register_qk_clip("a", q=q, k=k, num_heads=5, head_dim=3)
    with pytest.raises(ValueError, match="disagree on \\(qk_clip_threshold, qk_clip_alpha\\)"):
        two.qk_clip_({"a": ok})
    fused = vefsdp_optim.Muon([params["fused_qkv"]], qk_clip_threshold=TAU)
    with pytest.raises(ValueError, match="rope_head_dim and v_head_dim describe MLA"):
        fused.register_qk_clip("f", qkv=params["fused_qkv"], num_heads=3, head_dim=3, num_kv_heads=1, rope_head_dim=1)
    with pytest.raises(ValueError, match="the qkv weight has 15 rows .* \\(num_heads=3 \\+ 2 x num_kv_heads=3\\)"):
        fused.register_qk_clip("f", qkv=params["fused_qkv"], num_heads=3, head_dim=3)
