"""The command line and config files: thin layers over `TrainConfig`.

defaults < `--config FILE` < explicit command-line flags. Every flag is generated from a
`TrainConfig` field (its metadata holds the help text); unknown keys and wrong types in a file
are errors that name the field (with the closest known name).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Literal

from fsdp_utils.arguments import ArgumentParser, did_you_mean
from fsdp_utils.config.model_path import with_model_path
from fsdp_utils.config.options.parallelism import AUTO_PINNED_BY, AUTO_SETTINGS, auto_kept
from fsdp_utils.config.train_config import SECTIONS, TrainConfig, validate_config

# --- command line and config files ---------------------------------------------------------


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """`int | None` -> (int, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _parse_optional(inner: type) -> Any:
    def parse(text: str) -> Any:
        if text.lower() in ("none", "null", ""):
            return None
        return inner(text)

    return parse


def add_config_arguments(
    parser: argparse.ArgumentParser, *, only: Collection[str] | None = None
) -> None:
    """One flag per TrainConfig field (or per field in `only`), in one `--help` section per
    field's `section` (SECTIONS order); defaults are SUPPRESSed so we know what was given."""
    hints = _field_types()
    groups = {name: parser.add_argument_group(title) for name, title in SECTIONS.items()}
    for f in sorted(
        dataclasses.fields(TrainConfig), key=lambda f: list(SECTIONS).index(f.metadata["section"])
    ):
        if only is not None and f.name not in only:
            continue
        tp, optional = _unwrap_optional(hints[f.name])
        help_text = f.metadata.get("help", "").replace("%", "%%")
        if f.metadata.get("joined"):
            help_text += " (In a config file, a list too.)"
        default_note = f" (default: {f.default!r})" if f.default is not dataclasses.MISSING else ""
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text + default_note}
        if "cli" in f.metadata:  # a flag of its own shape (an optional value, as lm-eval's)
            kwargs.update(f.metadata["cli"])
        elif tp is bool:
            kwargs["action"] = "store_true"
            kwargs["help"] = help_text
        elif typing.get_origin(tp) is Literal:
            kwargs["choices"] = list(typing.get_args(tp))
            kwargs["type"] = str
        else:
            kwargs["type"] = _parse_optional(tp) if optional else tp
            kwargs["metavar"] = tp.__name__.upper()
        groups[f.metadata["section"]].add_argument(f"--{f.name}", **kwargs)
    if only is None or {"lora", "quantize"} <= set(only):
        groups["lora"].add_argument(
            "--qlora",
            action=_QLoraShorthand,
            help="QLoRA: short for --lora --quantize nf4 (LoRA adapters over a 4-bit base).",
        )


class _QLoraShorthand(argparse.Action):
    """`--qlora`: sets the two fields it stands for, as if both flags were given (a shorthand of
    the command line, not a setting of its own: config.json records lora and quantize)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        namespace.lora = True
        namespace.quantize = "nf4"


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict of TrainConfig fields."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"Config file {path} does not exist.")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"Config file {path} must hold a mapping of option: value.")
    return run_options(data)


# A run folder's config.json (fsdp_utils/metrics/records.py): the options under "config", what
# they resolved to on that world and the library versions beside them.
RUN_RECORD_KEYS = frozenset({"config", "resolved", "versions"})


def run_options(data: dict[str, Any]) -> dict[str, Any]:
    """The options of a config file; of a run's own config.json, those under "config" (what
    the toolkit writes, it reads: the resolved values and versions are the run's record, not
    options)."""
    if not (isinstance(data.get("config"), dict) and set(data) <= RUN_RECORD_KEYS):
        return data
    options = dict(data["config"])
    if options.get("num_epochs") is not None:  # the steps it resolved to follow from the epochs
        options.pop("max_training_steps", None)
    if options.get("auto"):  # the record holds --auto's choices: chosen again, unless kept
        kept = set(auto_kept(str(options.get("auto_keep") or "")))
        for name in (*AUTO_SETTINGS, *AUTO_PINNED_BY):
            if AUTO_PINNED_BY.get(name, name) not in kept:
                options.pop(name, None)
    return options


def config_from_dict(values: dict[str, Any], *, source: str = "config") -> TrainConfig:
    """Build a TrainConfig, rejecting unknown keys and wrong types with the field's name."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        hints = [f"{key!r}{did_you_mean(key, known)}" for key in unknown]
        raise ValueError(f"Unknown option(s) in {source}: {', '.join(hints)}.")
    hints_by_name = _field_types()
    joined = {f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("joined")}
    checked: dict[str, Any] = {}
    for name, value in values.items():
        if name in joined and isinstance(value, list | tuple):
            value = _joined(name, value, source)
        tp, optional = _unwrap_optional(hints_by_name[name])
        if value is None and optional:
            checked[name] = None
        elif typing.get_origin(tp) is Literal:
            choices = typing.get_args(tp)
            if value not in choices:
                raise ValueError(f"{source}: {name} must be one of {list(choices)}, got {value!r}.")
            checked[name] = value
        elif tp is float and isinstance(value, int) and not isinstance(value, bool):
            checked[name] = float(value)
        elif not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            kind = getattr(tp, "__name__", str(tp))  # `bool | str`: no __name__
            raise ValueError(
                f"{source}: {name} must be {kind}, got {value!r} ({type(value).__name__})."
            )
        else:
            checked[name] = value
    if checked.get("num_epochs") is not None and "max_training_steps" in checked:
        raise ValueError(
            f"{source}: num_epochs and max_training_steps both say how long to train; the "
            "steps of --num_epochs follow from the prepared data. Give one of them."
        )
    config = TrainConfig(**checked)
    validate_config(config)
    return config


