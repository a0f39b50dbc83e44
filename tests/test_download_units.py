"""The downloader's pure parts and its offline side, without a server: file selection, the
manifest, cache paths, disk and partial-file handling, verification, command-line errors."""

from __future__ import annotations

import fcntl
import json
import shlex
import subprocess
import threading
from pathlib import Path

import pytest

from fsdp_utils.config.train_config import (
    DEFAULT_DATASET,
    DEFAULT_DATASET_INCLUDE,
    DEFAULT_MODEL,
    TrainConfig,
)
from fsdp_utils.download import main
from fsdp_utils.hub.cache import (
    BUILTIN_CACHE_DIR,
    InsufficientDiskSpaceError,
    check_free_space,
    free_bytes,
    hub_cache_dir,
    remove_partial_downloads,
    snapshot_dir,
)
from fsdp_utils.hub.hashing import digest_file
from fsdp_utils.hub.manifest import (
    FileRecord,
    ManifestEntry,
    find_entry,
    load_manifest,
    manifest_path,
    record_entry,
)
from fsdp_utils.hub.resolve import MissingAssetError, resolve_dataset_files, resolve_model_dir
from fsdp_utils.hub.selection import (
    NoMatchingFilesError,
    RemoteFile,
    select_data_paths,
    select_dataset_files,
    select_model_files,
)
from fsdp_utils.hub.specs import AssetSpec, download_command, load_assets_file
from fsdp_utils.hub.verify import spec_of, verify_cache

# The file listing of codellama/CodeLlama-7b-hf (weights in both formats), plus the extras
# other repos carry (Llama 3's original/ checkpoint, a GGUF, Flax weights).
CODELLAMA_FILES = [
    ".gitattributes",
    "LICENSE",
    "README.md",
    "USE_POLICY.md",
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "pytorch_model-00001-of-00003.bin",
    "pytorch_model-00002-of-00003.bin",
    "pytorch_model-00003-of-00003.bin",
    "pytorch_model.bin.index.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "original/consolidated.00.pth",
    "model-q4.gguf",
    "flax_model.msgpack",
]


def remote(paths: list[str]) -> list[RemoteFile]:
    return [RemoteFile(path=p, size=1, blob_id="0" * 40) for p in paths]


def test_model_selection_takes_safetensors_and_support_files_only() -> None:
    chosen = [f.path for f in select_model_files(remote(CODELLAMA_FILES), "codellama/x")]
    assert chosen == [
        "LICENSE",
        "README.md",
        "USE_POLICY.md",
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]


def test_model_selection_falls_back_to_pytorch_bins_and_fails_without_weights() -> None:
    bins_only = [p for p in CODELLAMA_FILES if ".safetensors" not in p]
    chosen = {f.path for f in select_model_files(remote(bins_only), "x/y")}
    assert "pytorch_model-00003-of-00003.bin" in chosen and "pytorch_model.bin.index.json" in chosen
    assert "flax_model.msgpack" not in chosen
    with pytest.raises(NoMatchingFilesError, match="no weights in safetensors or PyTorch"):
        select_model_files(remote(["config.json", "README.md"]), "x/y")
    explicit = select_model_files(remote(CODELLAMA_FILES), "x/y", include="original/*,config.json")
    assert [f.path for f in explicit] == ["config.json", "original/consolidated.00.pth"]


# The weights of mistralai/Mistral-7B-v0.3: the Hugging Face shards with their index, and a
# consolidated copy of all of them for Mistral's own code (14.5 GB).
MISTRAL_FILES = [
    "config.json",
    "consolidated.safetensors",
    "generation_config.json",
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
    "model.safetensors.index.json",
    "params.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer.model.v3",
    "tokenizer_config.json",
]


