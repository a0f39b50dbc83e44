"""The lent GPU machine's Python packages, and the wheels a device call carries to complete them.

The one list of both: what the machine's image holds (the device tool's KINDS.md, read on
2026-11-17) and what `bench/gpu_check.py` must bring along (CARRIED, one version of each).

    python bench/device_stack.py download                  # make device-wheels: .whl/ (cp312)
    python bench/device_stack.py check                     # .whl/ against CARRIED, size, needs
    python bench/device_stack.py download --python 3.11 --dest .whl-cp311   # for the dry run here
    python bench/device_stack.py standin .venv-device --wheels .whl-cp311   # the image's versions
    python bench/device_stack.py install --wheels .whl --target /tmp/site   # on the device

`install` (gpu_check.py --wheels calls it) puts a carried wheel in `--target` only where the
machine lacks the package, or has a version outside the range pyproject.toml declares
(transformers 5.17 there, 5.21 here); the rest of the image is used as it is. `check` fails on a
missing or extra wheel, a second version, a wheel for another Python or platform, a folder that
with the tree would pass the 64 MiB a device call carries, and a requirement of a carried wheel
that neither the image nor the folder provides.
"""

from __future__ import annotations

import argparse
import dataclasses
import email.parser
import importlib.metadata
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import NormalizedName, canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # on the device the checkout is not installed: run from it
    sys.path.insert(0, str(REPO))
MIB = 1024**2
CARRY_LIMIT = 64 * MIB  # the working tree and the carried paths of one device call, together
DEVICE_PYTHON = "3.12"  # Python 3.12.3 at /opt/torch/.venv/bin/python3 there

# What a session's `pip list` there showed (KINDS.md, 2026-11): the versions we depend on.
IMAGE_VERSIONS = {
    "torch": "2.11.0",
    "transformers": "5.17.0",
    "huggingface-hub": "1.33.0",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.2",
    "numpy": "2.5.2",
    "accelerate": "1.15.0",
    "triton": "3.6.0",
}
# The newest of those releases is huggingface_hub 1.33.0 (uploaded 2026-09-24): the stand-in
# environment takes the image's other packages as PyPI served them the day after.
IMAGE_BUILT = "2026-09-25T00:00:00Z"
# Every package the image holds (bench/device_image.txt: KINDS.md's list, copied exactly).
IMAGE_LIST = Path(__file__).resolve().parent / "device_image.txt"


def image_packages(path: Path = IMAGE_LIST) -> frozenset[str]:
    """The names in KINDS.md's comma-separated list (comment lines skipped), canonical."""
    text = " ".join(line for line in path.read_text().splitlines() if not line.startswith("#"))
    return frozenset(canonicalize_name(n.strip(" .")) for n in text.split(",") if n.strip(" ."))


IMAGE_PACKAGES = image_packages()


@dataclasses.dataclass(frozen=True)
class Carried:
    """A wheel a device call brings. `sdist`: PyPI has no wheel of it, so `download` builds one
    here (pure Python, py3-none-any)."""

    name: str
    version: str
    why: str
    sdist: bool = False

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


