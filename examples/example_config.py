"""Command-line config of ``train_gpt.py``: a YAML file with ``key=value`` (or ``--key=value``,
``--key value``) overrides, every key checked before anything starts.

Keys of ``trainer`` and ``strategy`` are checked against ``lightning.Trainer`` and
``FSDPCustomStrategy`` (any of their arguments may be set, with a value of the argument's type,
checked by jsonargparse as LightningCLI checks it); every other key must be in the YAML
file, and a value replacing an int, float or bool there must be one. A mistake ends the
script with a message naming the key, the closest accepted keys and all of them.
"""

from __future__ import annotations

import difflib
import inspect
import os
import shlex
import sys
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError, ArgumentParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
OpenSections = dict[str, tuple[Callable, set[str]]]  # section -> (callable it configures, reserved keys)


class ConfigError(ValueError):
    """A command-line or YAML mistake; the message says what was wrong and what is accepted."""


def normalize(argv: list[str]) -> list[str]:
    """``--a.b=1``, ``--a.b 1`` and ``a.b=1`` -> ``["a.b=1"]``."""
    items: list[str] = []
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if arg.startswith("--"):
            arg = arg[2:]
            if "=" not in arg:
                if not rest or rest[0].startswith("--"):
                    raise ConfigError(f"--{arg} needs a value: --{arg}=VALUE or {arg}=VALUE")
                arg = f"{arg}={rest.pop(0)}"
        if "=" not in arg:
            raise ConfigError(f"cannot read {arg!r}: overrides are key=value, e.g. trainer.max_steps=20")
        items.append(arg)
    return items


def _accepted(section: Iterable) -> str:
    return ", ".join(str(key) for key in section)


def _unknown(key: str, name: str, accepted: Iterable) -> str:
    """An unknown key's message: the closest accepted keys first, then all of them, wrapped."""
    keys = [str(k) for k in accepted]
    typed = key.rpartition(".")[2]
    starting = [k for k in keys if k.startswith(typed) or typed.startswith(k)]  # shard -> sharding_strategy
    close = list(dict.fromkeys([*difflib.get_close_matches(typed, keys, n=2, cutoff=0.6), *starting]))[:2]
    prefix = key.rpartition(".")[0]
    hint = f"; did you mean {' or '.join(repr(f'{prefix}.{c}' if prefix else c) for c in close)}?" if close else ""
    listing = textwrap.fill(", ".join(keys), width=100, initial_indent="  ", subsequent_indent="  ")
    return f"unknown key {key!r}{hint}\naccepted keys of {name}:\n{listing}"


def _check_open_section(name: str, values: DictConfig, target: Callable, reserved: set[str]) -> None:
    passed_through = set(getattr(target, "fsdp_keywords", ()))  # **kwargs the target checks itself
    named = [p.name for p in inspect.signature(target).parameters.values() if p.kind not in VARIADIC]
    parameters = (set(named) | passed_through) - {"self"} - reserved
    taken = sorted(set(map(str, values)) & reserved)
    if taken:
        raise ConfigError(f"{', '.join(f'{name}.{key}' for key in taken)} cannot be set here: the script sets them")
    unknown = sorted(set(map(str, values)) - parameters)
    if unknown:
        raise ConfigError(
            _unknown(f"{name}.{unknown[0]}", f"{name} (the arguments of {target.__qualname__})", sorted(parameters))
        )
    typed = {key: value for key, value in OmegaConf.to_container(values).items() if key not in passed_through}
    _check_argument_types(name, typed, target)


def _check_argument_types(name: str, values: dict, target: Callable) -> None:
    """Each value against the type hint of ``target``'s argument (jsonargparse, as LightningCLI)."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(target, skip={"self"}, fail_untyped=False)
    signature = inspect.signature(target).parameters
    for key, value in values.items():
        try:
            parser.parse_object({key: value}, defaults=False)
        except ArgumentError:
            hint = signature[key].annotation
            expected = hint if isinstance(hint, str) else inspect.formatannotation(hint)
            raise ConfigError(
                f"{name}.{key}={value!r}: expected {expected} (the type of {target.__qualname__}'s {key})"
            ) from None


def _check_type(key: str, default: object, value: object) -> None:
    """A value overriding an int, float or bool of the YAML must be one (an int may set a float)."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        return
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {type(default).__name__} (the default is {default!r})")


def _check_types(prefix: str, base: object, overrides: object) -> None:
    if isinstance(base, DictConfig) and isinstance(overrides, DictConfig):
        for key in overrides:
            if key in base:
                _check_types(f"{prefix}{key}.", base[key], overrides[key])
    elif not isinstance(overrides, DictConfig):
        _check_type(prefix.rstrip("."), base, overrides)


