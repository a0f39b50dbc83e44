"""Repo metadata from the Hub (or a mirror set with HF_ENDPOINT), and the Hub's errors turned
into messages that say what to do.

Everything here reads; nothing writes to the cache, so a plan that fails (unknown repo, bad
revision, no matching files, too little disk) leaves the cache exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_utils.hub.selection import (
    SAFETENSORS_INDEX,
    RemoteFile,
    select_dataset_files,
    select_model_files,
)
from fsdp_utils.hub.specs import DEFAULT_REVISION, AssetSpec, RepoType


@dataclass(frozen=True)
class RemoteRepo:
    """A repo at one commit: the revision resolved, every file listed with its checksum."""

    spec: AssetSpec
    commit: str
    files: tuple[RemoteFile, ...]
    endpoint: str
    indexed: tuple[str, ...] | None = None  # the files model.safetensors.index.json names

    def select(self) -> list[RemoteFile]:
        if self.spec.repo_type == "model":
            return select_model_files(
                self.files, self.spec.repo_id, self.spec.include, self.indexed
            )
        return select_dataset_files(self.files, self.spec.include, self.spec.repo_id)


def fetch_repo(api: Any, spec: AssetSpec) -> RemoteRepo:
    """Resolve the revision to a commit and list the repo's files there (two API calls).

    `api` is a `huggingface_hub.HfApi`; it reads HF_TOKEN and HF_ENDPOINT itself. Errors come
    back as ValueError with the fix spelled out (see `explain_hub_error`).
    """
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec.repo_id)
        # Always name the revision: `/api/models/<id>/revision/main` is also what mirrors serve.
        info = api.repo_info(
            spec.repo_id, repo_type=spec.repo_type, revision=spec.requested_revision
        )
        commit = info.sha
        assert commit, f"the Hub returned no commit for {spec}"
        listing = api.list_repo_tree(
            spec.repo_id, repo_type=spec.repo_type, revision=commit, recursive=True
        )
        files = tuple(
            RemoteFile(
                path=item.path,
                size=item.size,
                blob_id=item.blob_id,
                lfs_sha256=item.lfs.sha256 if item.lfs is not None else None,
            )
            for item in listing
            if isinstance(item, RepoFile)
        )
        indexed = None
        if spec.repo_type == "model" and not spec.include and _has(files, SAFETENSORS_INDEX):
            indexed = read_index(api, spec, commit)
    except Exception as error:
        explained = explain_hub_error(error, spec, api)
        if explained is None:
            raise
        raise explained from error
    return RemoteRepo(spec=spec, commit=commit, files=files, endpoint=api.endpoint, indexed=indexed)


def _has(files: tuple[RemoteFile, ...], path: str) -> bool:
    return any(f.path == path for f in files)


def read_index(api: Any, spec: AssetSpec, commit: str) -> tuple[str, ...]:
    """The weight files `model.safetensors.index.json` names at `commit` (one small file,
    read into a temporary folder: planning writes nothing to the cache)."""
    import json
    import tempfile

    from huggingface_hub import hf_hub_download

    with tempfile.TemporaryDirectory() as tmp:
        path = hf_hub_download(
            spec.repo_id,
            SAFETENSORS_INDEX,
            revision=commit,
            local_dir=tmp,
            endpoint=api.endpoint,
            token=api.token,
        )
        try:
            weight_map = json.loads(Path(path).read_text())["weight_map"]
            return tuple(sorted(set(weight_map.values())))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(
                f"{spec}'s {SAFETENSORS_INDEX} is unreadable ({error}): the repo is broken at "
                f"commit {commit[:10]}. Pick files explicitly with an `include:` entry in an "
                "assets file (python download_models.py --config FILE)."
            ) from error


def repo_url(endpoint: str, repo_id: str, repo_type: str) -> str:
    prefix = "" if repo_type == "model" else f"{repo_type}s/"
    return f"{endpoint.rstrip('/')}/{prefix}{repo_id}"


def explain_hub_error(error: Exception, spec: AssetSpec, api: Any) -> ValueError | None:
    """A ValueError naming the fix for a failed Hub call, or None if it is not a user problem."""
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    url = repo_url(api.endpoint, spec.repo_id, spec.repo_type)
    flag = "--model" if spec.repo_type == "model" else "--dataset"
    if isinstance(error, HFValidationError):
        return ValueError(
            f"{spec.repo_id!r} is not a valid Hugging Face {spec.repo_type} id. Hub ids look like "
            f"org/name, e.g. {flag} codellama/CodeLlama-7b-hf; a local folder needs a path such "
            "as ./my-model (and no download)."
        )
    if isinstance(error, OfflineModeIsEnabled):
        return ValueError(
            "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, so nothing can be downloaded: "
            "unset both for the downloader on the login node (HF_HUB_OFFLINE=0 "
            "TRANSFORMERS_OFFLINE=0 python download_models.py ...)."
        )
    if isinstance(error, GatedRepoError):
        return ValueError(_gated_message(spec, url))
    if isinstance(error, DisabledRepoError):
        return ValueError(f"{spec.repo_type} {spec.repo_id} has been disabled on the Hub ({url}).")
    if isinstance(error, RevisionNotFoundError):
        return ValueError(_revision_message(spec, api))
    if isinstance(error, RepositoryNotFoundError):
        return ValueError(_not_found_message(spec, api, url))
    if _is_connection_error(error):
        return ValueError(
            f"Cannot reach {api.endpoint} ({type(error).__name__}: {error}). Run the downloader "
            "on the login node (compute nodes have no internet); behind a site mirror, set "
            "HF_ENDPOINT to its URL."
        )
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else "?"
        return ValueError(f"The Hub answered HTTP {status} for {spec} ({url}): {error}")
    return None


def _is_connection_error(error: Exception) -> bool:
    # huggingface_hub's HTTP stack changed over versions (requests, httpx, httpx2): match the
    # transport error classes by name rather than importing one of them.
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & {"TransportError", "ConnectionError", "ConnectError", "Timeout"})


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def _gated_message(spec: AssetSpec, url: str) -> str:
    if _has_token():
        return (
            f"Your Hugging Face token has no access to the gated {spec.repo_type} {spec.repo_id} "
            f"yet. Accept its conditions at {url} with the account the token belongs to "
            "(some repos need a manual approval), then re-run:\n  " + spec.command()
        )
    return (
        f"{spec.repo_type.capitalize()} {spec.repo_id} is gated. Accept its conditions at {url}, "
        "create a read token at https://huggingface.co/settings/tokens and pass it in the "
        "environment (it is never printed or written by this tool):\n  "
        f"HF_TOKEN=hf_... {spec.command()}\n(or run `hf auth login` once)."
    )


def _revision_message(spec: AssetSpec, api: Any) -> str:
    try:
        refs = api.list_repo_refs(spec.repo_id, repo_type=spec.repo_type)
        branches = ", ".join(b.name for b in refs.branches) or "none"
        tags = ", ".join(t.name for t in refs.tags) or "none"
        known = f" Branches: {branches}; tags: {tags}; a commit hash works too."
    except Exception:  # the refs are a hint only
        known = ""
    flag = "--revision" if spec.repo_type == "model" else "--dataset-revision"
    return (
        f"Revision {spec.revision!r} does not exist in {spec.repo_type} {spec.repo_id}.{known} "
        f"Fix {flag}."
    )


def _other_type(repo_type: RepoType) -> RepoType:
    return "dataset" if repo_type == "model" else "model"


def _exists(api: Any, repo_id: str, repo_type: str) -> bool:
    """Whether the repo exists at its default branch (a hint for messages only)."""
    try:
        api.repo_info(repo_id, repo_type=repo_type, revision=DEFAULT_REVISION)
    except Exception:
        return False
    return True


def _not_found_message(spec: AssetSpec, api: Any, url: str) -> str:
    # Some servers (mirrors) answer "repo not found" for a missing revision: tell them apart.
    if spec.revision and _exists(api, spec.repo_id, spec.repo_type):
        return _revision_message(spec, api)
    other = _other_type(spec.repo_type)
    if _exists(api, spec.repo_id, other):
        return (
            f"{spec.repo_id} is a {other}, not a {spec.repo_type}: pass it with "
            f"{'--model' if other == 'model' else '--dataset'}."
        )
    private_hint = (
        " If it is private, your token's account has no access to it."
        if _has_token()
        else " If it is private, pass a token: HF_TOKEN=hf_... (never printed or stored by us)."
    )
    return (
        f"{spec.repo_type.capitalize()} {spec.repo_id!r} was not found on {api.endpoint}. Check "
        f"the spelling (org/name, case-sensitive) at {url}.{private_hint}"
    )
