"""The command line of monitoring's commands (`gpu_report.py`, the sampler): argparse's parser,
forgiving as fsdp_utils' commands are (`fsdp_utils/arguments.py`, which monitoring does not
import: the two packages stand apart, `.importlinter`).

Flags are spelt with underscores, as the trainer's (`--run_dir`, `--output_dir`); the dashed
spelling is accepted too (`--run-dir`), and a misspelt flag is answered with the closest ones
instead of argparse's bare "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence


def _key(flag: str) -> str:
    """`--run-dir` and `--run_dir` -> run_dir."""
    return flag.lstrip("-").replace("-", "_")


class ArgumentParser(argparse.ArgumentParser):
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        known = {_key(f): f for f in self._option_string_actions if f.startswith("--")}
        given = list(sys.argv[1:] if args is None else args)
        end = given.index("--") if "--" in given else len(given)
        for i, arg in enumerate(given[:end]):
            name, eq, value = arg.partition("=")
            if name.startswith("--") and name not in self._option_string_actions:
                given[i] = known.get(_key(name), name) + eq + value
        return super().parse_known_args(given, namespace)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = {_key(f): f for f in self._option_string_actions if f.startswith("--")}
            hints = [
                f"{arg}: did you mean {' or '.join(flags[c] for c in close)}?"
                for arg in extras
                if arg.startswith("-")
                and (close := difflib.get_close_matches(_key(arg.partition("=")[0]), flags))
            ]
            hint = f" ({'; '.join(hints)})" if hints else ""
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}. See {self.prog} --help.")
        return parsed
