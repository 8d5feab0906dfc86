"""Checkpoints lose nothing: save never touches files it did not write, load takes the
newest complete copy (and says when it recovered one), corruption is detected.

Faults are injected at each phase of save() through ``_save_load._fault_hook`` (the
job stops there on every rank: what a killed job leaves on disk), and during the DCP
write by one rank failing to serialize its entry (DCP makes every rank raise).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

import vefsdp_optim
from vefsdp_optim._checkpoint import _commit, _save_load

MARKER = ".vefsdp-checkpoint.json"


class _Unpicklable:
    def __reduce__(self):  # noqa: ANN204
        raise RuntimeError("rank died while writing (simulated)")


class _Stop(Exception):
    pass


def _sd(v: float) -> dict[str, object]:
    return {f"t{i}": torch.full((16 + i,), v) for i in range(6)} | {"step": v}


def _value(path: str, **kw) -> tuple[float, list[str]]:  # noqa: ANN003
    sd = _sd(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vefsdp_optim.load(sd, path, **kw)
    vals = {float(t[0]) for k, t in sd.items() if k != "step"}
    if len(vals) != 1 or sd["step"] not in vals:
        raise AssertionError(f"mixed checkpoint: {vals}, step {sd['step']}")
    return vals.pop(), [str(w.message) for w in caught if "interrupted save" in str(w.message)]


def _interrupted(path: str, v: float, phase: str) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    sd = _sd(v)
    if phase == "write":  # the last rank dies inside the DCP write
        if rank == (dist.get_world_size() if dist.is_initialized() else 1) - 1:
            sd["bad"] = _Unpicklable()

    def hook(p: str) -> None:
        if p == phase:
            raise _Stop(p)

    _save_load._fault_hook = hook
    try:
        vefsdp_optim.save(sd, path)
    except _Stop:
        return "stopped"
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return "raised: " + ("simulated" if "simulated" in str(e) else repr(e)[:200])
    finally:
        _save_load._fault_hook = None
    return "no error"


# what load must return after saves of 1, 2, then one of 3 stopped at each phase
EXPECT = {"write": (2.0, False), "complete": (2.0, False), "move_old": (3.0, True),
          "move_new": (3.0, True), "clean": (3.0, False)}


def _faults(root: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for phase in EXPECT:
        path = os.path.join(root, phase, "ckpt")
        if dist.get_rank() == 0:
            os.makedirs(os.path.dirname(path))
            with open(os.path.join(os.path.dirname(path), "train.log"), "w") as f:
                f.write("user file")
        dist.barrier()
        vefsdp_optim.save(_sd(1.0), path)
        vefsdp_optim.save(_sd(2.0), path)
        out[phase, "save"] = _interrupted(path, 3.0, phase)
        dist.barrier()
        out[phase, "load"] = _value(path)
        dist.barrier()
        # a second interrupted save in a row, stopped between the renames
        out[phase, "save2"] = _interrupted(path, 4.0, "move_new")
        dist.barrier()
        out[phase, "load2"] = _value(path)
        dist.barrier()
        vefsdp_optim.save(_sd(5.0), path)  # a good save removes every leftover
        out[phase, "after"] = _value(path)
        out[phase, "ls"] = sorted(os.listdir(os.path.dirname(path)))
        dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_interrupted_saves_recover_the_newest(tmp_path, world):
    for r in run_distributed(_faults, world, str(tmp_path)):
        for phase, (want, warned) in EXPECT.items():
            saved = r[phase, "save"]
            assert saved in ("stopped", "raised: simulated"), (phase, saved)
            got, warns = r[phase, "load"]
            assert got == want, (phase, got, want)
            assert bool(warns) == warned, (phase, warns)
            assert r[phase, "save2"] == "stopped"
            got, warns = r[phase, "load2"]
            assert got == 4.0 and warns and "generation" in warns[0], (phase, got, warns)
            assert r[phase, "after"] == (5.0, [])
            assert r[phase, "ls"] == ["ckpt", "train.log"], (phase, r[phase, "ls"])


def test_save_writes_only_its_own_files(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("mine")
    with pytest.raises(ValueError, match=f"{f}.*existing file"):
        vefsdp_optim.save(_sd(1.0), f)
    assert f.read_text() == "mine"
    d = tmp_path / "out"
    (d / "sub").mkdir(parents=True)
    (d / "train.log").write_text("log")
    with pytest.raises(ValueError, match=f"{d}.*non-empty directory.*overwrite=True"):
        vefsdp_optim.save(_sd(1.0), d)
    assert (d / "train.log").read_text() == "log" and (d / "sub").is_dir()
    ours = tmp_path / "ckpt"
    vefsdp_optim.save(_sd(1.0), ours)
    with pytest.raises(ValueError, match="overwrite=True"):
        vefsdp_optim.save(_sd(2.0), ours, overwrite=False)
    (ours / "notes.txt").write_text("kept")  # a user file inside our checkpoint
    vefsdp_optim.save(_sd(2.0), ours)
    assert _value(str(ours)) == (2.0, [])
    left = [n for n in os.listdir(tmp_path) if n.startswith("ckpt.old-")]
    assert len(left) == 1 and os.listdir(tmp_path / left[0]) == ["notes.txt"]  # moved aside, never deleted
    empty = tmp_path / "empty"
    empty.mkdir()
    vefsdp_optim.save(_sd(3.0), empty)
    assert _value(str(empty)) == (3.0, [])
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match="path is empty"):
        vefsdp_optim.save(_sd(1.0), "")
    assert sorted(os.listdir(tmp_path)) == before


def test_corruption_is_detected(tmp_path):
    path = tmp_path / "ckpt"
    vefsdp_optim.save(_sd(1.0), path)
    data = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
    p = path / data
    raw = bytearray(p.read_bytes())
    mid = len(raw) // 2
    raw[mid: mid + 64] = bytes(b ^ 0xFF for b in raw[mid: mid + 64])
    p.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"{data}.*checksum.*verify=False"):
        _value(str(path))
    p.write_bytes(bytes(raw[:-10]))
    with pytest.raises(ValueError, match=f"{data}.*truncated"):
        _value(str(path), verify=False)
    vefsdp_optim.save(_sd(2.0), path)
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-7])
    with pytest.raises(ValueError, match=r"\.metadata.*truncated"):
        _value(str(path))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _value(str(tmp_path / "nothing"))


_FULL_DISK = """
import os, resource, signal, sys, torch, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {tests!r})
import vefsdp_optim
from test_checkpoint_commit import _sd, _value
path = {path!r}
vefsdp_optim.save(_sd(1.0), path)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # the disk fills at 4 KiB a file
big = {{f"t{{i}}": torch.full((16 + i,), 2.0) for i in range(6)}} | {{"step": 2.0, "pad": torch.zeros(4096)}}
try:
    vefsdp_optim.save(big, path)
    print("no error")