def test_model_selection_takes_exactly_the_shards_the_index_names() -> None:
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    chosen = [f.path for f in select_model_files(remote(MISTRAL_FILES), "m/x", indexed=shards)]
    assert "consolidated.safetensors" not in chosen
    assert [p for p in chosen if p.endswith(".safetensors")] == shards
    assert "model.safetensors.index.json" in chosen and "tokenizer.model" in chosen
    # Without an index, the one file transformers loads, not a copy beside it.
    single = ["config.json", "model.safetensors", "consolidated.safetensors"]
    assert [f.path for f in select_model_files(remote(single), "m/x")] == [
        "config.json",
        "model.safetensors",
    ]
    # An index naming a shard the repo lacks: a broken repo, said before anything is fetched.
    with pytest.raises(NoMatchingFilesError, match=r"model-00004-of-00003\.safetensors"):
        select_model_files(
            remote(MISTRAL_FILES), "m/x", indexed=["model-00004-of-00003.safetensors"]
        )
    # An explicit selection is taken as given.
    explicit = select_model_files(remote(MISTRAL_FILES), "m/x", include="consolidated.*")
    assert [f.path for f in explicit] == ["consolidated.safetensors"]


def test_dataset_globs_match_names_or_paths_and_report_what_exists() -> None:
    paths = ["README.md", "dataset_infos.json", "data/chess_game_0001.parquet"]
    paths += [f"chess_game_{i:04d}.parquet" for i in range(1, 12)]
    assert select_data_paths(paths, "chess_game_000[1-2].parquet") == [
        "chess_game_0001.parquet",
        "chess_game_0002.parquet",
        "data/chess_game_0001.parquet",
    ]
    assert select_data_paths(paths, "data/*") == ["data/chess_game_0001.parquet"]
    everything = select_data_paths(paths, "")
    assert len(everything) == 12 and "dataset_infos.json" not in everything
    with pytest.raises(NoMatchingFilesError) as error:
        select_dataset_files(remote(paths), "chess_game_9*.parquet", DEFAULT_DATASET)
    assert "matches 'chess_game_9*.parquet'" in str(error.value)
    assert "chess_game_0001.parquet" in str(error.value)


def test_git_blob_id_is_what_git_computes(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "llama"}\n' * 100)
    git = subprocess.run(
        ["git", "hash-object", str(path)], capture_output=True, text=True, check=True
    )
    assert digest_file(path, git_blob_id=True).git_blob_id == git.stdout.strip()


def make_entry(
    repo_id: str = "org/data",
    commit: str = "a" * 40,
    files: tuple[str, ...] = ("s1.parquet",),
    revision: str = "main",
    repo_type: str = "dataset",
) -> ManifestEntry:
    return ManifestEntry(
        repo_id=repo_id,
        repo_type=repo_type,
        revision=revision,
        commit=commit,
        files=tuple(FileRecord(p, 1, "0" * 64) for p in files),
        repo_files=("s1.parquet", "s2.parquet", "s3.parquet"),
        endpoint="https://huggingface.co",
        downloaded_at="2025-01-01T00:00:00+00:00",
    )


