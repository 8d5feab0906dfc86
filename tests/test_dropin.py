"""Drop-in behaviour: torch's signatures and flags, safe failures with clear errors.

References are torch.optim on the same tensors, or the same optimizer on one process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim

SHAPES = [(7, 5), (7,), (3, 6), (4, 1)]


def _init(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _run(make, steps: int = 3) -> list[torch.Tensor]:
    ps = [nn.Parameter(t.clone()) for t in _init()]
    opt = make(ps)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in ps]


@pytest.mark.parametrize("flags", [dict(), dict(foreach=False), dict(foreach=True), dict(fused=True),
                                   dict(amsgrad=True, foreach=True), dict(maximize=True, fused=True)])
def test_adamw_flags_give_torchs_implementation(flags):
    ours = _run(lambda ps: vefsdp_optim.AdamW(ps, lr=1e-2, **flags))
    ref = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, **flags))
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))


def test_adamw_signature_is_torchs():
    import inspect

    ours = inspect.signature(vefsdp_optim.AdamW.__init__).parameters
    torchs = inspect.signature(torch.optim.AdamW.__init__).parameters
    assert list(ours) == list(torchs)
    assert all(ours[k].default == torchs[k].default and ours[k].kind == torchs[k].kind for k in torchs)
    muon = inspect.signature(vefsdp_optim.Muon.__init__).parameters
    tmuon = inspect.signature(torch.optim.Muon.__init__).parameters
    assert list(muon)[:len(tmuon)] == list(tmuon)
    assert all(muon[k].default == tmuon[k].default for k in tmuon)


def test_adamw_flag_errors_are_torchs():
    p = [nn.Parameter(torch.zeros(3))]
    for kw, err, match in [
            (dict(fused=True, foreach=True), RuntimeError, "cannot be `True` together"),
            (dict(lr=torch.tensor(0.1), foreach=True), ValueError, "lr as a Tensor"),
            (dict(betas=(0.9, torch.tensor(0.99))), ValueError, "both floats or both Tensors")]:
        with pytest.raises(err, match=match):
            torch.optim.AdamW(p, **kw)
        with pytest.raises(err, match=match):
            vefsdp_optim.AdamW(p, **kw)
    with pytest.raises(NotImplementedError, match="differentiable=True"):
        vefsdp_optim.AdamW(p, differentiable=True)
    # capturable needs a device torch supports for it: torch's own error at the first step
    for cls in (torch.optim.AdamW, vefsdp_optim.AdamW):
        q = nn.Parameter(torch.zeros(3))
        q.grad = torch.ones(3)
        with pytest.raises(AssertionError, match="capturable=True"):
            cls([q], capturable=True).step()


@pytest.mark.parametrize("name", ["adamw", "muon", "adamw8bit", "adam8bit", "shampoo"])
def test_tensor_lr_equals_float_lr(name):
    cls = vefsdp_optim.get_optimizer(name)
    kw = dict(min_8bit_size=8, block_size=8) if "8bit" in name else {}
    lr = 1e-2
    t_lr = torch.tensor(lr, dtype=torch.float64)  # float64: the same value as the float
    ours = _run(lambda ps: cls(ps, lr=t_lr, **kw))
    ref = _run(lambda ps: cls(ps, lr=lr, **kw))
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))


def test_muon_tensor_lr_equals_torch():
    mats = lambda ps: [p for p in ps if p.ndim == 2]  # noqa: E731
    ours = _run(lambda ps: vefsdp_optim.Muon([{"params": mats(ps)},
                                              {"params": [p for p in ps if p.ndim != 2], "lr": 0.0}],
                                             lr=torch.tensor(0.02)))
    ref = _run(lambda ps: _Both(torch.optim.Muon(mats(ps), lr=torch.tensor(0.02))))
    for a, b, s in zip(ours, ref, SHAPES, strict=True):
        if len(s) == 2:
            assert torch.equal(a, b)


class _Both:
    def __init__(self, *opts: torch.optim.Optimizer) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()


def test_extra_param_group_keys_are_kept():
    ps = [nn.Parameter(t.clone()) for t in _init()]
    for cls in (vefsdp_optim.AdamW, vefsdp_optim.Muon, vefsdp_optim.AdamW8bit):
        opt = cls([{"params": ps[:2], "param_names": ["a", "b"], "my_tag": 3},
                   {"params": ps[2:], "param_names": ["c", "d"]}])
        assert opt.param_groups[0]["param_names"] == ["a", "b"] and opt.param_groups[0]["my_tag"] == 3
        sd = opt.state_dict()
        assert sd["param_groups"][1]["param_names"] == ["c", "d"]
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["my_tag"] == 3
    named = vefsdp_optim.AdamW([("w", ps[0]), ("b", ps[1])])  # torch's named parameters
    assert named.param_groups[0]["param_names"] == ["w", "b"]


def test_meta_parameters_are_refused_clearly():
    p = nn.Parameter(torch.empty(4, 3, device="meta"))
    p.grad = torch.empty(4, 3, device="meta")
    for cls in (vefsdp_optim.AdamW, vefsdp_optim.Muon, vefsdp_optim.AdamW8bit, vefsdp_optim.Shampoo):
        opt = cls([p])  # building on meta is fine, as torch's
        with pytest.raises(NotImplementedError, match="meta device"):
            opt.step()


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0)])
def test_parameters_without_elements_step_as_torchs(shape):
    """A parameter with no elements (an FSDP1 view on a rank that holds none of it, a
    zero-width layer) steps beside the others, as torch.optim.AdamW steps it: the same
    parameters and the same state. Muon's matrices must have elements (a clear error)."""
    def run(make):
        ps = [nn.Parameter(torch.zeros(shape)), nn.Parameter(torch.ones(2, 3))]
        opt = make(ps)
        for i in range(2):
            ps[0].grad, ps[1].grad = torch.zeros(shape), torch.full((2, 3), 0.5 + i)
            opt.step()
        return ps, opt.state_dict()["state"]

    (got, got_state), (want, want_state) = run(vefsdp_optim.AdamW), run(torch.optim.AdamW)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert got_state.keys() == want_state.keys() and all(
        torch.equal(got_state[i][k], want_state[i][k]) for i in want_state for k in want_state[i])
    for cls in (vefsdp_optim.AdamW8bit, vefsdp_optim.Shampoo, vefsdp_optim.SOAP):
        ps, _ = run(cls)
        assert ps[0].shape == shape and not torch.equal(ps[1], torch.ones(2, 3))
    if len(shape) == 2:
        with pytest.raises(ValueError, match=r"Muon needs a non-empty matrix, got shape"):
            run(vefsdp_optim.Muon)
    else:  # a vector takes Muon's AdamW path
        run(vefsdp_optim.Muon)


