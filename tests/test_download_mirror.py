"""download_models.py end to end against a real HF-compatible server (olah) on loopback.

Every download runs the real script in a subprocess (online, HF_ENDPOINT = the mirror); the
compute side (`fsdp_utils.hub.resolve`) is called in-process, offline, as the trainer calls it.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdp_utils.config.train_config import DEFAULT_DATASET_INCLUDE
from fsdp_utils.hub.manifest import ManifestEntry, find_entry, load_manifest
from fsdp_utils.hub.resolve import MissingAssetError, resolve_dataset_files, resolve_model_dir
from tests.hf_mirror import (  # noqa: F401 (hub_mirror_fixture registers `hub_mirror`)
    DATASET_ID,
    GATED_ID,
    MODEL_ID,
    SHARDED_ID,
    HubMirror,
    HubProxy,
    free_port,
    hub_mirror_fixture,
)

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "download_models.py"
TOKEN = "hf_TESTtokenThatMustNeverBeWritten0123"
# What the model selection must leave out: PyTorch copies, original/ checkpoints, git metadata.
NOT_FETCHED = {".gitattributes", "pytorch_model.bin", "original/consolidated.00.pth"}


def download(
    mirror: HubMirror, home: Path, *args: str, endpoint: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=mirror.env(home, endpoint, **env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_printed_command(
    mirror: HubMirror, home: Path, command: str
) -> subprocess.CompletedProcess[str]:
    """Run a `python download_models.py ...` line exactly as a message printed it."""
    words = shlex.split(command)
    assert words[:2] == ["python", "download_models.py"], command
    return download(mirror, home, *words[2:])


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def entry(cache: Path, repo_type: str, repo_id: str, revision: str | None) -> ManifestEntry:
    found = find_entry(load_manifest(cache), repo_type, repo_id, revision)
    assert found is not None, f"no manifest entry for {repo_type} {repo_id}@{revision}"
    return found


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Downloaded:
    home: Path

    @property
    def cache(self) -> Path:
        return self.home / "hub"

    def copy(self, target: Path) -> Downloaded:
        """A private copy to damage (the HF cache's symlinks are relative, so they follow)."""
        shutil.copytree(self.home, target, symlinks=True)
        return Downloaded(target)


@pytest.fixture(scope="session")
def downloaded(hub_mirror: HubMirror, tmp_path_factory: pytest.TempPathFactory) -> Downloaded:
    """`python download_models.py` with no arguments, then the model's v1.0 tag, into
    $HF_HOME/hub (the default cache location)."""
    home = tmp_path_factory.mktemp("downloaded") / "hf_home"
    ok(download(hub_mirror, home))
    ok(download(hub_mirror, home, "--model", MODEL_ID, "--revision", "v1.0"))
    return Downloaded(home)


def test_defaults_are_fetched_pinned_and_checksummed(
    downloaded: Downloaded, hub_mirror: HubMirror
) -> None:
    model_repo, dataset_repo = hub_mirror.repos[MODEL_ID], hub_mirror.repos[DATASET_ID]
    for revision in ("main", "v1.0"):
        model = entry(downloaded.cache, "model", MODEL_ID, revision)
        assert model.commit == model_repo.commits[revision]
        # safetensors, config, tokenizer, licence; never the .bin or original/ copies
        fetched = {f.path for f in model.files}
        assert fetched == set(model_repo.files) - NOT_FETCHED
        assert (
            downloaded.cache / "models--codellama--CodeLlama-7b-hf" / "refs" / revision
        ).read_text() == model.commit
    main = entry(downloaded.cache, "model", MODEL_ID, None)
    snapshot = resolve_model_dir(MODEL_ID, cache_dir=str(downloaded.cache))
    assert snapshot == main.snapshot(downloaded.cache)
    for record in main.files:
        content = (snapshot / record.path).read_bytes()
        assert content == model_repo.files[record.path]
        assert (record.size, record.sha256) == (len(content), sha256(content))

    dataset = entry(downloaded.cache, "dataset", DATASET_ID, None)
    assert dataset.commit == dataset_repo.commits["main"]
    assert [f.path for f in dataset.files] == [DEFAULT_DATASET_INCLUDE]  # one shard, not all
    assert list(dataset.repo_files) == sorted(dataset_repo.files)
    files = resolve_dataset_files(
        DATASET_ID, DEFAULT_DATASET_INCLUDE, cache_dir=str(downloaded.cache)
    )
    assert [f.read_bytes() for f in files] == [dataset_repo.files[DEFAULT_DATASET_INCLUDE]]


def test_revisions_resolve_to_their_pinned_commit_offline(
    downloaded: Downloaded, hub_mirror: HubMirror
) -> None:
    commits = hub_mirror.repos[MODEL_ID].commits
    cache = str(downloaded.cache)
    tagged = resolve_model_dir(MODEL_ID, "v1.0", cache)
    assert tagged.name == commits["v1.0"] != commits["main"]
    assert resolve_model_dir(MODEL_ID, commits["v1.0"][:8], cache) == tagged
    assert b"revised" not in (tagged / "README.md").read_bytes()
    assert b"revised" in (resolve_model_dir(MODEL_ID, None, cache) / "README.md").read_bytes()
    with pytest.raises(MissingAssetError) as error:
        resolve_model_dir(MODEL_ID, "v2.0", cache)
    assert "cached at main" in str(error.value) and "--revision v2.0" in str(error.value)

    # The refs we write let Hugging Face's own offline loading (from_pretrained's per-file
    # lookup) find the same snapshot by revision name.
    from huggingface_hub import hf_hub_download

    found = hf_hub_download(
        MODEL_ID, "config.json", revision="v1.0", cache_dir=cache, local_files_only=True
    )
    assert Path(found).parent == tagged


def test_missing_shards_name_the_command_that_fetches_them(
    downloaded: Downloaded, hub_mirror: HubMirror, tmp_path: Path
) -> None:
    mine = downloaded.copy(tmp_path / "home")
    include = "chess_game_000[1-2].parquet"
    with pytest.raises(MissingAssetError) as error:
        resolve_dataset_files(DATASET_ID, include, cache_dir=str(mine.cache))
    message = str(error.value)
    assert "chess_game_0002.parquet" in message and "chess_game_0001.parquet" not in message
    result = ok(run_printed_command(hub_mirror, mine.home, message.splitlines()[-1]))
    assert "downloading 1 file(s)" in result.stdout  # shard 1 was already cached

    files = resolve_dataset_files(DATASET_ID, include, cache_dir=str(mine.cache))
    shards = hub_mirror.repos[DATASET_ID].files
    assert [f.name for f in files] == ["chess_game_0001.parquet", "chess_game_0002.parquet"]
    assert [f.read_bytes() for f in files] == [shards[f.name] for f in files]
    # The entry accumulated (same commit): both shards are recorded.
    assert {f.path for f in entry(mine.cache, "dataset", DATASET_ID, None).files} == {
        f.name for f in files
    }


def test_a_plan_before_downloading_needs_only_the_config(
    hub_mirror: HubMirror, tmp_path: Path
) -> None:
    """The planner's message for a model not cached names `--config_only`; that command fetches
    config.json alone (no manifest entry: not enough to train), and the planner finds it."""
    from fsdp_utils.hub.resolve import config_folder

    home = tmp_path / "hf_home"
    with pytest.raises(MissingAssetError) as error:
        config_folder(MODEL_ID, cache_dir=str(home / "hub"))
    command = str(error.value).splitlines()[-1].strip()
    assert command.endswith("--config_only") and "not in the offline cache" in str(error.value)
    result = ok(run_printed_command(hub_mirror, home, command))
    assert "config.json only" in result.stdout and "python -m fsdp_utils.plan" in result.stdout
    folder = config_folder(MODEL_ID, cache_dir=str(home / "hub"))
    config = hub_mirror.repos[MODEL_ID].files["config.json"]
    assert (folder / "config.json").read_bytes() == config
    assert [p.name for p in folder.iterdir()] == ["config.json"]  # nothing else fetched
    with pytest.raises(MissingAssetError, match=r"python download_models\.py --model"):
        resolve_model_dir(MODEL_ID, cache_dir=str(home / "hub"))  # training needs the model


def test_verify_reports_corruption_and_its_repair_commands_fix_it(
    downloaded: Downloaded, hub_mirror: HubMirror, tmp_path: Path
) -> None:
    mine = downloaded.copy(tmp_path / "home")
    shard = (
        entry(mine.cache, "dataset", DATASET_ID, None).snapshot(mine.cache)
        / DEFAULT_DATASET_INCLUDE
    )
    blob = shard.resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped: only a hash can tell
    blob.write_bytes(bytes(data))
    model_snapshot = entry(mine.cache, "model", MODEL_ID, "main").snapshot(mine.cache)
    (model_snapshot / "tokenizer.json").unlink()

    report = download(hub_mirror, mine.home, "--verify")
    assert report.returncode == 1, report.stdout + report.stderr
    assert f"{DEFAULT_DATASET_INCLUDE}: corrupt" in report.stdout
    assert "tokenizer.json: missing" in report.stdout
    assert "verify: 1 of 3 asset(s) OK" in report.stdout  # the v1.0 model is intact
    repairs = [
        line.split("repair: ", 1)[1] for line in report.stdout.splitlines() if "repair: " in line
    ]
    assert len(repairs) == 2
    outputs = [
        ok(run_printed_command(hub_mirror, mine.home, command)).stdout for command in repairs
    ]
    assert any("cached copy is corrupt, fetching it again" in out for out in outputs)

    ok(download(hub_mirror, mine.home, "--verify"))
    assert shard.read_bytes() == hub_mirror.repos[DATASET_ID].files[DEFAULT_DATASET_INCLUDE]


def test_check_offline_loads_everything_in_a_network_namespace(
    downloaded: Downloaded, hub_mirror: HubMirror
) -> None:
    probe = f"{sys.executable} -c 'import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=3)' {hub_mirror.endpoint}"
    script = (
        "ip link set lo up; "
        f"if {probe} 2>/dev/null; then echo MIRROR-REACHABLE; else echo NO-NETWORK; fi; "
        f"exec {sys.executable} {SCRIPT} --check-offline --cache-dir {downloaded.cache}"
    )
    result = subprocess.run(
        ["unshare", "--net", "sh", "-c", script],
        env=hub_mirror.env(downloaded.home),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.startswith("NO-NETWORK")
    assert "offline check: no network at all (unshare --net)" in out  # nested namespace works
    assert f"OK   model {MODEL_ID}@main: llama, tokenizer with" in out
    assert f"OK   model {MODEL_ID}@v1.0" in out
    assert f"OK   dataset {DATASET_ID}@main [{DEFAULT_DATASET_INCLUDE}]: 1 file(s)" in out
    assert "offline check OK" in out


def test_check_offline_fails_with_the_fix_for_a_missing_shard(
    downloaded: Downloaded, hub_mirror: HubMirror, tmp_path: Path
) -> None:
    mine = downloaded.copy(tmp_path / "home")
    shard = (
        entry(mine.cache, "dataset", DATASET_ID, None).snapshot(mine.cache)
        / DEFAULT_DATASET_INCLUDE
    )
    shard.unlink()
    args = ["--dataset", DATASET_ID, "--dataset-include", DEFAULT_DATASET_INCLUDE]
    result = download(hub_mirror, mine.home, "--check-offline", *args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"FAIL dataset {DATASET_ID}" in result.stdout
    fix = f"python download_models.py --dataset {DATASET_ID} --dataset-include {DEFAULT_DATASET_INCLUDE} --cache-dir {mine.cache}"
    assert fix in result.stdout


@pytest.fixture(scope="module")
def gate(hub_mirror: HubMirror) -> Iterator[HubProxy]:
    with HubProxy(hub_mirror.endpoint, gated=(GATED_ID,), token=TOKEN) as proxy:
        yield proxy


BAD_INPUT = {
    "misspelled id": (["--model", "codellama/CodeLama-7b-hf"], {}, "was not found on"),
    "invalid id": (
        ["--model", "codellama//CodeLlama-7b-hf"],
        {},
        "is not a valid Hugging Face model id",
    ),
    "dataset as model": (
        ["--model", DATASET_ID],
        {},
        "is a dataset, not a model: pass it with --dataset",
    ),
    "unknown revision": (
        ["--model", MODEL_ID, "--revision", "v9.9"],
        {},
        "Revision 'v9.9' does not exist in model codellama/CodeLlama-7b-hf. Branches: main; tags: v1.0",
    ),
    "no matching shard": (
        ["--dataset", DATASET_ID, "--dataset-include", "chess_game_9*.parquet"],
        {},
        "No file of laion/strategic_game_chess matches 'chess_game_9*.parquet'",
    ),
    "gated without token": (
        ["--model", GATED_ID],
        {"endpoint": "gate"},
        "is gated. Accept its conditions",
    ),
    "gated, token without access": (
        ["--model", GATED_ID],
        {"endpoint": "gate", "HF_TOKEN": "hf_someoneElsesToken"},
        "Your Hugging Face token has no access to the gated model",
    ),
    "offline variables set": (
        [],
        {"HF_HUB_OFFLINE": "1"},
        "HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=0 python download_models.py",
    ),
    "no server": ([], {"endpoint": "nowhere"}, "Cannot reach http://127.0.0.1:"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_gives_one_clear_message_and_leaves_the_cache_alone(
    case: str, hub_mirror: HubMirror, gate: HubProxy, tmp_path: Path
) -> None:
    args, env, expected = BAD_INPUT[case]
    env = dict(env)
    endpoints = {"gate": gate.endpoint, "nowhere": f"http://127.0.0.1:{free_port()}"}
    endpoint = endpoints.get(env.pop("endpoint", ""))
    result = download(hub_mirror, tmp_path / "home", *args, endpoint=endpoint, **env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    assert expected in result.stderr
    cache = tmp_path / "home" / "hub"
    assert not cache.exists() or not any(cache.iterdir()), sorted(cache.rglob("*"))


def test_gated_model_downloads_with_a_token_that_is_never_written(
    hub_mirror: HubMirror, gate: HubProxy, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    result = ok(
        download(hub_mirror, home, "--model", GATED_ID, endpoint=gate.endpoint, HF_TOKEN=TOKEN)
    )
    assert TOKEN not in result.stdout + result.stderr
    assert (
        entry(home / "hub", "model", GATED_ID, None).commit
        == hub_mirror.repos[GATED_ID].commits["main"]
    )
    written = [p for p in home.rglob("*") if p.is_file() and not p.is_symlink()]
    assert written and not [p for p in written if TOKEN.encode() in p.read_bytes()]


def test_sharded_model_fetches_the_indexed_shards_not_their_consolidated_copy(
    hub_mirror: HubMirror, tmp_path: Path
) -> None:
    """As Mistral-7B-v0.3: shards named by model.safetensors.index.json, and the same weights
    again in consolidated.safetensors, which is neither fetched nor hashed."""
    from transformers import AutoModelForCausalLM

    home = tmp_path / "home"
    result = ok(download(hub_mirror, home, "--model", SHARDED_ID))
    repo = hub_mirror.repos[SHARDED_ID]
    fetched = {f.path for f in entry(home / "hub", "model", SHARDED_ID, None).files}
    assert fetched == set(repo.files) - {".gitattributes", "consolidated.safetensors"}
    assert f"{len(fetched)} of {len(repo.files)} files" in result.stdout
    snapshot = resolve_model_dir(SHARDED_ID, cache_dir=str(home / "hub"))
    assert not (snapshot / "consolidated.safetensors").exists()
    assert AutoModelForCausalLM.from_pretrained(snapshot).num_parameters() > 0


def test_full_disk_is_refused_before_anything_is_written(
    hub_mirror: HubMirror, tmp_path: Path
) -> None:
    disk = tmp_path / "small_disk"
    disk.mkdir()
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {disk} || exit 99; "
        f"{sys.executable} {SCRIPT} --cache-dir {disk}/hub; rc=$?; "
        f"echo LEFT:; find {disk} -mindepth 1; exit $rc"
    )
    result = subprocess.run(  # a private mount namespace: the tmpfs vanishes with it
        ["unshare", "--mount", "sh", "-c", script],
        env=hub_mirror.env(tmp_path / "home"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    model, dataset = hub_mirror.repos[MODEL_ID], hub_mirror.repos[DATASET_ID]
    needed = sum(len(model.files[p]) for p in set(model.files) - NOT_FETCHED)
    needed += len(dataset.files[DEFAULT_DATASET_INCLUDE])
    assert f"Not enough disk space in {disk}/hub" in result.stderr
    assert f"({needed} bytes)" in result.stderr and "Nothing was downloaded" in result.stderr
    assert result.stdout.split("LEFT:", 1)[1].strip() == ""


def test_assets_file_dry_run_plans_without_writing(hub_mirror: HubMirror, tmp_path: Path) -> None:
    assets = tmp_path / "assets.yaml"
    assets.write_text(
        f"assets:\n  - model: {MODEL_ID}\n    revision: v1.0\n"
        f"  - dataset: {DATASET_ID}\n    include: 'chess_game_000[2-3].parquet'\n"
    )
    result = ok(download(hub_mirror, tmp_path / "home", "--config", str(assets), "--dry-run"))
    v1 = hub_mirror.repos[MODEL_ID].commits["v1.0"]
    assert f"model {MODEL_ID}@v1.0 -> commit {v1[:10]}: 7 of 10 files" in result.stdout
    assert "[chess_game_000[2-3].parquet] -> commit" in result.stdout
    assert ": 2 of 6 files" in result.stdout and "dry run: would download" in result.stdout
    assert not (tmp_path / "home" / "hub").exists()


def _wait_for(predicate: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_killed_download_resumes_without_refetching_complete_files(
    hub_mirror: HubMirror, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    model = hub_mirror.repos[MODEL_ID]
    weights_etag = model.sha256("model.safetensors")
    blobs = home / "hub" / "models--codellama--CodeLlama-7b-hf" / "blobs"

    def weights_partial() -> list[Path]:
        return list(blobs.glob(f"{weights_etag}.*.incomplete")) if blobs.is_dir() else []

    # 100 kB/s: the 0.56 MB weights take ~5 s, long enough to interrupt deterministically.
    with HubProxy(hub_mirror.endpoint, bytes_per_second=100_000) as slow:
        for sig in (signal.SIGINT, signal.SIGKILL):
            process = subprocess.Popen(
                [sys.executable, str(SCRIPT), "--model", MODEL_ID, "--workers", "1"],
                env=hub_mirror.env(home, slow.endpoint),
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            _wait_for(weights_partial)
            process.send_signal(sig)
            _, stderr = process.communicate(timeout=60)
            assert not (home / "hub" / "offline-manifest.json").exists()  # nothing half-recorded
            # Stopped mid-file, at once; huggingface_hub's temporary file stays behind.
            assert weights_partial() and not (blobs / weights_etag).exists()
            if sig == signal.SIGINT:
                assert process.returncode == 130 and "Re-run the same command to resume" in stderr
    complete = {p.name: p.stat() for p in blobs.iterdir() if not p.name.endswith(".incomplete")}
    assert complete  # the small files before the weights

    result = ok(download(hub_mirror, home, "--model", MODEL_ID))
    assert "removed 1 partial file(s)" in result.stdout
    assert not list(blobs.glob("*.incomplete"))
    for name, before in complete.items():  # kept, not downloaded again
        after = (blobs / name).stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    recorded = entry(home / "hub", "model", MODEL_ID, None)
    assert {f.path: f.sha256 for f in recorded.files} == {
        p: model.sha256(p) for p in set(model.files) - NOT_FETCHED
    }


def test_prepare_tokenises_on_the_login_node_for_the_trainer(
    downloaded: Downloaded, hub_mirror: HubMirror, tmp_path: Path
) -> None:
    from fsdp_utils.config.parse import config_from_dict
    from fsdp_utils.data.prepare import prepare_dataset

    mine = downloaded.copy(tmp_path / "home")
    train_yaml = tmp_path / "train.yaml"
    train_yaml.write_text(
        f"model: {MODEL_ID}\ndataset: {DATASET_ID}\ndataset_include: {DEFAULT_DATASET_INCLUDE}\n"
        f"cache_dir: {mine.cache}\nmax_seq_length: 128\neval_examples: 10\n"
    )
    result = ok(download(hub_mirror, mine.home, "--config", str(train_yaml), "--prepare"))
    line = next(x for x in result.stdout.splitlines() if x.startswith("prepared in "))
    prepared = Path(line.split(": ", 1)[1])
    assert (prepared / "meta.json").is_file()

    # The trainer (offline, same config) finds the prepared data instead of redoing it.
    import yaml

    config = config_from_dict(yaml.safe_load(train_yaml.read_text()))
    logged: list[str] = []
    assert prepare_dataset(config, log=logged.append) == prepared
    assert any("using prepared data" in line for line in logged)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest: this process never went online