def test_manifest_accumulates_files_per_commit_and_repins_when_a_branch_moves(
    tmp_path: Path,
) -> None:
    record_entry(tmp_path, make_entry(files=("s1.parquet",)))
    merged = record_entry(tmp_path, make_entry(files=("s2.parquet",)))
    assert [f.path for f in merged.files] == ["s1.parquet", "s2.parquet"]
    moved = record_entry(tmp_path, make_entry(commit="b" * 40, files=("s3.parquet",)))
    assert [f.path for f in moved.files] == ["s3.parquet"]
    assert load_manifest(tmp_path) == [moved]
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_concurrent_writers_do_not_lose_entries(tmp_path: Path) -> None:
    threads = [
        threading.Thread(target=record_entry, args=(tmp_path, make_entry(repo_id=f"org/d{i}")))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(e.repo_id for e in load_manifest(tmp_path)) == [f"org/d{i}" for i in range(8)]


def test_unreadable_manifest_names_the_file_and_the_fix(tmp_path: Path) -> None:
    manifest_path(tmp_path).write_text('{"format": 1, "assets": [{"repo_id": ')
    with pytest.raises(
        ValueError, match=r"offline-manifest\.json is unreadable.*download_models\.py"
    ):
        load_manifest(tmp_path)


def test_revision_lookup() -> None:
    main_entry = make_entry(revision="main", commit="1" * 40)
    tag = make_entry(revision="v1.0", commit="abcdef1" + "0" * 33)
    assert find_entry([tag, main_entry], "dataset", "org/data", None) is main_entry
    assert find_entry([tag], "dataset", "org/data", None) is tag  # the only one cached
    assert find_entry([tag, make_entry(revision="v2")], "dataset", "org/data", None) is None
    assert find_entry([tag, main_entry], "dataset", "org/data", "abcdef1") is tag
    assert find_entry([tag, main_entry], "dataset", "org/data", "abcdef") is None  # too short
    assert find_entry([tag], "model", "org/data", "v1.0") is None  # another repo type


def test_download_command_is_exact_and_pasteable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    command = download_command(dataset=DEFAULT_DATASET, include="chess_game_000[1-2].parquet")
    assert shlex.split(command) == [
        "python",
        "download_models.py",
        "--dataset",
        DEFAULT_DATASET,
        "--dataset-include",
        "chess_game_000[1-2].parquet",
    ]
    # No globs = all files; for the default dataset the command line must say so.
    assert shlex.split(download_command(dataset=DEFAULT_DATASET))[-2:] == ["--dataset-include", ""]
    assert "--dataset-include" not in download_command(dataset="org/other")
    monkeypatch.setenv("HF_HOME", "/projects/me/hf")  # not the built-in default: spelled out
    assert download_command(model=DEFAULT_MODEL, revision="v1").endswith(
        "--revision v1 --cache-dir /projects/me/hf/hub"
    )


CACHE_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


@pytest.mark.parametrize(
    "env",
    [{}, {"XDG_CACHE_HOME": "/xdg"}, {"HF_HOME": "/hf"}, {"HF_HOME": "/hf", "HF_HUB_CACHE": "/hc"}],
)
def test_cache_folder_is_the_one_huggingface_hub_uses(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES} | env
    theirs = subprocess.run(
        [
            sys.executable,
            "-c",
            "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)",
        ],
        env=clean,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hub_cache_dir() == Path(theirs)
    assert (hub_cache_dir() == BUILTIN_CACHE_DIR) == (not env)


def test_assets_file_and_training_config(tmp_path: Path) -> None:
    assets = tmp_path / "assets.yaml"
    assets.write_text(
        "cache_dir: /projects/me/hub\n"
        "assets:\n"
        f"  - model: {DEFAULT_MODEL}\n    revision: v1\n"
        f"  - dataset: {DEFAULT_DATASET}\n"
        "  - dataset: org/other\n    include: '*.jsonl'\n"
    )
    loaded = load_assets_file(assets)
    assert loaded.cache_dir == "/projects/me/hub" and loaded.train_config is None
    assert loaded.specs == [
        AssetSpec(DEFAULT_MODEL, "model", "v1"),
        AssetSpec(DEFAULT_DATASET, "dataset", None, DEFAULT_DATASET_INCLUDE),
        AssetSpec("org/other", "dataset", None, "*.jsonl"),
    ]
    train = tmp_path / "train.json"
    local_model = tmp_path / "my-model"
    local_model.mkdir()
    train.write_text(
        json.dumps({"model": str(local_model), "dataset_include": "", "cache_dir": "/c"})
    )
    loaded = load_assets_file(train)
    assert loaded.specs == [
        AssetSpec(DEFAULT_DATASET, "dataset", None, None)
    ]  # local model skipped
    assert loaded.train_config is not None and loaded.cache_dir == "/c"

    assets.write_text("assets:\n  - model: a/b\n    revison: main\n")
    with pytest.raises(ValueError, match="unknown key 'revison' \\(did you mean 'revision'\\?\\)"):
        load_assets_file(assets)


def test_free_space_check_names_the_bytes(tmp_path: Path) -> None:
    check_free_space(tmp_path, 0, what="nothing", fix="-")
    too_much = free_bytes(tmp_path) + 1
    with pytest.raises(InsufficientDiskSpaceError) as error:
        check_free_space(
            tmp_path / "not" / "yet", too_much, what="3 files", fix="python x --cache-dir y"
        )
    assert "3 files need" in str(error.value) and f"({too_much} bytes)" in str(error.value)
    assert not (tmp_path / "not").exists()


def test_partial_downloads_are_removed_only_when_no_download_holds_them(tmp_path: Path) -> None:
    blobs = tmp_path / "models--org--m" / "blobs"
    blobs.mkdir(parents=True)
    partial = blobs / f"{'e' * 64}.1a2b3c4d.incomplete"
    partial.write_bytes(b"x" * 100)
    lock = tmp_path / ".locks" / "models--org--m" / f"{'e' * 64}.lock"
    lock.parent.mkdir(parents=True)
    with lock.open("w") as held:  # a running download holds the blob's lock
        fcntl.flock(held, fcntl.LOCK_EX)
        assert remove_partial_downloads(tmp_path, "org/m", "model") == (0, 0)
        assert partial.exists()
    assert remove_partial_downloads(tmp_path, "org/m", "model") == (1, 100)
    assert not partial.exists()


def fake_download(
    cache: Path,
    files: dict[str, bytes],
    repo_id: str = "org/data",
    others: tuple[str, ...] = ("b[1].parquet",),
) -> ManifestEntry:
    """A cache entry as the downloader leaves it (snapshot files + manifest), made offline;
    `others`: files of the repo that were not downloaded."""
    import hashlib

    commit = "c" * 40
    snapshot = snapshot_dir(cache, repo_id, "dataset", commit)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    entry = ManifestEntry(
        repo_id=repo_id,
        repo_type="dataset",
        revision="main",
        commit=commit,
        files=tuple(FileRecord(n, len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items()),
        repo_files=(*files, *others),
        endpoint="https://huggingface.co",
        downloaded_at="2025-01-01T00:00:00+00:00",
    )
    return record_entry(cache, entry)


def test_verify_lists_each_problem_and_a_repair_command(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    entry = fake_download(
        cache, {"a.parquet": b"A" * 10, "b.parquet": b"B" * 10, "c.parquet": b"C"}
    )
    snapshot = entry.snapshot(cache)
    (snapshot / "a.parquet").write_bytes(b"A" * 9 + b"X")
    (snapshot / "c.parquet").unlink()
    (report,) = verify_cache(cache)
    assert not report.ok and report.checked == 2
    assert dict(report.problems).keys() == {"a.parquet", "c.parquet"}
    assert "corrupt: sha256" in dict(report.problems)["a.parquet"]
    words = shlex.split(report.repair)
    assert words[words.index("--dataset-include") + 1] == "a.parquet,c.parquet"
    assert spec_of(entry).include == "a.parquet,b.parquet,c.parquet"
    (asked,) = verify_cache(cache, [AssetSpec("org/data", "dataset", None, "b[[]1].parquet")])
    assert dict(asked.problems) == {"b[1].parquet": "never downloaded"}


def test_compute_side_resolution_from_the_manifest(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    with pytest.raises(MissingAssetError) as error:
        resolve_dataset_files("org/data", "a.parquet", cache_dir=str(cache))
    assert str(error.value).splitlines()[-1].strip() == (
        f"python download_models.py --dataset org/data --dataset-include a.parquet --cache-dir {cache}"
    )
    fake_download(cache, {"a.parquet": b"A", "b.parquet": b"B"})
    files = resolve_dataset_files("org/data", "a.parquet", cache_dir=str(cache))
    assert [f.read_bytes() for f in files] == [b"A"]
    # Without globs: what was downloaded; with '': every data file, one of them missing.
    assert [f.name for f in resolve_dataset_files("org/data", None, cache_dir=str(cache))] == [
        "a.parquet",
        "b.parquet",
    ]
    with pytest.raises(MissingAssetError, match=r"not in the offline cache: b\[1\]\.parquet"):
        resolve_dataset_files("org/data", "", cache_dir=str(cache))
    with pytest.raises(ValueError, match=r"No file of dataset org/data .* matches 'z\*'"):
        resolve_dataset_files("org/data", "z*", cache_dir=str(cache))
    (files[0]).unlink()
    with pytest.raises(MissingAssetError, match=r"1 file\(s\) of dataset org/data"):
        resolve_dataset_files("org/data", "a.parquet", cache_dir=str(cache))

    # A model put there by another tool: found, but not trusted.
    (cache / "models--org--m" / "snapshots" / ("d" * 40)).mkdir(parents=True)
    with pytest.raises(MissingAssetError, match="neither pinned nor verified"):
        resolve_model_dir("org/m", cache_dir=str(cache))


def test_training_uses_the_files_that_were_downloaded(tmp_path: Path) -> None:
    """Four shards of the chess dataset fetched with --dataset-include: training without
    --dataset_include uses those four (not one, not all), and every message about a missing
    file names a command that fetches only what is missing."""
    from fsdp_utils.data.chess_files import shard_name
    from fsdp_utils.run.preflight import check_basics
    from fsdp_utils.synthetic import tiny_model_config

    cache, model = tmp_path / "hub", tmp_path / "model"
    tiny_model_config("llama", vocab_size=128).save_pretrained(model)
    config = TrainConfig(model=str(model), dataset=DEFAULT_DATASET, cache_dir=str(cache))

    with pytest.raises(MissingAssetError) as error:  # nothing downloaded: the default shard
        check_basics(config, world_size=2)
    assert error.value.args[0].splitlines()[-1].strip() == download_command(
        dataset=DEFAULT_DATASET, include=DEFAULT_DATASET_INCLUDE, cache_dir=str(cache)
    )

    shards = [shard_name(i) for i in range(1, 101)]  # the repo has many more than were fetched
    entry = fake_download(
        cache, {name: name.encode() for name in shards[:4]}, DEFAULT_DATASET, tuple(shards[4:])
    )
    files = resolve_dataset_files(DEFAULT_DATASET, None, cache_dir=str(cache))
    assert [f.name for f in files] == shards[:4]
    assert "data 4 file(s) (those download_models.py fetched" in check_basics(config, 2)
    assert "data 2 file(s) (--dataset_include" in check_basics(
        config.replace(dataset_include="chess_game_000[1-2].parquet"), 2
    )

    (entry.snapshot(cache) / shards[2]).unlink()  # a recorded shard went missing
    with pytest.raises(MissingAssetError) as error:
        check_basics(config, 2)
    assert error.value.args[0].splitlines()[-1].strip() == download_command(
        dataset=DEFAULT_DATASET, include=shards[2], cache_dir=str(cache)
    )
    with pytest.raises(MissingAssetError) as error:  # all of it, asked for explicitly
        check_basics(config.replace(dataset_include=""), 2)
    message = error.value.args[0]
    assert "97 file(s)" in message and "too much to fetch" in message
    assert message.splitlines()[-1].strip() == download_command(
        dataset=DEFAULT_DATASET, include=DEFAULT_DATASET_INCLUDE, cache_dir=str(cache)
    )


def test_the_trainer_logs_which_files_and_how_many_tokens(
    tmp_path: Path, tiny_assets: dict[str, Path]
) -> None:
    from fsdp_utils.data.prepare import prepare_dataset

    cache = tmp_path / "hub"
    shards = sorted(tiny_assets["data"].glob("*.parquet"))
    fake_download(cache, {p.name: p.read_bytes() for p in shards}, DEFAULT_DATASET, ())
    config = TrainConfig(
        model=str(tiny_assets["model"]),
        dataset=DEFAULT_DATASET,
        cache_dir=str(cache),
        data_cache_dir=str(tmp_path / "data"),
        max_seq_length=64,
    )
    for _ in range(2):  # prepared, then reused: the same lines
        lines: list[str] = []
        prepare_dataset(config, log=lines.append)
        used = next(line for line in lines if "file(s)" in line)
        assert all(p.name in used for p in shards) and "download_models.py fetched" in used
        assert any("train" in line and " tokens" in line for line in lines), lines


def test_local_paths_resolve_as_before(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(MissingAssetError, match=r"has no config\.json"):
        resolve_model_dir(str(model))
    (model / "config.json").write_text("{}")
    assert resolve_model_dir(str(model)) == model
    data = tmp_path / "data"
    data.mkdir()
    for name in ("chess_game_0001.parquet", "chess_game_0002.parquet", "notes.txt"):
        (data / name).write_bytes(b"")
    assert [f.name for f in resolve_dataset_files(str(data), "chess_game_0002.parquet")] == [
        "chess_game_0002.parquet"
    ]
    assert len(resolve_dataset_files(str(data))) == 2


def test_the_log_says_local_files_are_the_ones_given(tmp_path: Path) -> None:
    """Issue 48: a local file was described as one `download_models.py fetched`."""
    from fsdp_utils.hub.resolve import describe_dataset_files

    (tmp_path / "chat.jsonl").write_text("{}\n")
    one = str(tmp_path / "chat.jsonl")
    assert describe_dataset_files(resolve_dataset_files(one), None, one) == (
        "1 file(s) (the file(s) given): chat.jsonl"
    )
    folder = str(tmp_path)
    assert "(every data file of the folder(s) given; --dataset_include to choose)" in (
        describe_dataset_files(resolve_dataset_files(folder), None, folder)
    )


def test_a_missing_path_is_no_such_file_with_the_names_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 48: a path that is not there was read as a hub id and answered with a download
    command for `data/chat.jsonl`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("chats.jsonl", "prefs.jsonl"):
        (tmp_path / "data" / name).write_text("{}\n")
    (tmp_path / "runs" / "chat-sft").mkdir(parents=True)
    cache = str(tmp_path / "hub")
    for missing, flag, near in (
        ("data/chat.jsonl", "--dataset", "chats.jsonl"),
        ("./data/chat.jsonl", "--dataset", "chats.jsonl"),
        ("dat/chat.jsonl", "--dataset", "data"),  # the first missing part is the folder
    ):
        with pytest.raises(MissingAssetError) as error:
            resolve_dataset_files(missing, cache_dir=cache)
        text = str(error.value)
        assert text.startswith(f"{flag} {missing}: no such file or folder"), text
        assert f"closest names are: {near}" in text and "download_models.py" not in text
    with pytest.raises(MissingAssetError, match=r"closest names are: chat-sft\b"):
        resolve_model_dir("runs/chat-sft-m/final", cache_dir=cache)
    # A hub id (org/name, nothing of it here) is still something to download.
    with pytest.raises(MissingAssetError, match=r"python download_models\.py --dataset org/d"):
        resolve_dataset_files("org/d", cache_dir=cache)
    # ... and the login node's command says the same of the path.
    assert main(["--dataset", "data/chat.jsonl", "--cache-dir", cache]) == 2
    assert "no such file or folder. In data/ the closest" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--revision", "v1"], "--revision is the model's revision: give --model too."),
        (["--dataset-include", "*.parquet"], "need --dataset"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--model", "."], "is a local path: there is nothing to download"),
        (["--verify", "--prepare"], "do not download"),
        (["--model", "a/b", "--prepare"], "--prepare needs exactly one dataset"),
    ],
)
def test_command_line_mistakes(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_verify_with_nothing_downloaded_says_what_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--verify", "--cache-dir", str(tmp_path)]) == 2
    assert "Nothing to verify" in capsys.readouterr().err