def test_toy_cli_bad_input_is_a_clear_error(tmp_path, capsys):
    """Each bad input exits with argparse's code 2 and a message, no traceback: through the
    CLI's main() in this process, and once as a user runs it (``python -m``), which is the
    same main() behind the interpreter's exit."""
    from vefsdp_optim.toy.__main__ import main

    afile = tmp_path / "f.txt"
    afile.write_text("x")
    cases = [(["--optimizer", "collections:OrderedDict"], "not a torch.optim.Optimizer"),
             (["--out", str(afile)], "existing file"),
             (["--optimizer", "no_such"], "unknown optimizer")]
    for args, match in cases:
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and match in err and "Traceback" not in err, err
    args, match = cases[0]
    r = subprocess.run([sys.executable, "-m", "vefsdp_optim.toy", *args], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- distributed: stale optimizers, ranks that disagree ------------------------------------


def _failures() -> dict[str, object]:
    out: dict[str, object] = {}
    rank = dist.get_rank()
    torch.manual_seed(0)
    # an optimizer built before fully_shard holds replaced parameters: it would train nothing
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    stale = vefsdp_optim.AdamW(model.parameters())
    vefsdp_optim.fully_shard(model)
    model(torch.randn(2, 5)).sum().backward()
    try:
        stale.step()
        out["stale"] = False
    except ValueError as e:
        out["stale"] = "replaced" in str(e) and "after fully_shard" in str(e)
    try:
        vefsdp_optim.Muon(list(stale.param_groups[0]["params"]))
        out["stale_at_build"] = False
    except ValueError as e:
        out["stale_at_build"] = "replaced" in str(e)
    # one rank drops a gradient: under the debug switch, a clear error naming the parameter
    # and the ranks, no hang (without it, a user error that may hang: [Note: consistent steps])
    from vefsdp_optim import _debug

    debug, _debug.DEBUG = _debug.DEBUG, True
    try:
        _disagree(out, rank)
    finally:
        _debug.DEBUG = debug
    return out


def _disagree(out: dict[str, object], rank: int) -> None:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    for kind in ("fully_shard", "fsdp2"):
        # 64 x 64 stays split under fully_shard too (a whole one would pad beyond 1%), so
        # Muon exchanges it every step
        model = nn.Sequential(nn.Linear(5, 64), nn.Linear(64, 64))
        (vefsdp_optim.fully_shard if kind == "fully_shard" else fsdp2_shard)(model)
        opt = vefsdp_optim.Muon(model.parameters())
        x = torch.randn(4, 5)
        msg = ""
        for step in range(3):
            model(x).square().sum().backward()
            if step == 2 and rank == 0:
                model[1].weight.grad = None
            try:
                opt.step()
            except ValueError as e:
                msg = str(e)
                break
            opt.zero_grad()
        out[kind] = ("param group 0 parameter 2" in msg and "none on ranks [0]" in msg, msg[:200])


@pytest.mark.parametrize("world_size", [2, 3])
def test_stale_optimizer_and_rank_disagreement_raise(world_size: int) -> None:
    for res in run_distributed(_failures, world_size, timeout=120):
        assert res["stale"] and res["stale_at_build"], res
        assert res["fully_shard"][0] and res["fsdp2"][0], res


# -- one non-finite gradient element: the blast radius of torch's AdamW --------------------


def _nan_run(make, bad: float, shape=(1024,), where=(5,), steps: int = 3):
    p = nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(3)))
    opt = make([p])
    g = torch.Generator().manual_seed(4)
    for step in range(steps):
        p.grad = torch.randn(shape, generator=g) * 1e-2
        if step == 1:
            p.grad[where] = bad
        opt.step()
    return p.detach(), opt


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_adamw8bit_non_finite_gradient_element_stays_one_element(bad):
    make = lambda ps: vefsdp_optim.AdamW8bit(ps, min_8bit_size=0, block_size=256)  # noqa: E731
    got, opt = _nan_run(make, bad)
    zero, _ = _nan_run(make, 0.0)
    ref, _ = _nan_run(lambda ps: torch.optim.AdamW(ps), bad)
    assert not torch.isfinite(got[5]) and not torch.isfinite(ref[5])
    keep = torch.ones(got.numel(), dtype=torch.bool)
    keep[5] = False
    assert torch.equal(got[keep], zero[keep])  # the rest of its block as if the element's grad were 0
    st = opt.state[opt.param_groups[0]["params"][0]]
    assert all(bool(torch.isfinite(st[k].float()).all())
               for k in ("exp_avg_absmax", "exp_avg_sq_absmax"))


