"""`download_models.py --check-offline`: prove that a compute node can load everything.

A child process starts with every Hugging Face offline variable set before any Hugging Face
import and, where the kernel allows it (`unshare --net`, as root or with user namespaces), in a
network namespace with no interfaces at all. It resolves each asset the way the trainer does
(`fsdp_utils.hub.resolve`, through the manifest), loads each model's config and tokenizer, opens
each safetensors file's header (which also catches truncation) and each dataset shard.

Run it on a compute node too (`srun ... python download_models.py --check-offline`): that is
the machine whose filesystem view matters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.hub.offline import OFFLINE_VARIABLES, enable_offline_mode
from fsdp_utils.hub.specs import AssetSpec


def isolation_prefix() -> tuple[list[str], str]:
    """A command prefix that removes the network, and how the check will run."""
    unshare = shutil.which("unshare")
    if unshare:
        # As root a network namespace alone works; otherwise it needs a user namespace.
        for extra in ([], ["--map-root-user"]):
            prefix = [unshare, "--net", *extra]
            probe = subprocess.run([*prefix, "true"], capture_output=True, check=False)
            if probe.returncode == 0:
                return prefix, "no network at all (unshare --net) and HF offline variables set"
    return [], "HF offline variables set; the network is still up (unshare --net not permitted)"


def run_offline_check(
    cache_dir: Path, specs: Sequence[AssetSpec] | None, log: Callable[[str], None] = print
) -> int:
    """Run the check in an isolated child process. Returns its exit code (0: all loaded)."""
    args = ["--cache-dir", str(cache_dir)]
    if specs is not None:
        args += ["--assets", json.dumps([asdict(s) for s in specs])]
    return run_isolated("fsdp_utils.hub.offline_check", args, what="offline check", log=log)


def run_isolated(module: str, args: list[str], *, what: str, log: Callable[[str], None]) -> int:
    """`python -m module args` in a child process with no network (`isolation_prefix`) and
    the Hugging Face offline variables set; its exit code. `what` heads the log line."""
    prefix, how = isolation_prefix()
    log(f"{what}: {how}")
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ) | OFFLINE_VARIABLES
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    command = [*prefix, sys.executable, "-m", module, *args]
    return subprocess.run(command, env=env, check=False).returncode


def check_model(spec: AssetSpec, cache_dir: Path) -> str:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    from fsdp_utils.hub.resolve import resolve_model_dir

    path = resolve_model_dir(spec.repo_id, spec.revision, str(cache_dir))
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    weight_files = sorted(path.glob("*.safetensors"))
    parameters = 0
    for weights in weight_files:
        # Reads only the header; raises on a truncated file ("file not fully covered").
        with safe_open(str(weights), framework="np") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                numel = 1
                for dim in handle.get_slice(name).get_shape():
                    numel *= dim
                parameters += numel
    return (
        f"{spec}: {config.model_type}, tokenizer with {len(tokenizer)} tokens, "
        f"{parameters:,} parameters in {len(weight_files)} safetensors file(s)"
    )


def check_dataset(spec: AssetSpec, cache_dir: Path) -> str:
    import pyarrow.parquet as pq

    from fsdp_utils.hub.resolve import resolve_dataset_files

    # The spec's include as the downloader reads it: none means every data file.
    include = spec.include or ""
    files = resolve_dataset_files(spec.repo_id, include, spec.revision, str(cache_dir))
    rows = 0
    for path in files:
        if path.suffix == ".parquet":
            rows += pq.ParquetFile(path).metadata.num_rows  # reads the footer: catches truncation
        elif path.suffix in (".jsonl", ".json"):
            with path.open() as f:
                json.loads(f.readline())  # jsonl: the first record parses
                rows += 1 + sum(1 for _ in f)
    return f"{spec}: {len(files)} file(s), {rows} rows"


def _specs(cache_dir: Path, assets_json: str | None) -> list[AssetSpec]:
    if assets_json:
        return [AssetSpec(**item) for item in json.loads(assets_json)]
    from fsdp_utils.hub.manifest import load_manifest, manifest_path
    from fsdp_utils.hub.verify import spec_of

    entries = load_manifest(cache_dir)
    if not entries:
        raise ValueError(
            f"Nothing to check: {manifest_path(cache_dir)} does not exist. On the login node "
            "run: python download_models.py"
        )
    return [spec_of(e) for e in entries]


def main(argv: list[str] | None = None) -> int:
    late = enable_offline_mode(force=True)
    assert not late, f"imported before offline mode: {late}"
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--assets", help="JSON list of AssetSpec fields (default: the manifest)")
    args = parser.parse_args(argv)
    cache_dir = Path(args.cache_dir)
    try:
        specs = _specs(cache_dir, args.assets)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    failures = 0
    for spec in specs:
        check = check_model if spec.repo_type == "model" else check_dataset
        try:
            print(f"OK   {check(spec, cache_dir)}", flush=True)
        except Exception as error:  # report every asset, not just the first failure
            failures += 1
            print(f"FAIL {spec}: {type(error).__name__}: {error}", flush=True)
    verdict = "OK" if not failures else f"FAILED for {failures} of {len(specs)} asset(s)"
    print(f"offline check {verdict} (cache {cache_dir})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
