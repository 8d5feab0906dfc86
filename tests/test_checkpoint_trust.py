"""Loading a checkpoint runs no code from it and reads nothing outside it.

Each case crafts a checkpoint as an attacker (or a broken disk) would, and checks that
``vefsdp_optim.load`` / ``import_full`` raise a ValueError naming the checkpoint, and
that the payload never ran (its marker file does not exist). Single process: the
checks run on every rank alike, before any collective reads data.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import vefsdp_optim


class _Evil:
    """Unpickling this creates the marker file: code from the checkpoint ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    return {"w": torch.randn(5, 3), "b": torch.randn(7), "step": 3, "cfg": {"lr": 0.1}}


def _target() -> dict[str, object]:
    return {"w": torch.zeros(5, 3), "b": torch.zeros(7), "step": 0, "cfg": {"lr": 0.0}}


def _saved(tmp_path) -> str:  # noqa: ANN001
    """Our checkpoint without our marker (an attacker rewrites or drops it), so that the
    restricted read and the confinement, not the checksums, must refuse it."""
    path = str(tmp_path / "ckpt")
    vefsdp_optim.save(_state(), path)
    os.unlink(os.path.join(path, ".vefsdp-checkpoint.json"))
    return path


def _rewrite_metadata(path: str, edit) -> None:  # noqa: ANN001
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # the test's own, trusted file
    edit(md)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _set_paths(md, rel: str) -> None:  # noqa: ANN001
    for info in md.storage_data.values():
        info.relative_path = rel


def test_metadata_pickle_runs_no_code(tmp_path):
    path = _saved(tmp_path)
    marker = tmp_path / "pwned"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Evil(str(marker)), f)
    with pytest.raises(ValueError, match=r"metadata references posix\.system, which is not allowed") as e:
        vefsdp_optim.load(_target(), path)
    assert path in str(e.value)
    assert not marker.exists()


def test_well_formed_pickle_of_the_wrong_shape_is_refused(tmp_path):
    path = _saved(tmp_path)
    _rewrite_metadata(path, lambda md: setattr(md, "storage_meta", 3))
    with pytest.raises(ValueError, match="storage_meta is a int"):
        vefsdp_optim.load(_target(), path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump({"not": "metadata"}, f)
    with pytest.raises(ValueError, match="holds a dict, not DCP Metadata"):
        vefsdp_optim.load(_target(), path)


def test_metadata_with_foreign_class_inside_is_refused(tmp_path):
    path = _saved(tmp_path)
    marker = tmp_path / "pwned"
    _rewrite_metadata(path, lambda md: setattr(md, "planner_data", _Evil(str(marker))))
    with pytest.raises(ValueError, match="posix.system"):
        vefsdp_optim.load(_target(), path)
    assert not marker.exists()


@pytest.mark.parametrize("rel, why", [
    ("../outside/__0_0.distcp", "not a plain relative path"),
    ("sub/../../outside/__0_0.distcp", "not a plain relative path"),
    ("ABS", "not a plain relative path"),
])
def test_storage_paths_are_confined(tmp_path, rel, why):
    outside = tmp_path / "outside"
    outside.mkdir()
    path = _saved(tmp_path)
    os.replace(os.path.join(path, "__0_0.distcp"), outside / "__0_0.distcp")
    rel = str(outside / "__0_0.distcp") if rel == "ABS" else rel
    _rewrite_metadata(path, lambda md: _set_paths(md, rel))
    with pytest.raises(ValueError, match=why):
        vefsdp_optim.load(_target(), path)


def test_symlink_leading_out_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    path = _saved(tmp_path)
    os.replace(os.path.join(path, "__0_0.distcp"), outside / "data")
    os.symlink(outside / "data", os.path.join(path, "__0_0.distcp"))
    with pytest.raises(ValueError, match="resolves outside the checkpoint"):
        vefsdp_optim.load(_target(), path)


def test_truncated_files_and_lying_sizes(tmp_path):
    path = _saved(tmp_path)
    data = os.path.join(path, "__0_0.distcp")
    size = os.path.getsize(data)
    os.truncate(data, size - 100)
    with pytest.raises(ValueError, match=r"has \d+ bytes \(truncated or lying metadata\)"):
        vefsdp_optim.load(_target(), path)

    path = str(tmp_path / "big")
    vefsdp_optim.save({"big": torch.zeros(40000), "small": torch.zeros(3)}, path)
    os.unlink(os.path.join(path, ".vefsdp-checkpoint.json"))

    def lie(md):  # noqa: ANN001, ANN202
        for idx, info in md.storage_data.items():
            if idx.fqn == "small":
                info.offset, info.length = 0, os.path.getsize(os.path.join(path, info.relative_path))

    _rewrite_metadata(path, lie)
    with pytest.raises(ValueError, match="more than its chunk needs"):
        vefsdp_optim.load({"small": torch.zeros(3)}, path)

    def huge_chunk(md):  # noqa: ANN001, ANN202
        md.state_dict_metadata["small"].chunks[0].sizes = torch.Size([10**12])

    _rewrite_metadata(path, huge_chunk)
    with pytest.raises(ValueError, match="lies outside the tensor"):
        vefsdp_optim.load({"small": torch.zeros(3)}, path)

    meta = os.path.join(path, ".metadata")
    os.truncate(meta, os.path.getsize(meta) // 2)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        vefsdp_optim.load({"small": torch.zeros(3)}, path)


def test_bytes_entry_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(2), "x": _Evil(str(marker))}, checkpoint_id=path, no_dist=True)
    with pytest.raises(ValueError, match=r"entry 'x' is not plain data") as e:
        vefsdp_optim.load({"w": torch.zeros(2), "x": None}, path)
    assert path in str(e.value)
    assert not marker.exists()


