"""Command-line flags generated from the config dataclasses, with an optional YAML `--config` underneath.

Precedence: dataclass defaults < YAML file < flags given on the command line. YAML keys are the flag names with
underscores (`max_tokens: 64`), flat or grouped under the section names (`sampling: {max_tokens: 64}`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml


def _base_type(annotation: Any) -> Any:
    """int | None → int; tuple[str, ...] → tuple; dict[str, float] | None → dict."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _base_type(next(a for a in typing.get_args(annotation) if a is not type(None)))
    return origin or annotation


def _json_object(text: str) -> dict[str, Any]:
    """A flag value given as a JSON object (`--worker-resources '{"spot_node": 1}'`)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


_json_object.__name__ = "JSON object"  # argparse names the type in its error: "invalid JSON object value"


def _field_types(section: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section)
    return {f.name: _base_type(hints[f.name]) for f in dataclasses.fields(section)}


def build_parser(description: str, sections: dict[str, type]) -> argparse.ArgumentParser:
    """One flag per dataclass field of every section; defaults are shown but applied later (to see what was given)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="YAML file with any of the flags below (flags given here win)")
    for name, section in sections.items():
        group = parser.add_argument_group(name)
        for f in dataclasses.fields(section):
            flag = "--" + f.name.replace("_", "-")
            kind = _field_types(section)[f.name]
            default = f.default if f.default is not dataclasses.MISSING else None
            help_text = f.metadata.get("help", "") + (
                f" (default: {default!r})" if default not in (None, "", ()) else ""
            )
            if kind is bool and default is None:  # three states: on, off, or "let the model decide"
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
                )
            elif kind is bool:  # off by default: --flag; on by default: --flag / --no-flag
                action = argparse.BooleanOptionalAction if default else "store_true"
                group.add_argument(flag, action=action, default=argparse.SUPPRESS, help=help_text)
            elif kind is tuple:
                group.add_argument(flag, action="append", default=argparse.SUPPRESS, help=help_text)
            elif kind is dict:
                group.add_argument(flag, type=_json_object, default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text)
    return parser


def _read_yaml(path: str) -> Any:
    """The parsed `--config` file; `ValueError` in one line for a file that cannot be read or is not YAML."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"--config {path}: cannot be read ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"--config {path}: not valid YAML ({problem}{where})") from None


def _flag_name(path: str, key: Any) -> str:
    """A YAML key as a field name (`max-tokens` → `max_tokens`); `ValueError` for a key that is not a string."""
    if not isinstance(key, str):
        raise ValueError(f"--config {path}: key {key!r} is not a flag name (keys are flag names such as max_tokens)")
    return key.replace("-", "_")


def _yaml_values(path: str, sections: dict[str, type]) -> dict[str, Any]:
    raw = _read_yaml(path) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    known = {f.name for section in sections.values() for f in dataclasses.fields(section)}
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        key = _flag_name(path, key)
        if key in sections and isinstance(value, dict):
            flat.update({_flag_name(path, k): v for k, v in value.items()})
        else:
            flat[key] = value
    unknown = sorted(set(flat) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; allowed: {sorted(known)}")
    return flat


def parse_sections(description: str, sections: dict[str, type], argv: list[str] | None = None) -> dict[str, Any]:
    """Parse argv (and --config) into one instance per section; `ValueError` names a bad value."""
    args = vars(build_parser(description, sections).parse_args(argv))
    values = _yaml_values(args.pop("config"), sections) if args.get("config") else {}
    args.pop("config", None)
    values.update(args)
    out = {}
    for name, section in sections.items():
        kwargs = {f.name: values[f.name] for f in dataclasses.fields(section) if f.name in values}
        if "stop" in kwargs and isinstance(kwargs["stop"], (list, str)):
            kwargs["stop"] = (kwargs["stop"],) if isinstance(kwargs["stop"], str) else tuple(kwargs["stop"])
        out[name] = section(**kwargs)
    return out


def run_job_cli(
    description: str, sections: dict[str, type], config_class: type, build: Callable[[Any], Any], argv: list[str]
) -> int:
    """The whole life of a job command: flags → config → job → run → printed summary.

    A bad flag, config file, input, column, model or output directory, or a model that does not fit the GPUs
    (`pipeline/fit.py`), exits with status 2 and a one-line message, before any worker starts; a job that cannot finish (workers fail to start, a shard keeps failing) exits with
    status 1 and a one-line message.
    """
    from pipeline.fit import ModelDoesNotFit
    from pipeline.output import OutputRefused

    try:
        config = config_class(**parse_sections(description, sections, argv))
        job = build(config)
    except (ValueError, FileNotFoundError) as error:
        return _fail(error, 2)
    from pipeline.driver import JobFailed, run

    try:
        totals = run(job)
    except (OutputRefused, ModelDoesNotFit) as error:  # --output is not this job's (or is held); the model is too big
        return _fail(error, 2)
    except JobFailed as error:  # no worker could start, a shard kept failing, no cluster answered
        return _fail(error, 1)
    print(json.dumps({"output": config.output.output, **totals}, indent=2))
    return 0


def _fail(error: Exception, status: int) -> int:
    """Print `error: …` on one line; return `status`."""
    print("error: " + " ".join(str(error).split()), file=sys.stderr)
    return status
