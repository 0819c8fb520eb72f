"""Loading a run's configuration: defaults, then a TOML file, then `--set` values, into one
`Config` (options.py), checked once (validation.py); and a Config written back as TOML.

A TRL-style flat key at the top level of a TOML file (`beta = 0.04`) goes to the one section that
has it; TRL's other names are trl_names.py's. Precedence: dataclass defaults < TOML file <
`--set section.key=value`, applied in order. A config file that names no model (model.path unset,
"" or "embedded", in the file and the `--set` values) trains the embedded tiny model, so its unset
keys come from the embedded default run (config/default.toml), not from the dataclass defaults
(which are TRL's, for real models). This file checks each key and its type (and the TRL aliases
that would set one value twice); validation.py checks the values and how they combine.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import sys
import typing
import warnings
from pathlib import Path

from rlcore import EMBEDDED_DEFAULT, ConfigError, RlcoreWarning
import rlcore.config.trl_names as trl_names
from rlcore.config.options import EMBEDDED_MODEL_PATHS, PATH_OPTIONS, SECTIONS, Config, field_names, sections_with
from rlcore.config.validation import validate
from rlcore.config.values import accepts, check_type, shell_set, toml_literal, toml_value
from rlcore.rewards.scoring import names_reward_model

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib


def config_from_dict(nested: dict) -> Config:
    """Build from a nested dict `{section: {key: value}}` (flat TRL keys allowed), checking keys and types."""
    sections = {}
    for name, values in normalize(nested).items():
        section_cls = SECTIONS[name]
        hints = typing.get_type_hints(section_cls)
        kwargs = {}
        if name == "train" and "num_train_epochs" in values and "max_steps" not in values:
            values = {**values, "max_steps": -1}  # TRL's default max_steps: count the epochs
        for key, value in values.items():
            key = trl_names.rlcore_field(name, key, value, values)
            if key in kwargs and kwargs[key] != value:
                raise ConfigError(f"{name}.{key} is set twice, to {kwargs[key]!r} and {value!r} (one of them "
                                  f"under another name TRL uses for it); keep one")
            if key not in hints:
                explained = trl_names.explain(key, value)
                if explained is None:
                    raise ConfigError(f"unknown config key {name}.{key}{_suggest(f'{name}.{key}')}")
                harmless, text = explained
                if not harmless:
                    raise ConfigError(text)
                warnings.warn(text, RlcoreWarning, stacklevel=3)
                continue
            kwargs[key] = check_type(f"{name}.{key}", value, hints[key])
        sections[name] = section_cls(**kwargs)
    return Config(**sections)


def config_to_dict(config: Config) -> dict:
    """The config as a nested dict `{section: {key: value}}`; `config_from_dict` inverts it."""
    return dataclasses.asdict(config)


def dump_config(config: Config) -> str:
    """The config as TOML text that `load_config` reads back to an equal config (None is left out
    where it is the default, and written "none" where it is not)."""
    lines = []
    for name, values in config_to_dict(config).items():
        lines.append(f"[{name}]")
        defaults = {f.name: f.default for f in dataclasses.fields(SECTIONS[name])}
        lines += [f"{key} = {toml_value(value)}" if value is not None else f'{key} = "none"'
                  for key, value in values.items() if value is not None or defaults[key] is not None]
        lines.append("")
    return "\n".join(lines)


RUN_CONFIG_HEADER = "# rlcore: this run's configuration, which rlcore train --resume reads\n"
"""The first line of the config.toml a run directory holds: `rlcore train --resume` reads it back."""

def with_absolute_paths(config: Config) -> Config:
    """A copy of `config` with the PATH_OPTIONS that are set, and the reward models' directories in
    loss.reward_funcs, made absolute (the embedded model's "" / "embedded" stay): what a run
    directory records, so a --resume from elsewhere finds them."""
    config = copy.deepcopy(config)
    for section, key in PATH_OPTIONS:
        value = getattr(getattr(config, section), key)
        if value is not None and value not in EMBEDDED_MODEL_PATHS:
            setattr(getattr(config, section), key, str(Path(value).resolve()))
    config.loss.reward_funcs = [str(Path(name).resolve()) if names_reward_model(name) else name
                                for name in config.loss.reward_funcs]
    return config


def read_toml(path: str) -> tuple[dict, bytes]:
    """A config file's settings and its bytes; a ConfigError names a file that cannot be read as TOML."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        return tomllib.loads(raw.decode("utf-8")), raw
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass an existing TOML file "
                          f"(see configs/ for examples)") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; pass a TOML file "
                          f"(see configs/ for examples)") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason}, byte "
                          f"{e.object[e.start:e.start + 1]!r} at offset {e.start}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        if looks_like_yaml(path):
            raise ConfigError(f"config file {path} looks like YAML; rlcore reads TOML: write `key = value` "
                              f"(learning_rate = 1e-6, strings quoted), TRL's flat names work as they "
                              f"are ({e})") from None
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None