def test_import_full_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"model": _Evil(str(marker))}, tmp_path / "m.pt")
    with pytest.raises(ValueError, match="refused it"):
        vefsdp_optim.import_full(torch.nn.Linear(2, 2), path=tmp_path / "m.pt")
    assert not marker.exists()
    with open(tmp_path / "t.pt", "wb") as f:
        f.write(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match="cannot be imported"):
        vefsdp_optim.import_full(torch.nn.Linear(2, 2), path=tmp_path / "t.pt")


def test_import_full_validates_before_writing(tmp_path):
    torch.manual_seed(0)
    src = torch.nn.Linear(3, 2)
    opt = vefsdp_optim.AdamW(src.parameters())
    src(torch.randn(4, 3)).sum().backward()
    opt.step()
    vefsdp_optim.export_full(src, opt, path=tmp_path / "m.pt")
    dst = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ValueError):
        vefsdp_optim.import_full(dst, vefsdp_optim.Muon(dst.parameters()), path=tmp_path / "m.pt")
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in before.items()), "weights written before refusal"


def test_interop_and_no_writer_path(tmp_path):
    ours = str(tmp_path / "ours")
    vefsdp_optim.save(_state(), ours)
    with open(os.path.join(ours, ".metadata"), "rb") as f:
        raw = f.read()
    assert str(tmp_path).encode() not in raw, "the writer's path is recorded in the metadata"
    got = _target()
    dcp.load(got, checkpoint_id=ours, no_dist=True)  # torch's own reader
    want = _state()
    assert torch.equal(got["w"], want["w"]) and got["step"] == 3 and got["cfg"] == {"lr": 0.1}

    theirs = str(tmp_path / "theirs")
    dcp.save(_state(), checkpoint_id=theirs, no_dist=True)  # records a PosixPath
    got = _target()
    vefsdp_optim.load(got, theirs)
    assert torch.equal(got["b"], want["b"]) and got["step"] == 3 and got["cfg"] == {"lr": 0.1}


def _interop_save(root: str, who: str) -> dict[str, torch.Tensor]:
    from ckpt_harness import SPLIT, _build, _full_params, _optimizer, _shard, _train
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = _shard(_build(1), "fully_shard")
    opt = _optimizer("adamw8bit", model)
    _train(model, opt, range(SPLIT))
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    if who == "ours":
        vefsdp_optim.save(sd, root)
    else:
        dcp.save(sd, checkpoint_id=root)
    _train(model, opt, range(SPLIT, SPLIT + 2))
    return _full_params(model)


def _interop_load(root: str, who: str) -> dict[str, torch.Tensor]:
    from ckpt_harness import SPLIT, _build, _full_params, _optimizer, _shard, _train
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _shard(_build(2), "fully_shard")
    opt = _optimizer("adamw8bit", model)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    if who == "ours":
        vefsdp_optim.load(sd, root)
    else:
        dcp.load(sd, checkpoint_id=root)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    _train(model, opt, range(SPLIT, SPLIT + 2))
    return _full_params(model)


