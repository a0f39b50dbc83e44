"""Download assets into the hub cache: plan, check disk, fetch in parallel, verify, record.

1. Plan every asset first (revision -> commit, file listing, selection): bad ids, revisions
   and globs fail here, before anything is written.
2. Check free space against the bytes still missing, for all assets together.
3. Per asset: re-hash files already cached (a corrupt one is removed and fetched again), fetch
   the missing ones with `huggingface_hub.snapshot_download` pinned to the commit (parallel,
   with progress bars; HF_TOKEN and HF_ENDPOINT honoured), hash them against the Hub's
   checksums (LFS sha256, git blob id for small files), point `refs/<revision>` at the commit
   and record the entry in the manifest.

Interrupted? Re-run the same command: files already complete are verified and kept, the rest
is fetched. A file cut off mid-transfer starts over: huggingface_hub (since its PR #4228)
downloads into a private temporary file, which we delete if a killed run left it behind.
"""

from __future__ import annotations

import glob
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fsdp_utils.atomic import write_text_atomic
from fsdp_utils.hub.cache import (
    check_free_space,
    format_bytes,
    remove_partial_downloads,
    snapshot_dir,
    storage_dir,
)
from fsdp_utils.hub.hashing import FileDigest, digest_files
from fsdp_utils.hub.manifest import FileRecord, ManifestEntry, record_entry
from fsdp_utils.hub.remote import RemoteRepo, explain_hub_error, fetch_repo
from fsdp_utils.hub.selection import RemoteFile
from fsdp_utils.hub.specs import AssetSpec, download_command

Log = Callable[[str], None]


class ChecksumMismatchError(ValueError):
    """A downloaded file does not match the Hub's checksum."""


@dataclass(frozen=True)
class AssetPlan:
    repo: RemoteRepo
    selected: tuple[RemoteFile, ...]
    cached: frozenset[str]  # selected paths already present in the snapshot

    @property
    def spec(self) -> AssetSpec:
        return self.repo.spec

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.selected)

    @property
    def missing(self) -> list[RemoteFile]:
        return [f for f in self.selected if f.path not in self.cached]

    @property
    def missing_bytes(self) -> int:
        return sum(f.size for f in self.missing)

    def summary(self) -> str:
        cached = f", {format_bytes(self.total_bytes - self.missing_bytes)} already cached"
        return (
            f"{self.spec} -> commit {self.repo.commit[:10]}: {len(self.selected)} of "
            f"{len(self.repo.files)} files, {format_bytes(self.total_bytes)}"
            + (cached if self.cached else "")
        )


def plan_asset(api: Any, spec: AssetSpec, cache_dir: Path) -> AssetPlan:
    repo = fetch_repo(api, spec)
    selected = tuple(repo.select())
    snapshot = snapshot_dir(cache_dir, spec.repo_id, spec.repo_type, repo.commit)
    cached = frozenset(f.path for f in selected if (snapshot / f.path).is_file())
    return AssetPlan(repo=repo, selected=selected, cached=cached)


def download_assets(
    specs: Sequence[AssetSpec],
    cache_dir: Path,
    *,
    workers: int = 8,
    dry_run: bool = False,
    log: Log = print,
) -> list[ManifestEntry]:
    """Fetch, verify and record every asset. Returns the manifest entries written."""
    from huggingface_hub import HfApi

    api = HfApi()
    for spec in specs:
        count, size = remove_partial_downloads(cache_dir, spec.repo_id, spec.repo_type)
        if count:
            log(f"removed {count} partial file(s) ({format_bytes(size)}) left by a killed download")
    plans = [plan_asset(api, spec, cache_dir) for spec in specs]
    for plan in plans:
        log(plan.summary())
    missing_bytes = sum(p.missing_bytes for p in plans)
    missing_files = sum(len(p.missing) for p in plans)
    check_free_space(
        cache_dir,
        missing_bytes,
        what=f"the {missing_files} file(s) not yet cached",
        fix=_command_for(specs, "/path/with/space"),
    )
    if dry_run:
        log(f"dry run: would download {format_bytes(missing_bytes)} into {cache_dir}")
        return []
    return [_download_plan(api, plan, cache_dir, workers, log) for plan in plans]


def download_model_configs(
    specs: Sequence[AssetSpec], cache_dir: Path, *, log: Log = print
) -> list[Path]:
    """Each model's config.json alone (`download_models.py --config_only`): all the memory
    planner reads, in seconds, before deciding to download the weights. Into the hub cache as
    huggingface_hub caches a file (the planner finds it there, `resolve.config_folder`), not
    into the manifest: the model is not in the offline cache for training until it is
    downloaded whole."""
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi()
    paths = []
    for spec in specs:
        if spec.repo_type != "model":
            continue
        try:
            path = Path(
                hf_hub_download(
                    spec.repo_id, "config.json", revision=spec.revision, cache_dir=cache_dir
                )
            )
        except Exception as error:
            explained = explain_hub_error(error, spec, api)
            if explained is None:
                raise
            raise explained from error
        log(f"{spec}: config.json only -> {path}")
        paths.append(path)
    return paths