_LM_EVAL = "lm-eval's (python -m fsdp_utils.evaluate)"
CARRIED: tuple[Carried, ...] = (
    Carried(
        "transformers",
        "5.21.0",
        "the image's 5.17.0 loads the mixture-of-experts and GPT-NeoX checkpoints with weights "
        "missing (docs/development.md#tested-versions); 5.21.0 is our floor, tested with torch "
        "2.11 by make test-floor",
    ),
    Carried("peft", "0.21.2", "on the image at a version not read: used only if below 0.19"),
    Carried(
        "torchao",
        "0.18.0",
        "not on the image: QLoRA's NF4 base (--quantize nf4), and a core dependency the "
        "start-up check asks for; its wheel (cp310-abi3, 3.3 MB) needs nothing at run time, and "
        "its compiled extensions are not loaded (fsdp_utils/__init__.py)",
    ),
    Carried("datasets", "5.2.0", "not on the image (the data stage, lm-eval)"),
    Carried("dill", "0.4.1", "not on the image: datasets', evaluate's and lm-eval's"),
    Carried("multiprocess", "0.70.19", "not on the image: datasets' and evaluate's"),
    Carried("submitit", "1.5.4", "not on the image (the Slurm launcher, imported by the CLI)"),
    Carried(
        "chess",
        "1.10.0",
        "not on the image (the chess data and evaluation); our floor, tested by make test-floor: "
        "1.11.2, what make test runs, is published as source only",
    ),
    Carried("lm-eval", "0.4.13", "not on the image (python -m fsdp_utils.evaluate, pinned)"),
    Carried("evaluate", "0.4.6", f"not on the image: {_LM_EVAL}"),
    Carried("more-itertools", "11.2.1", f"not on the image: {_LM_EVAL}"),
    Carried("pytablewriter", "1.2.1", f"not on the image: {_LM_EVAL}"),
    Carried("dataproperty", "1.1.1", "not on the image: pytablewriter's"),
    Carried("mbstrdecoder", "1.1.5", "not on the image: pytablewriter's"),
    Carried("pathvalidate", "3.3.1", "not on the image: pytablewriter's"),
    Carried("tabledata", "1.3.5", "not on the image: pytablewriter's"),
    Carried("tcolorpy", "0.1.7", "not on the image: pytablewriter's"),
    Carried("typepy", "1.3.5", "not on the image: pytablewriter's"),
    Carried("chardet", "6.0.0.post1", "not on the image: mbstrdecoder's"),
    Carried("pytz", "2026.6", "not on the image: typepy[datetime]'s (pytablewriter asks for it)"),
    Carried("rouge-score", "0.1.2", f"not on the image: {_LM_EVAL}", sdist=True),
    Carried("sqlitedict", "2.1.0", f"not on the image: {_LM_EVAL}", sdist=True),
    Carried("word2number", "1.1", f"not on the image: {_LM_EVAL}", sdist=True),
    Carried("nltk", "3.10.4", "not on the image: lm-eval[ifeval]'s and rouge-score's"),
    Carried("defusedxml", "0.7.1", "not on the image: nltk's"),
    Carried("langdetect", "1.0.9", "not on the image: lm-eval[ifeval]'s", sdist=True),
    Carried("immutabledict", "4.3.1", "not on the image: lm-eval[ifeval]'s"),
    Carried(
        "liger-kernel",
        "0.8.5",
        "not on the image: --liger_kernels' Triton kernels (the kit's liger rows); a "
        "py3-none-any wheel (0.9 MB) whose torch and triton are the image's",
    ),
)
# Extras of carried packages whose requirements count (pyproject.toml asks for lm-eval[ifeval]).
CARRIED_EXTRAS = {"lm-eval": ("ifeval",)}


def carried_by_name() -> dict[str, Carried]:
    return {canonicalize_name(c.name): c for c in CARRIED}


def supported_tags(python: str) -> set[Tag]:
    """The wheel tags CPython `python` (e.g. "3.12") on manylinux x86_64 accepts."""
    version = tuple(int(p) for p in python.split("."))
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    platforms.append("linux_x86_64")
    return set(cpython_tags(version, platforms=platforms)) | set(
        compatible_tags(version, platforms=platforms)
    )


@dataclasses.dataclass(frozen=True)
class Wheel:
    path: Path
    name: NormalizedName
    version: Version
    tags: frozenset[Tag]


def read_folder(folder: Path) -> list[Wheel]:
    wheels = []
    for path in sorted(folder.glob("*.whl")):
        name, version, _build, tags = parse_wheel_filename(path.name)
        wheels.append(Wheel(path, canonicalize_name(name), version, frozenset(tags)))
    return wheels