except BaseException as e:
    print("raised", type(e).__name__)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
print(_value(path)[0], sorted(os.listdir(os.path.dirname(path))))
"""


def test_full_disk_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    code = _FULL_DISK.format(tests=os.path.dirname(__file__), path=path)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("raised"), res.stdout
    assert lines[1] == "1.0 ['ckpt']", res.stdout


_KILLED = """
import os, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {tests!r})
import vefsdp_optim
from vefsdp_optim._checkpoint import _save_load
from test_checkpoint_commit import EXPECT, _sd, _value

class _Die:
    def __reduce__(self):
        os._exit(17)  # the process dies inside the DCP write, nothing cleans up

for phase in ["before_write", *EXPECT]:
    path = os.path.join({root!r}, phase, "ckpt")
    vefsdp_optim.save(_sd(1.0), path)
    vefsdp_optim.save(_sd(2.0), path)
    pid = os.fork()
    if pid == 0:
        sd = _sd(3.0)
        if phase == "write":
            sd["die"] = _Die()  # killed during the DCP write
        stop = "write" if phase == "before_write" else phase
        _save_load._fault_hook = lambda p: os._exit(17) if p == stop and phase != "write" else None
        vefsdp_optim.save(sd, path)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    got, warns = _value(path)
    vefsdp_optim.save(_sd(5.0), path)
    print(phase, os.waitstatus_to_exitcode(status), got, bool(warns), _value(path)[0],
          sorted(os.listdir(os.path.dirname(path))))
