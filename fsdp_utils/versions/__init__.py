"""The versions we declare are the versions we test: a dependency outside the range that
pyproject.toml declares stops a command at its start, with one line naming the package, the
version found and the range, and exit code 2, before anything imports torch or transformers.

    python -m fsdp_utils.versions                # each dependency: version found, declared range
    python -m fsdp_utils.versions --floors test  # `name==floor` lines (`make test-floor` installs them)

The ranges have one home, `[project] dependencies` in pyproject.toml: read from it when the code
runs from a checkout (installed editable or not), else from the installed distribution's metadata
(which pip wrote from it). See docs/development.md#tested-versions.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.error_report import EXIT_USAGE, PEER_EXIT_DELAY_S, report_error

DISTRIBUTION = "fsdp-utils"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def declared_requirements(extras: Iterable[str] = ()) -> list[Requirement]:
    """The dependencies pyproject.toml declares: the core ones, and those of `extras`."""
    if PYPROJECT.is_file():
        # A checkout (an editable install, or PYTHONPATH): its pyproject.toml is newer than the
        # metadata pip wrote at install time, which after a `git pull` can lack a dependency
        # added since (torchao, 2026-11-26): the check must name it, not a ModuleNotFoundError.
        lines = _pyproject_requirements()
    else:
        try:
            lines = importlib.metadata.requires(DISTRIBUTION) or []
        except importlib.metadata.PackageNotFoundError:
            lines = []
    wanted = ["", *extras]
    requirements = [Requirement(line) for line in lines]
    return [
        r
        for r in requirements
        if r.marker is None or any(r.marker.evaluate({"extra": extra}) for extra in wanted)
    ]


def _pyproject_requirements() -> list[str]:
    # Python 3.10 has no tomllib: there the check has nothing to read and lets the command go on.
    try:
        import tomllib
    except ImportError:
        return []
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lines = list(project.get("dependencies", []))
    for extra, deps in project.get("optional-dependencies", {}).items():
        for dep in deps:  # as pip writes an extra's requirement into the metadata
            requirement, _, marker = dep.partition(";")
            condition = f'extra == "{extra}"'
            lines.append(
                f"{requirement}; ({marker.strip()}) and {condition}"
                if marker.strip()
                else f"{requirement}; {condition}"
            )
    return lines


@dataclass(frozen=True)
class Found:
    requirement: Requirement
    version: str | None  # None: not installed

    @property
    def tested(self) -> bool:
        if self.version is None:
            return False
        try:
            version = Version(self.version)
        except InvalidVersion:
            return False
        # A nightly or release candidate of a newer version is inside `>=floor` too.
        return self.requirement.specifier.contains(version, prereleases=True)

    def describe(self) -> str:
        name, found = self.requirement.name, self.version or "not installed"
        return f"{name} {found} (tested: {name}{self.requirement.specifier})"


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def find_versions(
    requirements: Iterable[Requirement],
    *,
    version_of: Callable[[str], str | None] = installed_version,
) -> list[Found]:
    return [Found(r, version_of(r.name)) for r in requirements]


def untested_message(untested: list[Found]) -> str:
    """One line: each package outside its range, with the version found and the range, then the
    command that installs tested versions."""
    upgrade = " ".join(f"'{f.requirement.name}{f.requirement.specifier}'" for f in untested)
    return (
        f"{DISTRIBUTION} is tested with other versions: {', '.join(f.describe() for f in untested)}."
        f" Install tested versions: pip install {upgrade}"
    )


def exit_if_untested() -> None:
    """Every command calls this first: exit 2 when a core dependency is outside its declared range.

    Under torchrun every rank finds the same versions: rank 0 reports, the others end quietly
    after it, so that its message is the last thing in the job's log.
    """
    untested = [f for f in find_versions(declared_requirements()) if not f.tested]
    if not untested:
        return
    rank_0 = int(os.environ.get("RANK", "0")) == 0
    # Every rank carries the message into its torchrun error file: the closing report names
    # whichever rank exits first (`report_error`).
    report_error(untested_message(untested), show=rank_0)
    if not rank_0:
        time.sleep(PEER_EXIT_DELAY_S)
    raise SystemExit(EXIT_USAGE)


def floor_pins(requirements: Iterable[Requirement]) -> list[str]:
    """`name==floor` for each requirement's lower bound (`>=`), the name alone if it has none."""
    pins = []
    for r in requirements:
        floors = [s.version for s in r.specifier if s.operator in (">=", "==", "~=")]
        pins.append(f"{r.name}=={floors[0]}" if floors else r.name)
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m fsdp_utils.versions",
        description="The declared dependency ranges (pyproject.toml) and the versions installed.",
    )
    parser.add_argument(
        "--floors",
        nargs="*",
        metavar="EXTRA",
        help="Print `name==floor` for each core dependency and those of the EXTRAs, and exit.",
    )
    args = parser.parse_args(argv)
    if args.floors is not None:
        print("\n".join(floor_pins(declared_requirements(args.floors))))
        return 0
    found = find_versions(declared_requirements())
    for f in found:
        mark = "ok" if f.tested else "UNTESTED"
        print(
            f"{f.requirement.name:<18} {f.version or '-':<16} {f.requirement.specifier!s:<12} {mark}"
        )
    return 0 if all(f.tested for f in found) else EXIT_USAGE
