"""The start-up version check (fsdp_utils.versions): a dependency outside the range pyproject.toml
declares stops every command with one line naming it, the version found and the range, exit 2,
before any work.

The old versions are real distribution records, not a mocked check: `transformers-4.57.6.dist-info`
and `torch-2.6.0.dist-info` folders first on the command's path, which importlib.metadata finds
before the installed ones, beside `transformers` and `torch` packages that fail on import (as an old
transformers fails in the planner). A command that imported either before checking would end in
that package's traceback instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

from fsdp_utils import versions
from fsdp_utils.versions import (
    Found,
    declared_requirements,
    find_versions,
    floor_pins,
    untested_message,
)

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
OLD = {"transformers": "4.57.6", "torch": "2.6.0"}

# Every command a user types, with arguments that would start real work if the check let them by.
COMMANDS = {
    "chess_finetune.py": ["chess_finetune.py", "--plan"],
    "download_models.py": ["download_models.py"],
    "slurm/submit.py": ["slurm/submit.py", "--dry-run"],
    "python -m fsdp_utils.plan": ["-m", "fsdp_utils.plan"],
    "python -m fsdp_utils.chess_eval": ["-m", "fsdp_utils.chess_eval", "runs/none"],
    "python -m fsdp_utils.export": ["-m", "fsdp_utils.export", "runs/none", "out"],
    "python -m fsdp_utils.plot": ["-m", "fsdp_utils.plot", "runs/none"],
    "python -m fsdp_utils.demo": ["-m", "fsdp_utils.demo"],
    "python -m fsdp_utils.versions": ["-m", "fsdp_utils.versions", "--floors"],
}


def _declared(name: str) -> Requirement:
    return next(r for r in map(Requirement, PYPROJECT["dependencies"]) if r.name == name)


def _fake_distribution(folder: Path, name: str, version: str, *, importable: bool) -> Path:
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if not importable:
        package = folder / name
        package.mkdir()
        (package / "__init__.py").write_text(
            f"raise ImportError('{name} {version} imported before the version check')\n"
        )
    return folder


def _start(args: list[str], site: Path, **env: str) -> subprocess.Popen[str]:
    inherited = {k: v for k, v in os.environ.items() if k not in ("RANK", "PYTHONPATH")}
    environ = {**inherited, "PYTHONPATH": str(site), **env}
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_every_command_stops_at_start_on_an_old_version_with_one_line_and_exit_2(tmp_path):
    site = tmp_path / "site"
    for name, version in OLD.items():
        _fake_distribution(site, name, version, importable=False)
    error_file = tmp_path / "torchelastic_error.json"
    # All at once: each is a Python start-up and a metadata read, nothing more (if it is more,
    # the fake package's ImportError shows it).
    runs = {name: _start(args, site) for name, args in COMMANDS.items()}
    runs["chess_finetune.py under torchrun, rank 0"] = _start(
        COMMANDS["chess_finetune.py"],
        site,
        RANK="0",
        TORCHELASTIC_ERROR_FILE=str(error_file),
    )
    runs["chess_finetune.py under torchrun, rank 1"] = _start(
        COMMANDS["chess_finetune.py"], site, RANK="1"
    )
    for name, process in runs.items():
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, (name, stdout, stderr)
        assert stdout == "", (name, stdout)  # no work began: nothing printed
        lines = [line for line in stderr.splitlines() if line.strip()]
        if name.endswith("rank 1"):
            assert lines == [], (name, stderr)  # rank 0 reports; the others end quietly
            continue
        assert len(lines) == 1, (name, stderr)
        line = lines[0]
        assert line.startswith("error: "), (name, line)
        for package, version in OLD.items():
            specifier = _declared(package).specifier
            assert f"{package} {version} (tested: {package}{specifier})" in line, (name, line)
            assert f"'{package}{specifier}'" in line.split("pip install")[1], (name, line)
        assert "Traceback" not in stderr and "imported before" not in stderr, (name, stderr)
    # Under torchrun the agent's closing report shows the same line (its error file).
    reported = json.loads(error_file.read_text())["message"]["message"]
    assert f"transformers {OLD['transformers']}" in reported


def test_a_newer_version_passes_and_the_listing_shows_it(tmp_path):
    new = _fake_distribution(tmp_path / "new", "transformers", "99.0.0.dev0", importable=True)
    listing = _start(["-m", "fsdp_utils.versions"], new)
    stdout, stderr = listing.communicate(timeout=120)
    assert listing.returncode == 0, (stdout, stderr)
    rows = {line.split()[0]: line.split() for line in stdout.splitlines()}
    assert set(rows) == {r.name for r in map(Requirement, PYPROJECT["dependencies"])}
    # A nightly of a newer version is inside `>=floor`.
    specifier = str(_declared("transformers").specifier)
    assert rows["transformers"][1:] == ["99.0.0.dev0", specifier, "ok"]


def test_the_ranges_are_pyprojects_as_installed():
    # In a checkout the check reads pyproject.toml, with the test extras only when asked for.
    core = [str(Requirement(line)) for line in PYPROJECT["dependencies"]]
    assert [str(r) for r in declared_requirements()] == core
    with_test = {r.name for r in declared_requirements(["test"])}
    assert {Requirement(line).name for line in PYPROJECT["optional-dependencies"]["test"]} <= (
        with_test
    )
    assert "pytest" not in {r.name for r in declared_requirements()}


def test_a_checkout_reads_pyproject_before_a_stale_install(monkeypatch, tmp_path):
    # An editable install made before a dependency joined (torchao): pip's metadata lacks it.
    stale = [line for line in PYPROJECT["dependencies"] if not line.startswith("torchao")]
    monkeypatch.setattr(versions.importlib.metadata, "requires", lambda name: stale)
    core = [str(Requirement(line)) for line in PYPROJECT["dependencies"]]
    assert [str(r) for r in declared_requirements()] == core
    assert "torchao" in {r.name for r in declared_requirements()}
    assert "pytest" in {r.name for r in declared_requirements(["test"])}
    # Installed from a wheel (no pyproject.toml beside the package): pip's metadata is the list.
    monkeypatch.setattr(versions, "PYPROJECT", tmp_path / "pyproject.toml")
    assert [str(r) for r in declared_requirements()] == [str(Requirement(x)) for x in stale]


def test_versions_compare_as_pip_compares_them():
    torch = Requirement("torch>=2.13.0")
    assert Found(torch, "2.13.0+cpu").tested  # a local build of the floor itself
    assert Found(torch, "2.14.0.dev20260101").tested
    assert not Found(torch, "2.12.1").tested
    assert not Found(torch, None).tested
    assert not Found(torch, "unknown").tested
    found = find_versions(
        [torch, Requirement("peft>=0.19.0")],
        version_of={"torch": "2.6.0"}.get,
    )
    assert untested_message(found) == (
        "fsdp-utils is tested with other versions: torch 2.6.0 (tested: torch>=2.13.0), "
        "peft not installed (tested: peft>=0.19.0). "
        "Install tested versions: pip install 'torch>=2.13.0' 'peft>=0.19.0'"
    )


def test_floor_pins_are_the_lower_bounds():
    requirements = map(Requirement, ["a>=1.2", "b", "c<3,>=2.0.1", 'd>=4; python_version>"3"'])
    assert floor_pins(requirements) == ["a==1.2", "b", "c==2.0.1", "d==4"]


def _device_stack():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "device_stack", REPO / "bench" / "device_stack.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_stack"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_lent_gpus_stack_passes_with_the_carried_wheels():
    """The image's versions (torch 2.11.0+cu130, huggingface_hub 1.33.0, ...) with the carried
    wheels first on the path (transformers 5.21.0 over the image's 5.17.0) pass the check that
    every command runs at start; the image alone fails it on transformers, and only there."""
    from packaging.utils import canonicalize_name

    stack = _device_stack()
    image = {canonicalize_name(n): v for n, v in stack.IMAGE_VERSIONS.items()}
    image["torch"] += "+cu130"  # as torch.__version__ and its metadata say there
    carried = {canonicalize_name(c.name): c.version for c in stack.CARRIED}
    known = [r for r in declared_requirements() if canonicalize_name(r.name) in image | carried]
    assert {"torch", "transformers", "huggingface_hub", "datasets", "lm-eval"} <= {
        r.name for r in known
    }
    with_wheels = {**image, **carried}
    found = find_versions(known, version_of=lambda n: with_wheels.get(canonicalize_name(n)))
    assert [f.describe() for f in found if not f.tested] == []
    found = find_versions(known, version_of=lambda n: image.get(canonicalize_name(n)))
    # transformers 5.17.0 (MoE and GPT-NeoX weights missing), and what the image lacks.
    lacking = {r.name for r in known if canonicalize_name(r.name) not in image}
    assert {f.requirement.name for f in found if not f.tested} == {"transformers"} | lacking


def test_environment_yml_installs_the_tested_torch_from_the_cu126_index():
    """The torch a cluster's login node gets: the version `make test` tests (the Makefile's CPU
    pin), built for CUDA 12.6 (drivers >= 525), from the index that has it, inside the range."""
    import re

    text = (REPO / "environment.yml").read_text()
    pip_lines = [
        line.strip().removeprefix("- ").split("#")[0].strip() for line in text.splitlines()
    ]
    assert "--extra-index-url https://download.pytorch.org/whl/cu126" in pip_lines
    (pin,) = [line for line in pip_lines if line.startswith("torch==")]
    make_pin = re.search(r"^TORCH_PIN \?= torch==(\S+)", (REPO / "Makefile").read_text(), re.M)
    assert make_pin is not None
    assert pin == f"torch=={make_pin.group(1)}+cu126"
    assert Found(_declared("torch"), pin.removeprefix("torch==")).tested
    assert "drivers >= 525" in text and "drivers >= 580" in text