def test_shampoo_non_finite_gradient_element_stays_one_element():
    make = lambda ps: vefsdp_optim.Shampoo(ps, lr=1e-2, precondition_frequency=1,  # noqa: E731
                                           start_preconditioning_step=1, max_preconditioner_dim=4)
    got, opt = _nan_run(make, float("nan"), shape=(8, 6), where=(2, 3), steps=4)
    assert int((~torch.isfinite(got)).sum()) == 1 and not torch.isfinite(got[2, 3])
    st = opt.state[opt.param_groups[0]["params"][0]]
    assert int(st["skipped_tiles"]) == 1  # counted on the device (no warning: it would need a host read)
    tiles = [k for k in st if k.startswith(vefsdp_optim.Shampoo.extra_state_prefixes)]
    assert len(tiles) == 4 * 4  # 2 x 2 tiles of 4 x 4 (flat keys "{stat}.{band}.{col}")
    for k in tiles:
        assert bool(torch.isfinite(st[k]).all()), k


@pytest.mark.parametrize("name", ["adamw8bit", "adam8bit"])
def test_8bit_maximize_equals_negated_gradients(name):
    cls = vefsdp_optim.get_optimizer(name)
    kw = dict(min_8bit_size=8, block_size=8)
    ps = [nn.Parameter(t.clone()) for t in _init()]
    qs = [nn.Parameter(t.clone()) for t in _init()]
    a, b = cls(ps, maximize=True, **kw), cls(qs, **kw)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        for p, q in zip(ps, qs, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = -p.grad
        a.step()
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs, strict=True))
    with pytest.raises(NotImplementedError, match="amsgrad"):
        cls(ps, amsgrad=True)