"""


# ~6 s of subprocess on 2 cores: the slow tier; the quick tier recovers from interrupted
# saves in-process (test_interrupted_saves_recover_the_newest)
@pytest.mark.slow
def test_killed_saves_recover_the_newest(tmp_path):
    """The process really dies (os._exit) at each phase: no cleanup code runs."""
    code = _KILLED.format(tests=os.path.dirname(__file__), root=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    expect = {"before_write": (2.0, False), **EXPECT}
    assert len(lines) == len(expect), res.stdout
    for line, (phase, (want, warned)) in zip(lines, expect.items(), strict=True):
        assert line == f"{phase} 17 {want} {warned} 5.0 ['ckpt']", line


def _commit_fails(root: str) -> tuple[str, tuple[float, list[str]], list[str]]:
    path = os.path.join(root, "ckpt")
    vefsdp_optim.save(_sd(1.0), path)
    real = _commit.describe_files

    def full(d: str, known: object = None) -> dict:
        raise OSError(28, "No space left on device")

    if dist.get_rank() == 0:  # only rank 0 commits: the others must hear of its failure
        _commit.describe_files = full
    try:
        vefsdp_optim.save(_sd(2.0), path)
        err = "no error"
    except OSError as e:
        err = str(e)
    finally:
        _commit.describe_files = real
    dist.barrier()
    got = _value(path)
    vefsdp_optim.save(_sd(3.0), path)
    return err, got, sorted(os.listdir(root))


def test_commit_failure_on_rank0_reaches_every_rank(tmp_path):
    for err, got, ls in run_distributed(_commit_fails, 2, str(tmp_path)):
        assert "No space left" in err and "newest complete copy" in err, err
        assert got == (1.0, [])
        assert ls == ["ckpt"], ls


# -- who hashes what (see ``_writer`` in vefsdp_optim/_checkpoint/_save_load.py) -----------------------------------


def _hashed_by_whom(root: str, corrupt: bool) -> dict[str, object]:
    from vefsdp_optim._checkpoint import _safe_load

    rank = dist.get_rank()
    path = os.path.join(root, "ckpt")
    seen: list[str] = []
    real_commit, real_load = _commit.sha256, _safe_load.sha256

    def counting(real):  # noqa: ANN001, ANN202
        def sha(p: str) -> str:
            seen.append(os.path.basename(p))
            return real(p)
        return sha

    sd = {f"t{i}": torch.full((64 + 16 * i,), float(rank)) for i in range(6)}  # each rank's own
    out: dict[str, object] = {}
    _commit.sha256 = counting(real_commit)
    try:
        vefsdp_optim.save({"step": 3, **{f"{k}.{r}": v for r in range(dist.get_world_size())
                                         for k, v in sd.items()}}, path)
        out["save"] = sorted(seen)
    finally:
        _commit.sha256 = real_commit
    seen.clear()
    if corrupt:
        dist.barrier()
        if rank == 0:
            victim = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[-1]
            with open(os.path.join(path, victim), "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
    target = {"step": 0, **{f"{k}.{r}": torch.zeros_like(v) for r in range(dist.get_world_size())
                            for k, v in sd.items()}}
    _safe_load.sha256 = counting(real_load)
    try:
        vefsdp_optim.load(target, path)
        out["load"] = sorted(seen)
    except ValueError as e:
        out["error"] = str(e)
    finally:
        _safe_load.sha256 = real_load
    with open(os.path.join(path, MARKER)) as f:
        import json

        out["files"] = sorted(json.load(f)["files"])
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_file_is_hashed_by_one_rank(tmp_path, world_size):
    results = run_distributed(_hashed_by_whom, world_size, str(tmp_path), False)
    files = results[0]["files"]
    assert ".metadata" in files and all(r["files"] == files for r in results)
    saved = [n for r in results for n in r["save"]]
    assert sorted(saved) == files, saved  # at save: every file once, by the rank that wrote it
    for rank, r in enumerate(results):
        assert all(n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata") for n in r["save"]), r
    loaded = [n for r in results for n in r["load"]]
    assert len(loaded) == len(set(loaded)), loaded  # at load: no file twice
    assert set(loaded) == set(files), (loaded, files)  # every rank reads every entry here
    assert ".metadata" in results[0]["load"]


def test_corruption_is_detected_on_every_rank(tmp_path):
    results = run_distributed(_hashed_by_whom, 3, str(tmp_path), True)
    for r in results:
        assert "does not match the checksum" in r.get("error", ""), r
    assert len({r["error"] for r in results}) == 1, results