def _command_for(specs: Sequence[AssetSpec], cache_dir: str) -> str:
    """One command for all the specs, when the command line can express them."""
    models = [s for s in specs if s.repo_type == "model"]
    datasets = [s for s in specs if s.repo_type == "dataset"]
    if len(models) > 1 or len(datasets) > 1:
        return f"python download_models.py --config ASSETS.yaml --cache-dir {cache_dir}"
    model = models[0] if models else None
    dataset = datasets[0] if datasets else None
    return download_command(
        model=model.repo_id if model else None,
        revision=model.revision if model else None,
        dataset=dataset.repo_id if dataset else None,
        include=dataset.include if dataset else None,
        dataset_revision=dataset.revision if dataset else None,
        cache_dir=cache_dir,
    )


def _download_plan(
    api: Any, plan: AssetPlan, cache_dir: Path, workers: int, log: Log
) -> ManifestEntry:
    spec, commit = plan.spec, plan.repo.commit
    snapshot = snapshot_dir(cache_dir, spec.repo_id, spec.repo_type, commit)

    # Files from earlier runs are checked too: the download is also the repair command.
    digests = _digests(snapshot, [f for f in plan.selected if f.path in plan.cached], workers)
    for f, digest in list(digests.items()):
        if not _matches_hub(f, digest):
            log(f"  {f.path}: cached copy is corrupt, fetching it again")
            _remove_cached(snapshot / f.path)
            del digests[f]

    to_fetch = [f for f in plan.selected if f not in digests]
    if to_fetch:
        size = sum(f.size for f in to_fetch)
        log(f"  downloading {len(to_fetch)} file(s), {format_bytes(size)}")
        started = time.monotonic()
        _snapshot_download(api, spec, commit, cache_dir, [f.path for f in to_fetch], workers)
        seconds = time.monotonic() - started
        log(f"  downloaded in {seconds:.1f} s ({format_bytes(size / max(seconds, 1e-3))}/s)")
        fetched = _digests(snapshot, to_fetch, workers)
        for f, digest in fetched.items():
            if not _matches_hub(f, digest):
                _remove_cached(snapshot / f.path)
                raise ChecksumMismatchError(_mismatch_message(spec, f, digest, cache_dir))
        digests |= fetched

    if spec.requested_revision != commit:
        # What `from_pretrained(repo_id, revision=...)` reads offline; written only now that
        # the snapshot is complete and verified.
        ref = storage_dir(cache_dir, spec.repo_id, spec.repo_type) / "refs"
        write_text_atomic(ref / spec.requested_revision, commit)
    entry = ManifestEntry(
        repo_id=spec.repo_id,
        repo_type=spec.repo_type,
        revision=spec.requested_revision,
        commit=commit,
        files=tuple(FileRecord(f.path, d.size, d.sha256) for f, d in _sorted_items(digests)),
        repo_files=tuple(sorted(f.path for f in plan.repo.files)),
        endpoint=plan.repo.endpoint,
        downloaded_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    recorded = record_entry(cache_dir, entry)
    log(f"  verified {len(digests)} file(s) (sha256), pinned to {commit}")
    return recorded


def _sorted_items(digests: dict[RemoteFile, FileDigest]) -> list[tuple[RemoteFile, FileDigest]]:
    return sorted(digests.items(), key=lambda item: item[0].path)


def _digests(
    snapshot: Path, files: Sequence[RemoteFile], workers: int
) -> dict[RemoteFile, FileDigest]:
    """sha256 of every file, plus the git blob id of those the Hub keeps in git (not LFS)."""
    by_path: dict[Path, FileDigest] = {}
    for in_git in (False, True):
        group = [snapshot / f.path for f in files if (f.lfs_sha256 is None) == in_git]
        by_path |= digest_files(group, workers, git_blob_ids=in_git)
    return {f: by_path[snapshot / f.path] for f in files}


def _matches_hub(f: RemoteFile, digest: FileDigest) -> bool:
    """LFS files carry a sha256 on the Hub; small files in git carry their git blob id."""
    if digest.size != f.size:
        return False
    if f.lfs_sha256 is not None:
        return digest.sha256 == f.lfs_sha256
    return digest.git_blob_id == f.blob_id


def _remove_cached(pointer: Path) -> None:
    """Remove a snapshot file and the blob it links to."""
    blob = pointer.resolve()
    pointer.unlink(missing_ok=True)
    if blob != pointer:
        blob.unlink(missing_ok=True)


def _mismatch_message(spec: AssetSpec, f: RemoteFile, digest: FileDigest, cache_dir: Path) -> str:
    expected = f.lfs_sha256 or f"git blob {f.blob_id}"
    got = digest.sha256 if f.lfs_sha256 else f"git blob {digest.git_blob_id}"
    return (
        f"Checksum mismatch for {f.path} of {spec}: expected {expected} ({f.size} bytes), got "
        f"{got} ({digest.size} bytes). The corrupt copy was removed and nothing was recorded. "
        f"Re-run:\n  {spec.command(cache_dir)}\nIf it fails again, the server (or the mirror "
        "in HF_ENDPOINT) is serving a corrupt file."
    )


def _snapshot_download(
    api: Any, spec: AssetSpec, commit: str, cache_dir: Path, paths: list[str], workers: int
) -> None:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(
            spec.repo_id,
            repo_type=spec.repo_type,
            revision=commit,  # pinned: a branch that moves mid-download cannot mix commits
            cache_dir=cache_dir,
            allow_patterns=[glob.escape(p) for p in paths],  # exact names, even with [ or *
            max_workers=workers,
        )
    except Exception as error:
        explained = explain_hub_error(error, spec, api)
        if explained is None:
            raise
        raise explained from error
