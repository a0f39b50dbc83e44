"""`download_models.py --verify`: re-hash the cache against the manifest, offline.

Reports, per asset, the files that are missing, truncated or corrupt, and the command that
repairs them (the downloader re-hashes what is cached and re-fetches what is wrong).
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fsdp_utils.hub.hashing import digest_files
from fsdp_utils.hub.manifest import (
    ManifestEntry,
    cached_revisions,
    find_entry,
    load_manifest,
    manifest_path,
)
from fsdp_utils.hub.specs import AssetSpec


@dataclass(frozen=True)
class AssetReport:
    spec: AssetSpec
    commit: str | None  # None: not in the manifest at all
    checked: int  # files hashed
    problems: tuple[tuple[str, str], ...]  # (path, what is wrong)
    repair: str  # the command that fixes it

    @property
    def ok(self) -> bool:
        return self.commit is not None and not self.problems

    def lines(self) -> list[str]:
        if self.ok:
            assert self.commit is not None
            return [f"OK   {self.spec}: commit {self.commit[:10]}, {self.checked} file(s) verified"]
        if self.commit is None:
            head = f"FAIL {self.spec}: not in the cache"
        else:
            head = f"FAIL {self.spec}: commit {self.commit[:10]}, {len(self.problems)} problem(s)"
        details = [f"       {path}: {reason}" for path, reason in self.problems]
        return [head, *details, f"     repair: {self.repair}"]


def spec_of(entry: ManifestEntry) -> AssetSpec:
    """The spec that fetches exactly what an entry holds (for datasets: its files)."""
    revision = None if entry.revision == "main" else entry.revision
    if entry.repo_type == "model":
        return AssetSpec(entry.repo_id, "model", revision)
    include = ",".join(sorted(glob.escape(p) for p in entry.file_paths()))
    return AssetSpec(entry.repo_id, "dataset", revision, include)


def verify_cache(
    cache_dir: Path, specs: Sequence[AssetSpec] | None = None, workers: int = 4
) -> list[AssetReport]:
    """Check the given assets, or every asset in the manifest. Never touches the network."""
    entries = load_manifest(cache_dir)
    if specs is None:
        if not entries:
            raise ValueError(
                f"Nothing to verify: {manifest_path(cache_dir)} does not exist yet. Download "
                "first: python download_models.py (see --help for --model/--dataset/--config)."
            )
        pairs: list[tuple[AssetSpec, ManifestEntry | None]] = [(spec_of(e), e) for e in entries]
    else:
        pairs = [(s, find_entry(entries, s.repo_type, s.repo_id, s.revision)) for s in specs]
    return [_verify_one(spec, entry, cache_dir, entries, workers) for spec, entry in pairs]


def _verify_one(
    spec: AssetSpec,
    entry: ManifestEntry | None,
    cache_dir: Path,
    entries: Sequence[ManifestEntry],
    workers: int,
) -> AssetReport:
    if entry is None:
        others = cached_revisions(entries, spec.repo_type, spec.repo_id)
        note = (("cached revisions", ", ".join(others)),) if others else ()
        return AssetReport(spec, None, 0, note, spec.command(cache_dir))

    snapshot = entry.snapshot(cache_dir)
    wanted = entry.wanted_paths(spec.include)
    records = {f.path: f for f in entry.files}
    problems = {p: "never downloaded" for p in wanted if p not in records}
    present = [p for p in wanted if p in records and (snapshot / p).is_file()]
    problems |= {p: "missing" for p in wanted if p in records and p not in present}
    digests = digest_files((snapshot / p for p in present), workers)
    for path in present:
        digest, record = digests[snapshot / path], records[path]
        if digest.size != record.size:
            problems[path] = f"{digest.size} bytes, expected {record.size} (truncated?)"
        elif digest.sha256 != record.sha256:
            problems[path] = f"corrupt: sha256 {digest.sha256[:12]}..., expected {record.sha256}"
    if spec.repo_type == "model" or not problems:
        repair = spec.command(cache_dir)
    else:  # fetch just the broken shards
        include = ",".join(glob.escape(p) for p in sorted(problems))
        repair = AssetSpec(spec.repo_id, "dataset", spec.revision, include).command(cache_dir)
    return AssetReport(spec, entry.commit, len(present), tuple(sorted(problems.items())), repair)