@pytest.mark.parametrize("writer, reader", [("ours", "torch"), ("torch", "ours")])
def test_interop_across_world_sizes(tmp_path, writer, reader):
    """Sharded model and 8-bit optimizer state: saved at W=2 by one side, loaded at W=3
    by the other, resumed bit for bit."""
    from dist_utils import run_distributed

    want = run_distributed(_interop_save, 2, str(tmp_path / "ck"), writer)[0]
    got = run_distributed(_interop_load, 3, str(tmp_path / "ck"), reader)[0]
    for k, v in want.items():
        assert torch.equal(got[k], v), k


# -- a tensor saved by many ranks: W chunks, each with its own storage entry ---------------


def _chunked_metadata(tmp_path, chunk_sizes: list[int], lie_at: int | None = None):
    """DCP metadata of a 1-D float32 tensor cut into ``chunk_sizes`` (as W ranks save it),
    each chunk's bytes in one file; the entry of chunk ``lie_at`` claims the whole file."""
    from torch.distributed.checkpoint import metadata as md

    from vefsdp_optim._torch_compat import StorageInfo as _StorageInfo

    root = tmp_path / "ckpt"
    root.mkdir(parents=True)
    offsets = [sum(chunk_sizes[:i]) for i in range(len(chunk_sizes))]
    numel = sum(chunk_sizes)
    framing = 4096
    (root / "__0_0.distcp").write_bytes(b"\0" * (numel * 4 + framing * len(chunk_sizes)))
    chunks = [md.ChunkStorageMetadata(offsets=torch.Size([o]), sizes=torch.Size([n]))
              for o, n in zip(offsets, chunk_sizes, strict=True)]
    props = md.TensorProperties(dtype=torch.float32)
    sdm = {"w": md.TensorStorageMetadata(properties=props, size=torch.Size([numel]), chunks=chunks)}
    storage = {}
    for i, (o, n) in enumerate(zip(offsets, chunk_sizes, strict=True)):
        length = (numel * 4 + framing * len(chunk_sizes)) if i == lie_at else n * 4 + framing
        storage[md.MetadataIndex("w", torch.Size([o]), i)] = _StorageInfo("__0_0.distcp", 0, length)
    return md.Metadata(state_dict_metadata=sdm, storage_data=storage), str(root)


def test_many_chunks_confined_like_each_chunk_alone(tmp_path):
    """Every entry's length is checked against its own chunk (and only it) at 1,024 chunks
    of uneven sizes, as the one-chunk-at-a-time reading of ``_confine`` in
    vefsdp_optim/_checkpoint/_safe_load.py says."""
    from vefsdp_optim._checkpoint._safe_load import _confine

    sizes = [(37 * i) % 101 + 1 for i in range(1024)]
    meta, root = _chunked_metadata(tmp_path, sizes)
    _confine(meta, root, root)  # every entry fits its chunk: accepted
    meta, root = _chunked_metadata(tmp_path / "lie", sizes, lie_at=700)
    with pytest.raises(ValueError, match="the entry of w claims .* more than its chunk needs"):
        _confine(meta, root, root)


def test_chunk_bounds_equal_a_scan_of_every_chunk():
    """The per-tensor table of bounds against the definition: for each offset, the largest
    chunk at that offset (framing included); with no offset, the largest chunk."""
    import random

    from torch.distributed.checkpoint import metadata as md

    from vefsdp_optim._checkpoint._safe_load import _FRAMING, _chunk_bounds

    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(0, 12)
        chunks = [md.ChunkStorageMetadata(offsets=torch.Size([rng.randint(0, 5), rng.randint(0, 3)]),
                                          sizes=torch.Size([rng.randint(0, 9), rng.randint(0, 9)]))
                  for _ in range(n)]
        entry = md.TensorStorageMetadata(properties=md.TensorProperties(dtype=torch.bfloat16),
                                         size=torch.Size([20, 20]), chunks=chunks)
        by_offset, largest = _chunk_bounds(entry)

        def scan(offset, chunks=chunks):  # noqa: ANN001, ANN202 - the definition, every chunk
            bound = _FRAMING
            for c in chunks:
                if offset is None or tuple(c.offsets) == offset:
                    bound = max(bound, _FRAMING + c.sizes[0] * c.sizes[1] * 2)
            return bound

        assert largest == scan(None)
        for o in {tuple(c.offsets) for c in chunks} | {(9, 9)}:
            assert by_offset.get(o, _FRAMING) == scan(o), o


def _accepts(check, *args) -> bool:  # noqa: ANN001
    try:
        check(*args)
    except ValueError:
        return False
    return True


def test_one_pass_checks_equal_the_entry_by_entry_definition(tmp_path):
    """The metadata checks run one pass per field over all chunks and entries
    (_chunks_inside, _storage_typed, _confined; O(chunks) in C, not Python per chunk);
    each must accept exactly what its entry-by-entry definition accepts, on 300 random
    two-tensor checkpoints with one field broken in each of most: a negative, bool, float
    or missing offset, a chunk past the tensor's end, a wrong type, an entry past its
    file's end or its chunk's bound, a transform that is not a str, a bytes entry."""
    import random

    from torch.distributed.checkpoint import metadata as md

    from vefsdp_optim._checkpoint import _safe_load as S
    from vefsdp_optim._torch_compat import StorageInfo

    rng = random.Random(0)
    root = tmp_path / "ckpt"
    root.mkdir()
    for r in range(4):
        (root / f"__{r}_0.distcp").touch()
        os.truncate(root / f"__{r}_0.distcp", 200_000)
    breaks = ["none", "neg_offset", "bool_offset", "float_size", "outside", "short_offset", "chunk_type",
              "past_file", "past_chunk", "unknown_offset", "transform", "key_type", "info_offset_neg", "bytes"]
    seen = {"fast": 0, "refused": 0}
    for _ in range(300):
        sdm, storage = {}, {}
        for t, fqn in enumerate(("a", "b")):
            world = rng.randint(1, 4)
            rows = [rng.randint(0, 5) for _ in range(world)]
            offs = [sum(rows[:i]) for i in range(world)]
            chunks = [md.ChunkStorageMetadata(torch.Size([o, 0]), torch.Size([n, 3]))
                      for o, n in zip(offs, rows, strict=True)]
            props = md.TensorProperties(dtype=torch.float32)
            sdm[fqn] = md.TensorStorageMetadata(props, torch.Size([sum(rows), 3]), chunks)
            for r, c in enumerate(chunks):
                storage[md.MetadataIndex(fqn, c.offsets, r)] = StorageInfo(
                    f"__{r}_0.distcp", t * 2000, c.sizes[0] * 12 + rng.randint(0, 100))
        what = rng.choice(breaks)
        chunk = sdm["b"].chunks[-1]
        idx, info = list(storage.items())[-1]
        if what == "neg_offset":
            chunk.offsets = torch.Size([-1, 0])
        elif what == "bool_offset":
            chunk.offsets = torch.Size([chunk.offsets[0], False])
        elif what == "float_size":
            chunk.sizes = (float(chunk.sizes[0]), 3)
        elif what == "outside":
            chunk.sizes = torch.Size([chunk.sizes[0] + 1, 3])
        elif what == "short_offset":
            chunk.offsets = torch.Size([chunk.offsets[0]])
        elif what == "chunk_type":
            sdm["b"].chunks[-1] = (chunk.offsets, chunk.sizes)
        elif what == "past_file":
            info.offset = 200_000 - info.length + 1
        elif what == "past_chunk":
            info.length = S._FRAMING + chunk.sizes[0] * 12 + 1
        elif what == "unknown_offset":
            storage[md.MetadataIndex("b", torch.Size([99, 0]), 0)] = StorageInfo("__0_0.distcp", 0, S._FRAMING + 1)
        elif what == "transform":
            info.transform_descriptors = [1]
        elif what == "key_type":
            storage[("b", None)] = storage.pop(idx)
        elif what == "info_offset_neg":
            info.offset = -1
        elif what == "bytes":
            sdm["c"] = md.BytesStorageMetadata()
            storage[md.MetadataIndex("c")] = StorageInfo("__0_0.distcp", 0, 200_000)
        meta = md.Metadata(state_dict_metadata=sdm, storage_data=storage)
        for fqn, entry in sdm.items():
            if isinstance(entry, md.TensorStorageMetadata):
                assert S._chunks_inside(entry) == _accepts(S._check_each_chunk, fqn, entry, "w"), (what, fqn)
        typed = S._storage_typed(storage)
        assert typed == _accepts(S._check_each_storage_entry, storage, "w"), what
        if typed and all(S._chunks_inside(e) for e in sdm.values() if isinstance(e, md.TensorStorageMetadata)):
            fast = S._confined(meta, str(root), "w")
            assert fast == _accepts(S._confine_each_entry, meta, str(root), "w"), what
            seen["fast" if fast else "refused"] += 1
    assert seen["fast"] > 50 and seen["refused"] > 20, seen
