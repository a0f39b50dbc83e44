"""The command line of every command of ours (`chess_finetune.py`, `download_models.py`,
`python -m fsdp_utils.*`): argparse's parser, with the forgiveness a YAML config already has.

- A misspelt flag is named with its closest flags (`--learning_rte`: did you mean
  `--learning_rate`?), as `config_from_dict` names a misspelt key, not only "unrecognized".
- A flag is accepted with dashes or underscores (`--learning-rate` is `--learning_rate`; a
  dashed command's `--dry_run` is its `--dry-run`): users type both, and the spelling only says
  which of our commands they came from.
- Under torchrun every rank parses the same command line: rank 0 reports the mistake, the
  others end quietly with the same exit code (`fsdp_utils.error_report`).

`closest` is the one suggestion rule of the package: flags, config keys, lm-eval task names and
files beside a missing one all go through it. `monitoring` (which never imports fsdp_utils) has
its own small counterpart, `monitoring/arguments.py`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import NoReturn

from fsdp_utils.error_report import EXIT_USAGE, PEER_EXIT_DELAY_S, report_error

# difflib's default cutoff (0.6) misses `--lr` for `--learning_rate` but keeps real typos.
CUTOFF = 0.6


def closest(word: str, candidates: Iterable[str], *, n: int = 3) -> list[str]:
    """The candidates most like `word`, best first (difflib's ratio, as `config_from_dict`)."""
    return difflib.get_close_matches(word, list(dict.fromkeys(candidates)), n=n, cutoff=CUTOFF)


def did_you_mean(word: str, candidates: Iterable[str], *, n: int = 1) -> str:
    """' (did you mean 'x'?)' or ' (did you mean 'x', 'y'?)' or ''."""
    close = closest(word, candidates, n=n)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _key(flag: str) -> str:
    """A long flag's spelling-free key: `--learning-rate` and `--learning_rate` -> learning_rate."""
    return flag[2:].replace("-", "_")


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with the three habits above; use it as argparse's."""

    def _long_flags(self) -> dict[str, str]:
        """Each long flag by its key (`_key`), the first spelling defined; a key that two
        different options share is left out (ambiguous)."""
        flags: dict[str, str] = {}
        clash: set[str] = set()
        for flag, action in self._option_string_actions.items():
            if not flag.startswith("--") or len(flag) == 2:
                continue
            first = flags.setdefault(_key(flag), flag)
            if self._option_string_actions[first] is not action:
                clash.add(_key(flag))
        return {key: flag for key, flag in flags.items() if key not in clash}

    def _respelt(self, args: Sequence[str]) -> list[str]:
        """The command line with every unknown long flag that is a known one spelt with the
        other separator replaced by the known spelling (values and anything after `--` kept)."""
        flags = self._long_flags()
        out: list[str] = []
        rest = False
        for arg in args:
            if not rest and arg == "--":
                rest = True
            elif not rest and arg.startswith("--") and len(arg) > 2:
                name, eq, value = arg.partition("=")
                if name not in self._option_string_actions and _key(name) in flags:
                    arg = flags[_key(name)] + eq + value
            out.append(arg)
        return out

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._given = self._respelt(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(self._given, namespace)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def suggestions(self, args: Sequence[str]) -> list[str]:
        """'--learning_rte: did you mean --learning_rate?' for each flag in `args` that is
        neither one of ours nor the start of one (argparse's abbreviations)."""
        flags = [f for f in self._option_string_actions if f.startswith("--")]
        by_key = self._long_flags()  # compared by key: `--learning-rte` finds it too
        hints = []
        for arg in args:
            name = arg.partition("=")[0]
            if not name.startswith("--") or any(f.startswith(name) for f in flags):
                continue
            close = closest(_key(name), by_key, n=1)
            if close:
                hints.append(f"{name}: did you mean {by_key[close[0]]}?")
        return hints

    def error(self, message: str) -> NoReturn:
        """argparse's usage line and message on rank 0, exit 2; the other ranks of a torchrun
        only put it in their error file (`report_error`) and end after rank 0."""
        hints = self.suggestions(getattr(self, "_given", ()))
        if hints:  # also when argparse stops first at a required flag the typo left out
            message += f" ({'; '.join(hints)})"
        message = message.rstrip(".") + f". See {self.prog} --help."
        rank = int(os.environ.get("RANK", "0") or 0)
        report_error(f"{self.prog}: {message}", show=False)
        if rank != 0:
            time.sleep(PEER_EXIT_DELAY_S)
            raise SystemExit(EXIT_USAGE)
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")
