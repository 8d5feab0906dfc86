"""The commit protocol of vefsdp_optim.save: which copy of a checkpoint is newest,
which files are ours, and whether they are intact.

Every directory save() writes carries a marker file, ``.vefsdp-checkpoint.json``:
``{"format": "vefsdp-checkpoint", "generation": g, "state": "writing" | "complete",
"files": {name: {"size": n, "sha256": hex}}}``. Rank 0 writes it with state "writing"
into ``path.tmp-<tag>`` *before* any data. Once all ranks have written, it rewrites it
(write aside, rename) with state "complete" and every file's checksum. Each rank hashes
the files it wrote, right after writing them, and rank 0 gathers what they found, so no
rank hashes another's data (see ``_writer`` in _save_load.py). Only then is the previous
copy moved to ``path.old-<tag>``, the new one renamed to ``path``, and the old one
removed. The generation is one more than the newest complete copy found, so load() takes
the complete copy with the largest generation among ``path``, ``path.old-*`` and
``path.tmp-*`` and warns when that is not ``path``. Leftovers (siblings with our marker,
in any state) are removed by the next successful save, and only the files the protocol
writes (DCP's ``.metadata`` and ``__*.distcp``, the marker) are deleted: a directory
with anything else in it is left in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from typing import Any

MARKER = ".vefsdp-checkpoint.json"
FORMAT = "vefsdp-checkpoint"
_OURS = re.compile(r"^(\.metadata(\.tmp)?|__\d+(_\d+)?\.distcp|__\d+\.metadata(\.tmp)?|"
                   + re.escape(MARKER) + r"(\.tmp)?)$")


def read_marker(directory: str) -> dict[str, Any] | None:
    """The marker of ``directory``, or None when it has none (or it is not ours)."""
    try:
        with open(os.path.join(directory, MARKER), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if (not isinstance(data, dict) or data.get("format") != FORMAT
            or type(data.get("generation")) is not int):
        return None
    return data


def write_marker(directory: str, data: dict[str, Any]) -> None:
    tmp = os.path.join(directory, MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, **data}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MARKER))


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def describe(directory: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Size and checksum of each of the files ``names`` in ``directory``."""
    out = {}
    for name in sorted(set(names)):
        p = os.path.join(directory, name)
        out[name] = {"size": os.path.getsize(p), "sha256": sha256(p)}
    return out


def describe_files(directory: str,
                   known: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Size and checksum of every file DCP wrote into ``directory``: those in ``known``
    (described by the ranks that wrote them) as they are, the rest (the metadata) read
    here."""
    known = known or {}
    names = [n for n in os.listdir(directory)
             if n != MARKER and _OURS.match(n) and not n.endswith(".tmp")]
    out = describe(directory, [n for n in names if n not in known])
    out.update((n, known[n]) for n in names if n in known)
    return dict(sorted(out.items()))


def copies(path: str) -> list[tuple[int, str]]:
    """(generation, directory) of every complete copy of the checkpoint ``path``,
    newest first."""
    parent, base = os.path.split(path)
    names = [path] + [os.path.join(parent, n) for n in _listdir(parent or ".")
                      if n.startswith((base + ".tmp-", base + ".old-"))]
    found = []
    for d in names:
        m = read_marker(d) if os.path.isdir(d) else None
        if m is not None and m.get("state") == "complete":
            found.append((m["generation"], d))
    return sorted(found, key=lambda t: (t[0], t[1] == path), reverse=True)


def leftovers(path: str, keep: str) -> list[str]:
    parent, base = os.path.split(path)
    return [os.path.join(parent, n) for n in _listdir(parent or ".")
            if n.startswith((base + ".tmp-", base + ".old-")) and os.path.join(parent, n) != keep
            and os.path.isdir(os.path.join(parent, n))
            and read_marker(os.path.join(parent, n)) is not None]


def remove_ours(directory: str) -> None:
    """Delete the files the protocol writes in ``directory``, then the directory if
    that left it empty. Nothing else is touched."""
    for name in _listdir(directory):
        p = os.path.join(directory, name)
        if _OURS.match(name) and os.path.isfile(p) and not os.path.islink(p):
            os.unlink(p)
    try:
        os.rmdir(directory)
    except OSError:
        pass  # something not ours is in it: leave it


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []
