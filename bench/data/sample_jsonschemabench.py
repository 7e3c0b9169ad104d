"""Regenerate bench/data/jsonschemabench/ from a copy of guidance-ai/jsonschemabench.

    python bench/data/sample_jsonschemabench.py SOURCE [--commit SHA] [--n 240] [--seed 14]

SOURCE is either a git directory of that repository (a bare clone or a mirror without a
work tree: files are read with ``git ls-tree``/``git cat-file`` at ``--commit``) or a
checked-out work tree (files read from ``SOURCE/maskbench/data``).

The rule (also in the README next to the data):

* the files are ``maskbench/data/*.json``; a file's subset is the part of its name before
  ``---`` (``Github_easy---o10008.json`` -> ``Github_easy``) or, for the BFCL files, the
  name without its trailing ``_<number>.json`` (``BFCL_java_12.json`` -> ``BFCL_java``);
* the first 20 files of every subset in sorted order are never used (they are kept for an
  independent check). "Sorted" is ambiguous for numbered names, so both orders are
  excluded: plain string order (``_0, _1, _10, _11 ...``) and numeric-aware order
  (``_0, _1, _2 ...``); a file first-20 in either is out;
* ``JsonSchemaStore---cloudformation.schema.json`` is left out by name (the copy the
  committed sample came from lacks its 1.9 MB blob; naming it keeps the sample the same
  from any copy);
* of the rest, only files with at least one test instance (valid or invalid) are eligible;
* ``--n`` files are drawn with ``random.Random(seed)``, stratified by subset: every subset
  with eligible files gets ``min(--min-per-subset, eligible)``, the remainder is shared in
  proportion to the eligible counts (largest remainder, ties by subset name), then each
  subset's share is ``rng.sample``d from its sorted eligible list, subsets in name order;
* the chosen files are copied byte for byte; ``manifest.json`` lists each with its
  subset, git blob id, size and test counts.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

DATA = "maskbench/data"
OUT = Path(__file__).parent / "jsonschemabench"
HELD_OUT = 20
# Left out by name, so every copy gives the same sample: the mirror this sample was drawn
# from lacks this file's blob (the repository's largest file, 1.9 MB; listed but absent).
ABSENT = ("JsonSchemaStore---cloudformation.schema.json",)


def subset_of(name: str) -> str:
    if "---" in name:
        return name.split("---", 1)[0]
    return re.sub(r"_\d+\.json$", "", name)


def natural_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def held_out(names: list[str]) -> set[str]:
    """The first HELD_OUT of a subset's names, in string order and in numeric-aware order."""
    return set(sorted(names)[:HELD_OUT]) | set(sorted(names, key=natural_key)[:HELD_OUT])


class Source:
    """Files of maskbench/data from a git directory (at a commit) or a work tree."""

    def __init__(self, path: Path, commit: str | None) -> None:
        self.tree = path / DATA if (path / DATA).is_dir() else None
        self.path = path
        self.commit = commit or "HEAD"
        self.blobs: dict[str, str] = {}
        if self.tree is None:
            out = self._git("ls-tree", self.commit, f"{DATA}/").decode()
            for line in out.splitlines():
                meta, path_ = line.split("\t", 1)
                self.blobs[path_.rsplit("/", 1)[1]] = meta.split()[2]
            self.commit = self._git("rev-parse", self.commit).decode().strip()
        else:
            try:
                self.commit = self._git("rev-parse", self.commit).decode().strip()
            except (subprocess.CalledProcessError, FileNotFoundError):
                self.commit = "unknown (work tree without git)"

    def _git(self, *args: str, stdin: bytes | None = None) -> bytes:
        return subprocess.run(["git", "-C", str(self.path), *args], input=stdin,
                              capture_output=True, check=True).stdout

    def names(self) -> list[str]:
        if self.tree is not None:
            return sorted(p.name for p in self.tree.glob("*.json"))
        return sorted(n for n in self.blobs if n.endswith(".json"))

    def read_many(self, names: list[str]) -> dict[str, bytes]:
        if self.tree is not None:
            return {n: (self.tree / n).read_bytes() for n in names}
        # one `git cat-file --batch` for all of them
        req = "".join(self.blobs[n] + "\n" for n in names).encode()
        out = self._git("cat-file", "--batch", stdin=req)
        res, pos = {}, 0
        for n in names:
            header_end = out.index(b"\n", pos)
            size = int(out[pos:header_end].split()[2])
            res[n] = out[header_end + 1: header_end + 1 + size]
            pos = header_end + 1 + size + 1
        return res

    def blob_id(self, name: str, data: bytes) -> str:
        if name in self.blobs:
            return self.blobs[name]
        return self._git("hash-object", "--stdin", stdin=data).decode().strip()