def _joined(name: str, items: list[Any] | tuple[Any, ...], source: str) -> str:
    """A list in a config file (`reward_funcs: [a, b]`) for an option the command line takes
    comma-separated: the same string, so that config.json and every reader see one form."""
    for item in items:
        scalar = isinstance(item, str | int | float) and not isinstance(item, bool)
        if not scalar or "," in str(item):
            raise ValueError(
                f"{source}: {name} is a list of names or numbers (or one comma-separated "
                f"string); its item {item!r} is not one."
            )
    return ",".join(str(item).strip() for item in items)


def parse_config(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> tuple[TrainConfig, argparse.Namespace]:
    """Parse the command line (and `--config FILE`) into a validated TrainConfig.

    Returns the config and the namespace (for CLI-only switches such as --print_config).
    `--model` is read as every command reads it (`fsdp_utils.config.model_path`): a run
    folder becomes its final model, an adapter folder its base with the adapter continued.
    """
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_config_file(args.config))
    from_file = dict(values)
    field_names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in field_names}
    values.update(given)
    config = config_from_dict(values, source="the command line and config file")
    if config.auto:
        config = _pin_given_settings(config, given, from_file)
    return with_model_path(config), args


def _pin_given_settings(
    config: TrainConfig, given: dict[str, Any], from_file: dict[str, Any]
) -> TrainConfig:
    """--auto keeps what the user set: a flag --auto would choose given on the command line,
    or set in a --config file to another value than its default, joins --auto_keep (a config
    file written by the toolkit holds every field: its defaults pin nothing)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    names = set(given) | {k for k, v in from_file.items() if v != defaults.get(k, v)}
    pinned = {AUTO_PINNED_BY.get(name, name) for name in names} & set(AUTO_SETTINGS)
    kept = auto_kept(config.auto_keep)
    kept += sorted(pinned - set(kept), key=AUTO_SETTINGS.index)
    return config.replace(auto_keep=",".join(kept))


# The section of a command's own options in `--help`, before the config's sections.
CHECKS_SECTION = "checks before a run"


def build_parser(
    description: str | None = None,
    *,
    prog: str | None = None,
    command_options: Callable[[argparse._ArgumentGroup], None] | None = None,
) -> argparse.ArgumentParser:
    """The parser of a command that takes a TrainConfig: first its own options, in the section
    "checks before a run" (`--config`, `--print_config`, and whatever `command_options` adds),
    then one section per field section. The usage line stays short: 70 flags do not fit in it."""
    parser = ArgumentParser(
        prog=prog,
        usage="%(prog)s [options]",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    checks = parser.add_argument_group(CHECKS_SECTION)
    checks.add_argument("--config", metavar="FILE", help="YAML or JSON file of options.")
    checks.add_argument(
        "--print_config", action="store_true", help="Print the resolved config and exit."
    )
    if command_options is not None:
        command_options(checks)
    add_config_arguments(parser)
    return parser
