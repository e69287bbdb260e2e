"""Building the one validated, frozen configuration (engine/config.py) for every raypd entry point.

Values come from four layers, lowest to highest precedence: the defaults in engine/config.py, a YAML file
(`--config PATH` or `RAYPD_CONFIG`), `RAYPD_<FIELD>` environment variables, CLI flags. Every
layer goes through the same parsing and the same `__post_init__` checks, so a bad value is
reported the same way wherever it came from: naming the field, the value and the layer.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from engine.config import FIELDS, SPECS, Config, ConfigError, parse_size, show_value, unknown_name

ENV_PREFIX = "RAYPD_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _parse(name: str, value: Any) -> Any:
    """A layer's value for `name` as the field's type; text is parsed, anything else is left to `_check`."""
    if not isinstance(value, str):
        return value
    spec, text = SPECS[name], value.strip()
    if spec.optional and text.lower() in ("", "none", "null"):
        return None
    if spec.choices:  # case-insensitive, so that `--log-level debug` and `--dtype BFloat16` work
        return next((c for c in spec.choices if c.lower() == text.lower()), value)
    if spec.kind is bool:
        if text.lower() not in _TRUE | _FALSE:
            raise ConfigError(f"invalid {name} {value!r}: must be true/false, yes/no, on/off or 1/0", name)
        return text.lower() in _TRUE
    if spec.kind is int:
        size = FIELDS[name].metadata["size"]
        try:
            return parse_size(text) if size else int(text)
        except ValueError as e:
            why = e if size else "must be an integer"
            raise ConfigError(f"invalid {name} {value!r}: {why}", name) from None
    return text


# vLLM's flag names where vLLM has one, then raypd's own spelling.
_FLAGS: dict[str, tuple[str, ...]] = {
    "num_kv_blocks": ("--num-gpu-blocks-override", "--num-kv-blocks"),
    "kv_cache_memory": ("--kv-cache-memory", "--kv-cache-memory-bytes"),
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
}


def _flags(name: str) -> tuple[str, ...]:
    return _FLAGS.get(name, ("--" + name.replace("_", "-"),))


def _metavar(name: str) -> str:
    spec = SPECS[name]
    if spec.choices:
        return "{" + ",".join(spec.choices) + "}"
    if FIELDS[name].metadata["size"]:
        return "SIZE"
    return "N" if spec.kind is int else name.upper()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per field plus `--config`; an absent flag leaves no attribute (SUPPRESS), so lower
    layers show through where the user gave nothing."""
    parser.add_argument(
        "--config",
        dest="config_file",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help=f"YAML file of field: value pairs, below {ENV_PREFIX}* variables and flags",
    )
    for name, field in FIELDS.items():
        doc = field.metadata["doc"]
        if field.default is not None:
            doc += f" (default: {show_value(field, field.default)})"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": doc.replace("%", "%%")}
        if SPECS[name].kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif field.metadata["listed"]:
            kwargs["action"] = "append"  # `--api-key A --api-key B` is `--api-key A,B`
            kwargs["metavar"] = _metavar(name)
        else:  # kept as text and parsed by `_parse` like the other layers, so that all report errors alike
            kwargs["metavar"] = _metavar(name)
        parser.add_argument(*_flags(name), **kwargs)


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must map field names to values, not be a {type(data).__name__}")
    return _fields(data, f"config file {path}")


def _fields(data: Mapping[Any, Any], where: str) -> dict[str, Any]:
    """`data`'s keys as field names (`max-num-seqs` is `max_num_seqs`); an unknown key is an error."""
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(unknown_name(f"unknown key {key!r} in {where}", name, FIELDS))
        values[name] = value
    return values


def config_from_args(args: Mapping[str, Any], where: str = "the application's args") -> Config:
    """The Config of a Serve application's `args` (`serve run serve.app:build prefill=2 ...`,
    or `args:` in a Serve config file): field names as keys, values as in a YAML file."""
    values = _fields(args, where)
    try:
        return Config(**{name: _parse(name, value) for name, value in values.items()})
    except ConfigError as e:
        raise ConfigError(f"{e} (from {where})", e.field) from None


def config_from(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    """Merge the layers: defaults < YAML file < `RAYPD_*` variables (`env`, default os.environ) < the flags
    present in `ns`. Raises ConfigError, naming where the bad value came from."""
    env = os.environ if env is None else env
    layers: dict[str, tuple[Any, str]] = {}  # field -> (value, where it was set)
    path = getattr(ns, "config_file", None) or env.get(CONFIG_ENV)
    if path:
        layers.update((name, (value, path)) for name, value in _read_yaml(path).items())
    for var, text in env.items():
        if var.startswith(ENV_PREFIX) and var != CONFIG_ENV:
            name = var[len(ENV_PREFIX) :].lower()
            if name not in FIELDS:
                known = [ENV_PREFIX + n.upper() for n in FIELDS]
                raise ConfigError(unknown_name(f"unknown environment variable {var}", var, known))
            layers[name] = (text, var)
    for name in FIELDS:
        if hasattr(ns, name):
            value = getattr(ns, name)
            layers[name] = (",".join(value) if isinstance(value, list) else value, _flags(name)[0])
    try:
        return Config(**{name: _parse(name, value) for name, (value, _) in layers.items()})
    except ConfigError as e:
        if e.field not in layers:
            raise
        raise ConfigError(f"{e} (from {layers[e.field][1]})", e.field) from None


def _parser(extra: Callable[[argparse.ArgumentParser], None] | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="raypd: prefill/decode disaggregated LLM serving on Ray")
    add_cli_args(parser)
    if extra is not None:
        extra(parser)
    return parser


def parse_args(
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """Parse `argv` (default sys.argv[1:]) with raypd's flags and those `extra` adds, and build the Config
    into `ns.config`. Any bad value ends the program with a one-line usage error (exit code 2), never a
    traceback, since the person at the terminal needs the value to fix, not the stack."""
    parser = _parser(extra)
    ns = parser.parse_args(argv)
    try:
        ns.config = config_from(ns, env)
    except ConfigError as e:
        parser.error(str(e))
    return ns


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """The Config for `argv` and `env`, raising ConfigError on a bad value: for callers that handle it."""
    return config_from(_parser(None).parse_args(argv), env)


def load_config_or_exit(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """The Config for `argv` and `env`, or exit 2 with a one-line message: for `main` functions."""
    return parse_args(argv, env).config