def allocate(sizes: dict[str, int], total: int, min_per: int) -> dict[str, int]:
    alloc = {s: min(min_per, n) for s, n in sizes.items()}
    rest = total - sum(alloc.values())
    room = {s: sizes[s] - alloc[s] for s in sizes}
    weight = sum(room.values())
    if rest <= 0 or weight == 0:
        return alloc
    quotas = {s: rest * room[s] / weight for s in sizes}
    for s in sizes:
        alloc[s] += min(room[s], int(quotas[s]))
    left = total - sum(alloc.values())
    for s in sorted(sizes, key=lambda s: (-(quotas[s] - int(quotas[s])), s)):
        if left <= 0:
            break
        if alloc[s] < sizes[s]:
            alloc[s] += 1
            left -= 1
    return alloc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--n", type=int, default=240)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--min-per-subset", type=int, default=4)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    src = Source(args.source, args.commit)
    by_subset: dict[str, list[str]] = {}
    for n in src.names():
        by_subset.setdefault(subset_of(n), []).append(n)
    candidates = {s: sorted(set(ns) - held_out(ns) - set(ABSENT))
                  for s, ns in by_subset.items()}
    contents = src.read_many([n for ns in candidates.values() for n in ns])
    eligible: dict[str, list[str]] = {}
    tests: dict[str, tuple[int, int]] = {}
    for s, ns in sorted(candidates.items()):
        for n in ns:
            doc = json.loads(contents[n])
            t = doc.get("tests") or []
            valid = sum(1 for x in t if x.get("valid"))
            tests[n] = (valid, len(t) - valid)
            if t:
                eligible.setdefault(s, []).append(n)
    alloc = allocate({s: len(ns) for s, ns in eligible.items()}, args.n, args.min_per_subset)
    rng = random.Random(args.seed)
    chosen: list[tuple[str, str]] = []
    for s in sorted(eligible):
        chosen += [(s, n) for n in sorted(rng.sample(eligible[s], alloc[s]))]

    if args.out.exists():
        for p in args.out.glob("*.json"):
            p.unlink()
    args.out.mkdir(parents=True, exist_ok=True)
    files: list[dict[str, Any]] = []
    for s, n in chosen:
        (args.out / n).write_bytes(contents[n])
        v, i = tests[n]
        files.append({"file": n, "subset": s, "blob": src.blob_id(n, contents[n]),
                      "bytes": len(contents[n]), "valid": v, "invalid": i})
    manifest: dict[str, Any] = {
        "source": "github.com/guidance-ai/jsonschemabench, maskbench/data",
        "commit": src.commit, "seed": args.seed, "n": args.n,
        "min_per_subset": args.min_per_subset, "held_out_per_subset": HELD_OUT,
        "left_out_by_name": list(ABSENT),
        "subsets": {s: {"files": len(by_subset[s]), "eligible": len(eligible.get(s, [])),
                        "sampled": alloc.get(s, 0)} for s in sorted(by_subset)},
        "files": files,
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(f["bytes"] for f in files)
    print(f"{len(files)} files, {total / 1e6:.2f} MB, "
          f"{sum(f['valid'] for f in files)} valid and "
          f"{sum(f['invalid'] for f in files)} invalid instances -> {args.out}", file=sys.stderr)
    for s, m in manifest["subsets"].items():
        print(f"  {s:24} {m['files']:5} files, {m['eligible']:5} eligible, "
              f"{m['sampled']:3} sampled", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
