"""A real Hugging Face-compatible server on loopback for the downloader's tests.

`olah` (an HF mirror server, PyPI package) runs in offline mode with `mirrors-path`, serving
git repositories that this module creates the way the Hub stores them: small files in git,
weights and parquet shards as Git LFS pointers (sha256 + size) with the content in
`.git/lfs/objects/`. The repos use the real default ids, so `python download_models.py` with no
arguments runs unchanged against it:

    models/codellama/CodeLlama-7b-hf      tiny 2-layer Llama + chess tokenizer (tiny_assets),
                                          plus a .bin copy and original/ weights (never to be
                                          fetched); tag v1.0 = first commit, main = second
    datasets/laion/strategic_game_chess   4 parquet shards in the laion schema
    models/meta-llama/Llama-2-7b-hf       the tiny model again; gated by `HubProxy`
    models/mistralai/Mistral-7B-v0.3      the tiny model in shards with their index, and a
                                          consolidated.safetensors copy beside them (as
                                          Mistral ships it: never to be fetched)
    datasets/allenai/ai2_arc, ...         small benchmark datasets (tests/lm_eval_data.py)

`HubProxy` is a small HTTP proxy in front of olah that can require a token for gated repos
(answering like the Hub: 401 with `X-Error-Code: GatedRepo`) and throttle bandwidth, so that a
download can be killed mid-transfer deterministically.

Use the `hub_mirror` fixture (session scope: the server starts once) by importing
`hub_mirror_fixture` into the test module.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

MODEL_ID = "codellama/CodeLlama-7b-hf"
DATASET_ID = "laion/strategic_game_chess"
GATED_ID = "meta-llama/Llama-2-7b-hf"
SHARDED_ID = "mistralai/Mistral-7B-v0.3"
NUM_SHARDS = 4
LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".parquet")
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@example.com",
}


@dataclass
class MirrorRepo:
    """A repo as served: its files' bytes at `main` and the commit of each ref."""

    repo_id: str
    repo_type: str
    path: Path
    files: dict[str, bytes] = field(default_factory=dict)
    commits: dict[str, str] = field(default_factory=dict)  # ref name -> commit

    def sha256(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()


@dataclass
class HubMirror:
    endpoint: str  # olah, e.g. http://127.0.0.1:40123
    root: Path
    repos: dict[str, MirrorRepo]
    process: subprocess.Popen[bytes]

    def env(self, home: Path, endpoint: str | None = None, **extra: str) -> dict[str, str]:
        """Environment for a download_models.py subprocess: online, this mirror, a private
        HF_HOME (no token from ~/.cache), no progress bars."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
        env |= {
            "HF_ENDPOINT": endpoint or self.endpoint,
            "HF_HOME": str(home),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        return env | extra


# --- git repos with LFS pointers -------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", *args], cwd=repo, env=os.environ | _GIT_ENV, check=True, capture_output=True
    )
    return out.stdout.decode().strip()


def _write_lfs(repo: Path, rel: str, data: bytes) -> None:
    """Store `data` as git-lfs does: a pointer file in the tree, the content under .git/lfs."""
    oid = hashlib.sha256(data).hexdigest()
    obj = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
    obj.parent.mkdir(parents=True, exist_ok=True)
    obj.write_bytes(data)
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(data)}\n"
    (repo / rel).write_text(pointer)


def commit_files(repo: Path, files: dict[str, bytes], message: str) -> str:
    """Write `files` (LFS for weights and shards) and commit them. Returns the commit."""
    if not (repo / ".git").exists():
        repo.mkdir(parents=True, exist_ok=True)
        _git(repo, "init", "-q", "-b", "main")
    for rel, data in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(LFS_SUFFIXES):
            _write_lfs(repo, rel, data)
        else:
            (repo / rel).write_bytes(data)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _split_shards(data_dir: Path, num_shards: int) -> dict[str, bytes]:
    """Re-split the tiny_assets games into `num_shards` parquet files (laion names)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from fsdp_utils.data.chess_files import shard_name

    table = pa.concat_tables(pq.read_table(p) for p in sorted(data_dir.glob("*.parquet")))
    per_shard = -(-table.num_rows // num_shards)
    shards = {}
    for i in range(num_shards):
        buffer = io.BytesIO()
        pq.write_table(table.slice(i * per_shard, per_shard), buffer)
        shards[shard_name(i + 1)] = buffer.getvalue()
    return shards


def build_repos(root: Path, tiny_assets: dict[str, Path]) -> dict[str, MirrorRepo]:
    model_files = {p.name: p.read_bytes() for p in sorted(tiny_assets["model"].iterdir())}
    attributes = b"".join(
        f"*{s} filter=lfs diff=lfs merge=lfs -text\n".encode() for s in LFS_SUFFIXES
    )
    repos = {}

    model = MirrorRepo(MODEL_ID, "model", root / "models" / MODEL_ID)
    first = model_files | {
        ".gitattributes": attributes,
        "README.md": b"# tiny stand-in for CodeLlama-7b-hf\n",
        "LICENSE": b"test licence\n",
        # Copies the selection must skip: PyTorch weights, and original/ checkpoints.
        "pytorch_model.bin": b"\x80" + model_files["model.safetensors"][:4096],
        "original/consolidated.00.pth": os.urandom(2048),
    }
    model.commits["v1.0"] = commit_files(model.path, first, "v1.0")
    _git(model.path, "tag", "v1.0")
    second = {"README.md": b"# tiny stand-in for CodeLlama-7b-hf, revised\n"}
    model.commits["main"] = commit_files(model.path, second, "revise README")
    model.files = first | second
    repos[MODEL_ID] = model

    dataset = MirrorRepo(DATASET_ID, "dataset", root / "datasets" / DATASET_ID)
    dataset.files = _split_shards(tiny_assets["data"], NUM_SHARDS) | {
        ".gitattributes": attributes,
        "README.md": b"---\nlicense: cc-by-4.0\n---\n# random chess games\n",
    }
    dataset.commits["main"] = commit_files(dataset.path, dataset.files, "shards")
    repos[DATASET_ID] = dataset

    gated = MirrorRepo(GATED_ID, "model", root / "models" / GATED_ID)
    gated.files = model_files | {".gitattributes": attributes}
    gated.commits["main"] = commit_files(gated.path, gated.files, "gated")
    repos[GATED_ID] = gated

    sharded = MirrorRepo(SHARDED_ID, "model", root / "models" / SHARDED_ID)
    sharded.files = _sharded_weights(tiny_assets["model"]) | {
        name: data for name, data in model_files.items() if name != "model.safetensors"
    }
    sharded.files |= {
        ".gitattributes": attributes,
        "consolidated.safetensors": model_files["model.safetensors"],
    }
    sharded.commits["main"] = commit_files(sharded.path, sharded.files, "sharded")
    repos[SHARDED_ID] = sharded

    # Benchmark datasets for lm-eval's tasks (tests/lm_eval_data.py), under their real ids.
    from tests.lm_eval_data import build_task_repos

    for repo_id, files in build_task_repos().items():
        repo = MirrorRepo(repo_id, "dataset", root / "datasets" / repo_id)
        repo.files = files | {".gitattributes": attributes}
        repo.commits["main"] = commit_files(repo.path, repo.files, "benchmark data")
        repos[repo_id] = repo
    return repos


def _sharded_weights(model_dir: Path) -> dict[str, bytes]:
    """The model's weights in safetensors shards with their index, as save_pretrained writes
    a large model."""
    import json
    import tempfile

    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    half = sum(t.numel() * t.element_size() for t in state.values()) // 2 + 1
    with tempfile.TemporaryDirectory() as tmp:
        save_torch_state_dict(state, tmp, max_shard_size=half)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    index = json.loads(files["model.safetensors.index.json"])
    assert len(set(index["weight_map"].values())) > 1, "the tiny model was not split"
    return files


# --- servers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def start_olah(root: Path, port: int) -> subprocess.Popen[bytes]:
    config = root / "olah.toml"
    config.write_text(
        "[basic]\n"
        f'host = "127.0.0.1"\nport = {port}\n'
        f'repos-path = "{root / "olah-cache"}"\n'
        f'mirrors-path = ["{root / "mirrors"}"]\n'
        "[accessibility]\noffline = true\n"
    )
    olah = Path(sys.executable).with_name("olah-cli")
    log = (root / "olah.log").open("wb")
    return subprocess.Popen(
        [str(olah), "-c", str(config), "--log-path", str(root / "logs")],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=root,
    )


class HubProxy:
    """HTTP proxy in front of the mirror: gated repos and a bandwidth limit.

    Gated repos answer 401 `X-Error-Code: GatedRepo` unless the request carries
    `Authorization: Bearer <token>`, which is how the Hub tells huggingface_hub a token is
    missing. Responses are sent at `bytes_per_second` (None: full speed).
    """

    def __init__(
        self,
        upstream: str,
        *,
        gated: tuple[str, ...] = (),
        token: str | None = None,
        bytes_per_second: int | None = None,
    ) -> None:
        self.upstream = urlsplit(upstream)
        self.gated, self.token, self.rate = gated, token, bytes_per_second
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> HubProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._forward(send_body=False)

            def do_GET(self) -> None:
                self._forward(send_body=True)

            def _forward(self, send_body: bool) -> None:
                if any(repo in self.path for repo in proxy.gated):
                    expected = f"Bearer {proxy.token}"
                    if self.headers.get("Authorization") != expected:
                        self.send_response(401)
                        self.send_header("X-Error-Code", "GatedRepo")
                        self.send_header(
                            "X-Error-Message", "Access to this repo is restricted. Please log in."
                        )
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                connection = http.client.HTTPConnection(proxy.upstream.netloc, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                connection.request(self.command, self.path, headers=headers)
                response = connection.getresponse()
                body = response.read()
                connection.close()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() in ("transfer-encoding", "connection", "content-length"):
                        continue
                    if key.lower() == "location":
                        value = value.replace(
                            proxy.upstream.netloc, urlsplit(proxy.endpoint).netloc
                        )
                    self.send_header(key, value)
                length = response.getheader("content-length") if not send_body else None
                self.send_header("Content-Length", length or str(len(body)))
                self.end_headers()
                if send_body:
                    self._send_throttled(body)

            def _send_throttled(self, body: bytes) -> None:
                chunk = 8192
                for start in range(0, len(body), chunk):
                    try:
                        self.wfile.write(body[start : start + chunk])
                        self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        return  # the client was killed: that is the point of some tests
                    if proxy.rate:
                        time.sleep(chunk / proxy.rate)

        return Handler


@pytest.fixture(scope="session", name="hub_mirror")
def hub_mirror_fixture(
    tmp_path_factory: pytest.TempPathFactory, tiny_assets: dict[str, Path]
) -> Iterator[HubMirror]:
    """olah serving the test repos on loopback, started once per session."""
    root = tmp_path_factory.mktemp("hub_mirror")
    repos = build_repos(root / "mirrors", tiny_assets)
    port = free_port()
    process = start_olah(root, port)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{endpoint}/api/models/{MODEL_ID}/revision/main")
        yield HubMirror(endpoint=endpoint, root=root, repos=repos, process=process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(root / "olah-cache", ignore_errors=True)
