"""A stage's section of the options: its `--help` title and the metadata of its fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Section:
    name: str  # the key in a field's metadata
    title: str  # the `--help` section's title

    def option(self, help: str, **extra: Any) -> dict[str, Any]:
        """A field's metadata: its help text, and this section; `cli=`: argparse keywords for
        a flag of another shape than its type gives (an optional value, as lm-eval's flags)."""
        return {"help": help, "section": self.name, **extra}


def check_at_least(options: Any, names: tuple[str, ...], *, least: int = 1) -> None:
    """Each of these options, when set, is at least `least`."""
    for name in names:
        value = getattr(options, name)
        if value is not None and value < least:
            raise ValueError(f"--{name} must be at least {least}, got {value}.")