def wheel_requirements(path: Path) -> list[Requirement]:
    """Requires-Dist of a wheel, read from its METADATA."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(archive.read(metadata).decode())
    return [Requirement(line) for line in message.get_all("Requires-Dist") or []]


def needed(requirement: Requirement, extras: Iterable[str], python: str) -> bool:
    """Whether a requirement applies on CPython `python` on Linux with these extras."""
    if requirement.marker is None:
        return True
    environment = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    marker: Marker = requirement.marker
    return any(marker.evaluate({**environment, "extra": e}) for e in ["", *extras])


def check_folder(folder: Path, python: str) -> list[str]:
    """What is wrong with `folder` as the carried wheels for CPython `python` ([] if nothing):
    each CARRIED wheel once at its version, built for that Python, nothing else, every
    requirement of theirs on the image or carried, and the whole within a device call's limit."""
    problems = []
    wheels = read_folder(folder)
    expected = carried_by_name()
    seen: dict[str, list[Wheel]] = {}
    for wheel in wheels:
        seen.setdefault(wheel.name, []).append(wheel)
    for name, carried in expected.items():
        found = seen.get(name, [])
        if not found:
            problems.append(f"missing: {carried.pin} (python bench/device_stack.py download)")
        elif len(found) > 1:
            names = ", ".join(w.path.name for w in found)
            problems.append(f"{name}: {len(found)} wheels ({names}); keep one")
        elif found[0].version != Version(carried.version):
            problems.append(f"{name}: {found[0].version} in the folder, {carried.version} listed")
    for name in sorted(set(seen) - set(expected)):
        problems.append(f"not listed in CARRIED: {', '.join(w.path.name for w in seen[name])}")
    accepted = supported_tags(python)
    for wheel in wheels:
        if not wheel.tags & accepted:
            problems.append(f"{wheel.path.name}: not installable on CPython {python} x86_64")
    problems += [f"unmet: {line}" for line in missing_requirements(wheels, python)]
    total = sum(w.path.stat().st_size for w in wheels) + tree_bytes()
    if total > CARRY_LIMIT:
        problems.append(
            f"the tree and the wheels take {total / MIB:.1f} MiB, over the {CARRY_LIMIT // MIB} MiB "
            "a device call carries"
        )
    return problems


def needed_extras(wheels: list[Wheel], python: str) -> dict[str, set[str]]:
    """The extras of each carried package that count: CARRIED_EXTRAS, and those the carried
    wheels ask of each other (pytablewriter requires typepy[datetime], whose extra needs pytz)."""
    extras: dict[str, set[str]] = {w.name: set(CARRIED_EXTRAS.get(w.name, ())) for w in wheels}
    changed = True
    while changed:
        changed = False
        for wheel in wheels:
            for requirement in wheel_requirements(wheel.path):
                name = canonicalize_name(requirement.name)
                wanted = set(requirement.extras)
                applies = name in extras and needed(requirement, extras[wheel.name], python)
                if applies and not wanted <= extras[name]:
                    extras[name] |= wanted
                    changed = True
    return extras


def needed_requirements(wheels: list[Wheel], python: str) -> list[tuple[str, Requirement]]:
    """(carried package, requirement) for every requirement that applies to a carried wheel."""
    extras = needed_extras(wheels, python)
    return [
        (wheel.name, requirement)
        for wheel in wheels
        for requirement in wheel_requirements(wheel.path)
        if needed(requirement, extras[wheel.name], python)
    ]


def missing_requirements(wheels: list[Wheel], python: str) -> list[str]:
    """Requirements of the carried wheels that neither the image nor the folder provides."""
    provided = IMAGE_PACKAGES | {w.name for w in wheels}
    return sorted(
        {
            f"{name} needs {requirement.name} (on neither list)"
            for name, requirement in needed_requirements(wheels, python)
            if canonicalize_name(requirement.name) not in provided
        }
    )