def override_layer(overrides: list[str]) -> dict:
    """The `--set` values as `{section: {key: value}}`."""
    layer = {}
    for item in overrides:
        section, key, value = parse_override(item)
        layer.setdefault(section, {})[key] = value
    return layer


def launched_world_size() -> int:
    """The rank count torchrun launched (its WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_config(path: str | None = None, overrides: list[str] = (), world_size: int | None = None) -> Config:
    """Defaults (for a file that names no model, config/default.toml's values), then the TOML file
    at `path` (None: none), then each `section.key=value` override.
    A layer that sets train.num_train_epochs without train.max_steps sets max_steps = -1 (count epochs).

    An override's value is read as a TOML literal (`0.04`, `true`, `["a", "b"]`), and as a bare
    string when it is not one (`model.path=/ckpt/qwen`); `none` sets an optional field to None.
    The result is checked once, here, with `validate(config, world_size)` (None: the rank count
    torchrun launched); `train()` runs the config it is given.
    """
    settings, raw = read_toml(path) if path is not None else ({}, b"")
    empty = path is not None and not settings
    trl_style = any(key not in SECTIONS for key in settings)  # flat TRL keys: likely a recipe written for TRL
    settings = normalize(settings)
    in_file = {(section, key) for section, values in settings.items() for key in values}
    layer = override_layer(overrides)
    base = None
    if path is not None and builds_on_embedded_default(path, raw, settings, layer):
        with open(EMBEDDED_DEFAULT, "rb") as f:
            base = normalize(tomllib.load(f))
        train_file = settings.get("train", {})
        if "num_train_epochs" in train_file and "max_steps" not in train_file:
            base["train"].pop("max_steps", None)  # the file counts epochs (as a layer of its own would)
        settings = {section: {**base.get(section, {}), **settings.get(section, {})} for section in {*base, *settings}}
    if empty:
        run = "the embedded default (rlcore/config/default.toml)" if base else "rlcore's defaults (rlcore options)"
        warnings.warn(f"config file {path} sets nothing: the run is {run} with the --set values", RlcoreWarning,
                      stacklevel=2)
    given = {(section, key) for section, values in layer.items() for key in values}
    trl_names.expand_loss_type(layer)  # --set loss_type=cispo sets policy_loss too, over the file's
    for section, values in layer.items():
        settings.setdefault(section, {}).update(values)
    if ("train", "num_train_epochs") in given and ("train", "max_steps") not in given:
        file_steps = settings["train"].get("max_steps", -1) if ("train", "max_steps") in in_file else -1
        if file_steps != -1:  # TRL keeps a positive max_steps over num_train_epochs: say which one runs
            warnings.warn(f"--set train.num_train_epochs = {layer['train']['num_train_epochs']} replaces {path}'s "
                          f"train.max_steps = {file_steps} (the run counts epochs; in TRL a positive max_steps would "
                          f"win): add --set train.max_steps={file_steps} to keep it", RlcoreWarning, stacklevel=2)
        settings["train"]["max_steps"] = -1  # the overrides mean the epochs, whatever the file's max_steps
    config = config_from_dict(settings)
    validate(config, launched_world_size() if world_size is None else world_size)
    if trl_style and base is None:  # (a file on the embedded default tunes rlcore's own run)
        trl_names.warn_trl_defaults(config, path, in_file | given)
    return config


def on_embedded_default(path: str | None, overrides: list[str] = ()) -> bool:
    """Whether `load_config(path, overrides)` lays the file over the embedded default run (see
    builds_on_embedded_default), for the command line to say so."""
    if path is None:
        return False
    settings, raw = read_toml(path)
    return builds_on_embedded_default(path, raw, normalize(settings), override_layer(overrides))


def builds_on_embedded_default(path: str, raw: bytes, file: dict, overrides: dict) -> bool:
    """Whether the config file at `path` (`raw` its bytes, `file` them read and normalized,
    `overrides` the --set layer) takes its unset keys from the embedded default: it names no model,
    so it trains the embedded tiny model, which TRL's defaults do not fit (512 new tokens, lr 1e-6,
    another held-out set and so another embedded model). A run's own config.toml is complete and
    is read as it is."""
    if Path(path).resolve() == EMBEDDED_DEFAULT.resolve() or raw.startswith(RUN_CONFIG_HEADER.encode()):
        return False
    model_path = overrides.get("model", {}).get("path", file.get("model", {}).get("path", ""))
    return model_path in EMBEDDED_MODEL_PATHS


def overridden(overrides: list[str], option: str):
    """The value the `--set` values give `option` ("section.key"; the last one wins), or None."""
    values = [value for section, key, value in map(parse_override, overrides) if f"{section}.{key}" == option]
    return values[-1] if values else None


def model_in_overrides(overrides: list[str]) -> str:
    """The model.path the `--set` values give, or "" when none names a model ("embedded" names
    the embedded one, as "" does)."""
    path = overridden(overrides, "model.path")
    return "" if path is None or str(path) in EMBEDDED_MODEL_PATHS else str(path)


def looks_like_yaml(path: str) -> bool:
    """A .yaml/.yml name, or a first setting written `key: value` (TRL's and verl's recipe files)."""
    if Path(path).suffix.lower() in (".yaml", ".yml"):
        return True
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.strip() and not line.lstrip().startswith("#")]
    return bool(lines) and re.match(r"^\s*[\w.-]+:(\s|$)", lines[0]) is not None


def parse_override(item: str) -> tuple[str, str, object]:
    """`"loss.beta=0.04"` -> `("loss", "beta", 0.04)`; a flat TRL key (`"beta=0.04"`) finds its section."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not section.key=value; write e.g. --set loss.beta=0.04")
    parts = key.split(".")
    if len(parts) == 1 and parts[0] in SECTIONS:
        table = toml_literal(raw)
        first = field_names(SECTIONS[parts[0]])[0]
        sets = ([shell_set(f"{parts[0]}.{k}={toml_value(v)}") for k, v in table.items()]
                if isinstance(table, dict) and table else [f"--set {parts[0]}.{first}=..."])
        raise ConfigError(f"--set {item}: {parts[0]} is a section; set one key at a time: " + " ".join(sets))
    if len(parts) == 1:
        section, name = _flat_target(parts[0])
    elif len(parts) == 2:
        section, name = parts
        if section not in SECTIONS:
            raise _unknown_section(section)
    elif parts[0] in SECTIONS and typing.get_origin(typing.get_type_hints(SECTIONS[parts[0]]).get(parts[1])) is dict:
        inner = {".".join(parts[2:]): toml_literal(raw, default=raw.strip())}
        raise ConfigError(f"--set {item}: {parts[0]}.{parts[1]} is a table; give it whole: "
                          + shell_set(f"{parts[0]}.{parts[1]}={toml_value(inner)}"))
    elif text := trl_names.foreign(key):
        raise ConfigError(f"unknown config key {key}: {text}")
    else:
        raise ConfigError(f"override key {key!r} has too many dots; write section.key=value, "
                          f"e.g. --set loss.beta=0.04")
    raw = raw.strip()
    value = toml_literal(raw, default=raw)
    hint = typing.get_type_hints(SECTIONS[section]).get(name)
    if isinstance(value, str) and value.startswith("[") and value.endswith("]") and hint is not None \
            and accepts(hint, list) and not accepts(hint, str):
        value = [item.strip() for item in value[1:-1].split(",") if item.strip()]  # the shell ate the quotes: [a,b]
    if hint is not None and not isinstance(value, str) and accepts(hint, str) and not accepts(hint, type(value)):
        value = raw  # `data.system_prompt=42` means the text "42"
    return section, name, value