def load(argv: list[str], default: Path, open_sections: OpenSections) -> DictConfig:
    """The YAML config (``config=FILE`` or ``default``) with the overrides of ``argv`` merged in.

    ``open_sections``: section name -> (the callable whose keyword arguments it may hold, the
    arguments the script sets itself).
    """
    try:
        overrides = OmegaConf.from_dotlist(normalize(argv))
    except OmegaConfBaseException as error:
        raise ConfigError(f"cannot parse the overrides {argv}: {error}") from None
    path = overrides.pop("config", None) or default
    if not Path(path).is_file():
        raise ConfigError(f"config={path}: no such file")
    base = OmegaConf.load(path)
    for key in overrides:
        if key not in base:
            message = _unknown(key, "the top level", ["config", *base])
            sections = [name for name, section in base.items() if isinstance(section, DictConfig) and key in section]
            inside = [f"{name}.{key}" for name in sections]
            if inside and "did you mean" not in message:
                message = message.replace("\n", f"; did you mean {' or '.join(map(repr, inside))}?\n", 1)
            raise ConfigError(message)
        section, value = base[key], overrides[key]
        if isinstance(section, DictConfig) and not isinstance(value, DictConfig):
            raise ConfigError(f"{key} is a section ({_accepted(section)}); set one of its keys, e.g. {key}.KEY=VALUE")
        if key in open_sections:  # Trainer and strategy arguments take several types (devices=2 or "auto")
            continue
        _check_types(f"{key}.", section, value)
        if not isinstance(section, DictConfig):
            continue
        unknown = [str(sub) for sub in value if sub not in section]
        if unknown:
            raise ConfigError(_unknown(f"{key}.{unknown[0]}", key, section))
    config = OmegaConf.merge(base, overrides)
    for name, (target, reserved) in open_sections.items():
        _check_open_section(name, config[name], target, reserved)
    return config


def build_or_exit(config: DictConfig, builders: dict[str, Callable[[dict], Any]]) -> list[Any]:
    """``builders[name](section as a dict)`` for each named section, before anything starts; a value
    the built object refuses (``TypeError``/``ValueError``) ends the script naming the section."""
    built = []
    for name, build in builders.items():
        try:
            built.append(build(OmegaConf.to_container(config[name])))
        except (TypeError, ValueError) as error:
            exit_with(f"{name}: {error}")
    return built


def positive_ints_or_exit(config: DictConfig, section: str, keys: tuple[str, ...], need: str) -> None:
    """End the script unless each ``section.key`` is a positive int (``need``: what the message says
    the script needs, and why)."""
    for key in keys:
        value = config[section].get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            exit_with(f"{section}.{key}={value!r}: this script needs {need}")


def resume_or_exit(
    config: DictConfig,
    last: Path,
    step_key: str,
    max_steps_key: str,
    read_state: Callable[[Path], dict],
    argv: list[str] | None = None,
) -> Path | None:
    """The checkpoint ``resume`` names (``"last"``: ``last``; ``"auto"``: ``last`` if it exists, for a
    command that torchrun or the cluster restarts as it is), or None; the script ends when there is
    none, or when its step (``read_state(path)[step_key]``) has reached ``max_steps_key`` (with
    ``auto``: successfully, the run is done; the message repeats the overrides ``argv`` gave)."""
    if config.resume is None or (config.resume == "auto" and not last.exists()):
        return None
    path = last if config.resume in ("last", "auto") else Path(str(config.resume))
    if not path.exists():
        exit_with(f"resume={config.resume}: no checkpoint at {path}; run without resume first")
    step, limit = int(read_state(path)[step_key]), OmegaConf.select(config, max_steps_key)
    if step >= limit and config.resume == "auto":
        print(f"{path} is at step {step}, {max_steps_key}={limit}: the run is done")
        raise SystemExit(0)
    if step >= limit:
        again = continue_command(argv or [], str(config.resume), max_steps_key, step + limit)
        exit_with(f"{path} is at step {step} and {max_steps_key}={limit}: nothing to train. Continue with: {again}")
    return path


def continue_command(argv: list[str], resume: str, max_steps_key: str, max_steps: int) -> str:
    """The command that trains this run further, ready to paste into a shell: the script as it was
    invoked (``sys.argv[0]``, from whatever folder), ``resume=...``, the new step limit and every
    other override the user gave (``trainer.devices=1`` stays ``trainer.devices=1``), each quoted
    where the shell needs it."""
    kept = [arg for arg in normalize(argv) if not arg.startswith(("resume=", f"{max_steps_key}="))]
    return shlex.join(["python", sys.argv[0], f"resume={resume}", f"{max_steps_key}={max_steps}", *kept])


def exit_with(message: str) -> None:
    """End the script as a command-line mistake does: ``SCRIPT: error: message``, status 2."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_or_exit(argv: list[str], default: Path, usage: str, open_sections: OpenSections) -> DictConfig:
    """``load``, with ``-h``/``--help`` printing ``usage`` and the config, and mistakes exiting with 2."""
    if "-h" in argv or "--help" in argv:
        try:
            print(usage.replace("``", ""))
            print(f"Configuration ({default}), every key can be overridden as key=value:\n")
            print(OmegaConf.to_yaml(OmegaConf.load(default)), flush=True)
        except BrokenPipeError:  # --help | head: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own advice
        raise SystemExit(0)
    try:
        return load(argv, default, open_sections)
    except ConfigError as error:
        exit_with(str(error))