def tree_bytes() -> int:
    """What a device call sends of this checkout: tracked files and untracked ones git does not
    ignore."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    paths = (REPO / p for p in listing.decode().split("\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file())


def describe(folder: Path) -> str:
    """One line per wheel (size, name) and the total, for the docs and the log."""
    wheels = read_folder(folder)
    lines = [f"{w.path.stat().st_size / MIB:7.2f} MiB  {w.path.name}" for w in wheels]
    total = sum(w.path.stat().st_size for w in wheels)
    lines.append(f"{total / MIB:7.2f} MiB  {len(wheels)} wheels")
    return "\n".join(lines)


def _pip(python: str) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
        "--python-version", python, "--implementation", "cp",
        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
        "--platform", "manylinux2014_x86_64",
    ]  # fmt: skip


def download(dest: Path, python: str) -> None:
    """Every CARRIED wheel for CPython `python` into `dest` (what is there already stays)."""
    dest.mkdir(parents=True, exist_ok=True)
    have = {(w.name, w.version) for w in read_folder(dest)}
    for carried in CARRIED:
        if (canonicalize_name(carried.name), Version(carried.version)) in have:
            continue
        if carried.sdist:
            command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", carried.pin]
            subprocess.run([*command, "-w", str(dest)], check=True)
        else:
            subprocess.run([*_pip(python), "-d", str(dest), carried.pin], check=True)


def choose(wheels: list[Wheel]) -> list[tuple[Wheel, str]]:
    """Which carried wheels this Python lacks, each with the reason: not installed, or installed
    at a version outside the range pyproject.toml declares."""
    from fsdp_utils.versions import declared_requirements

    declared = {canonicalize_name(r.name): r for r in declared_requirements()}
    chosen = []
    for wheel in wheels:
        try:
            have = importlib.metadata.version(wheel.name)
        except importlib.metadata.PackageNotFoundError:
            chosen.append((wheel, "not installed"))
            continue
        requirement = declared.get(wheel.name)
        if requirement is not None and not requirement.specifier.contains(
            Version(have), prereleases=True
        ):
            chosen.append((wheel, f"{have} installed, {requirement} declared"))
    return chosen


def install(folder: Path, target: Path) -> list[str]:
    """Install into `target` the carried wheels this Python lacks (`choose`), with no index and no
    dependencies; returns one line per decision for the log. Put `target` first on PYTHONPATH
    afterwards."""
    problems = check_folder(folder, f"{sys.version_info.major}.{sys.version_info.minor}")
    # The size limit only matters when the folder travels; here it already has.
    problems = [p for p in problems if "MiB" not in p]
    if problems:
        raise SystemExit("device wheels: " + "; ".join(problems))
    wheels = read_folder(folder)
    chosen = choose(wheels)
    lines = [f"install {w.path.name}: {why}" for w, why in chosen]
    taken = {w.name for w, _ in chosen}
    for wheel in wheels:
        if wheel.name not in taken:
            lines.append(f"keep the image's {wheel.name} {importlib.metadata.version(wheel.name)}")
    if chosen:
        target.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        command += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target)]
        subprocess.run([*command, *(str(w.path) for w, _ in chosen)], check=True)
    return lines


def standin(venv: Path, folder: Path) -> list[str]:
    """A virtual environment at the image's versions, for the CPU dry run: IMAGE_VERSIONS (or,
    where a release has no build for this Python, the newest before it that has: numpy 2.5 needs
    3.12), and every other package of the image that our dependencies or the carried wheels
    (`folder`) need, as PyPI served it when the image was built (IMAGE_BUILT). Not the project:
    the device runs it from its checkout too. Returns the differences from the image."""
    from fsdp_utils.versions import declared_requirements

    wheels = read_folder(folder)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    names = {canonicalize_name(r.name) for _, r in needed_requirements(wheels, python)}
    names |= {canonicalize_name(r.name) for r in declared_requirements()} | {w.name for w in wheels}
    # The image's own copy of a package we also carry (peft) too: `install` decides between them.
    names = (names & IMAGE_PACKAGES) - set(IMAGE_VERSIONS)
    pins = [f"{n}<={v}" for n, v in IMAGE_VERSIONS.items()] + sorted(names)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python_bin = str(venv / "bin" / "python")
    pip = [python_bin, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "--uploaded-prior-to", IMAGE_BUILT, *pins], check=True)
    listing = subprocess.run(
        [python_bin, "-m", "pip", "list", "--format=json"], capture_output=True, text=True
    ).stdout
    found: dict[str, str] = {
        canonicalize_name(p["name"]): p["version"] for p in json.loads(listing)
    }
    return [
        f"{name} {found.get(name)} here, {version} on the image (Python {python})"
        for name, version in IMAGE_VERSIONS.items()
        if found.get(name) != version
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("download", "check"):
        command = commands.add_parser(name)
        command.add_argument("--dest", type=Path, default=REPO / ".whl")
        command.add_argument("--python", default=DEVICE_PYTHON)
    command = commands.add_parser("install")
    command.add_argument("--wheels", type=Path, required=True)
    command.add_argument("--target", type=Path, required=True)
    command = commands.add_parser("standin")
    command.add_argument("venv", type=Path)
    command.add_argument("--wheels", type=Path, required=True, help="this Python's carried wheels")
    args = parser.parse_args(argv)
    if args.command == "download":
        download(args.dest, args.python)
    if args.command in ("download", "check"):
        problems = check_folder(args.dest, args.python)
        print(describe(args.dest))
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if args.command == "install":
        print("\n".join(install(args.wheels, args.target)))
        return 0
    for line in standin(args.venv, args.wheels):
        print(f"stand-in: {line}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    raise SystemExit(main())