def normalize(toml: dict) -> dict:
    """`{section: {key: value}}` from a TOML dict, moving flat TRL keys (`beta = 0.04`) into their section."""
    out = {}
    flat = {}
    for key, value in toml.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"config section {key} = {value!r} must be a table; write "
                                  f"[{key}] and its keys under it, or {key}.<key> = value")
            out.setdefault(key, {}).update(value)
        elif isinstance(value, dict) and not sections_with(key) and trl_names.explain(key, value) is None:
            raise _unknown_section(key)
        else:
            flat[key] = value
    for key, value in flat.items():
        section, name = _flat_target(key)
        if name in out.get(section, {}) and out[section][name] != value:  # equal: transformers 5 mirrors some
            raise ConfigError(f"config key {key} is set twice: flat ({key} = {value!r}) and in "
                              f"[{section}] ({name} = {out[section][name]!r}); keep one")
        out.setdefault(section, {})[name] = value
    trl_names.expand_tables(out)
    trl_names.expand_loss_type(out)
    return out


def _flat_target(key: str) -> tuple[str, str]:
    """The (section, field) a top-level TRL-style key belongs to."""
    if key in trl_names.FLAT_ALIASES:
        return trl_names.FLAT_ALIASES[key]
    if key in trl_names.TRL_ONLY or key.startswith("vllm_"):
        return "train", key  # TRL's, without an rlcore field: config_from_dict explains it there
    owners = sections_with(key)
    if len(owners) == 1:
        return owners[0], key
    if len(owners) > 1:
        raise ConfigError(f"config key {key} is in sections {', '.join(owners)}; write it as "
                          f"{owners[0]}.{key} (or under [{owners[0]}])")
    raise ConfigError(f"unknown config key {key}{_suggest(key)}")


def _unknown_section(name: str) -> ConfigError:
    if text := trl_names.foreign(name):
        return ConfigError(f"unknown config section [{name}]: {text}")
    close = difflib.get_close_matches(name, SECTIONS, n=1)
    hint = f"did you mean [{close[0]}]? " if close else ""
    return ConfigError(f"unknown config section [{name}]; {hint}sections are {', '.join(SECTIONS)}")


def _suggest(key: str) -> str:
    """"; did you mean X?" for an unknown `key` ("section.name" or a flat name), or a pointer to the docs."""
    if text := trl_names.foreign(key):
        return f": {text}"
    section, _, name = key.rpartition(".")
    owners = sections_with(name)
    if not owners:
        if section in SECTIONS:
            close = difflib.get_close_matches(name, field_names(SECTIONS[section]), n=1)
            owners = [section] if close else []
        else:
            close = difflib.get_close_matches(name, [n for cls in SECTIONS.values() for n in field_names(cls)], n=1)
            owners = sections_with(close[0]) if close else []
        name = close[0] if close else name
    if not owners:
        return "; `rlcore options` lists every option"
    return "; did you mean " + " or ".join(f"{owner}.{name}" for owner in owners) + "?"

