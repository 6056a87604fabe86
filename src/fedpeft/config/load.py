"""Reading a run configuration: YAML file + ``--set key=value`` overrides -> validated RunConfig."""

from __future__ import annotations

import copy
import logging
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from fedpeft.config.schema import DEFAULT_CHOICES, RunConfig, field_type, options_for
from fedpeft.config.section import OptionValueError
from fedpeft.errors import UserError

log = logging.getLogger("fedpeft")
# the sections whose options belong to one registered method, with their tag and default
SWITCHABLE = {"peft": ("method", DEFAULT_CHOICES["peft"]), "algorithm": ("name", DEFAULT_CHOICES["algorithm"])}


class ConfigError(UserError, ValueError):
    """A configuration problem, one line per problem, each naming the key and the fix."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently,
    so a second ``train:`` section would reset every setting of the first to its default)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *defaults' merges a mapping; it is no key
                continue
            key = self.construct_object(key_node, deep=True)
            mark = key_node.start_mark
            try:
                hash(key)
            except TypeError:
                raise ConfigError(f"{self.name}:{mark.line + 1}:{mark.column + 1}: a {type(key).__name__} cannot be "
                                  "a key; write the key as a plain name") from None
            if key in seen:
                first = seen[key]
                raise ConfigError(
                    f"{self.name}:{key_node.start_mark.line + 1}:{key_node.start_mark.column + 1}: key {key!r} is "
                    f"given twice in one mapping (first on line {first.line + 1}); merge the two into one"
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; a syntax error or a duplicated key is a ConfigError naming the file, the
    line and the column (1-based)."""
    text = path.read_text(encoding="utf-8")
    loader = _UniqueKeyLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(x for x in (exc.context, exc.problem) if x)
        raise ConfigError(f"{where}: not valid YAML ({what}); fix the syntax at that line and column") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    finally:
        loader.dispose()


def parse_override(item: str) -> tuple[list[str], Any]:
    """``'train.lr=1e-3'`` -> (['train', 'lr'], 0.001). Values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.lr=1e-3")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item!r}: value is not valid YAML ({exc.__class__.__name__})") from None
    # YAML 1.1 reads '1e-3' as a string; numbers are what users mean.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for item in overrides:
        parts, value = parse_override(item)
        if parts[0] == "plugins":
            raise ConfigError(f"--set {item!r}: a plugin is code; name it with --plugin FILE_OR_MODULE (repeatable; "
                              "plugins=[...] in Python), not with --set")
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def switched_sections(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, set[str]]:
    """Sections whose method a dotted override replaces (``--set peft.method=bitfit``): section -> the keys the
    config file gave that section and no override sets (they belonged to the old method; the new one may lack
    them). A whole-section override (``--set 'peft={method: bitfit}'``) replaces the section itself."""
    parsed = [parse_override(o) for o in overrides]
    out = {}
    for section, (tag, default) in SWITCHABLE.items():
        last = next((i for i in range(len(parsed) - 1, -1, -1) if parsed[i][0] == [section, tag]), None)
        if last is None or any(parts == [section] for parts, _ in parsed):  # a whole section given: it is the user's
            continue
        new = parsed[last][1]
        before = raw.get(section) if isinstance(raw.get(section), dict) else {}
        if not isinstance(new, str) or new == before.get(tag, default):  # (not a name: validation refuses it)
            continue
        overridden = {parts[1] for parts, _ in parsed if len(parts) > 1 and parts[0] == section}
        out[section] = set(before) - {tag} - overridden
    return out


def _drop_switched_keys(raw: dict[str, Any], switched: dict[str, set[str]]) -> None:
    """Drop from each switched section the file's keys its new method has no option for, saying which."""
    for section, keys in switched.items():
        tag = SWITCHABLE[section][0]
        options = raw.get(section)
        if not isinstance(options, dict):
            continue
        try:
            fields = options_for(section, str(options.get(tag))).model_fields
        except ValueError:  # an unknown method: validation names the choices
            continue
        dropped = sorted(k for k in keys if k in options and k not in fields)
        if dropped:
            raw[section] = {k: v for k, v in options.items() if k not in dropped}
            log.warning("--set %s.%s=%s: the config's %s options %s belong to another method and were dropped "
                        "(%s %s has no such options)", section, tag, options.get(tag), section,
                        ", ".join(dropped), tag, options.get(tag))


def _section_model(annotation: Any, raw_value: Any, tag: str | None = None) -> type[BaseModel] | None:
    """The pydantic model behind a field annotation; resolves a discriminated union by the raw value of its
    discriminator (``tag``: method, name, rule, ..., read from the Annotated field that declares it)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *metadata = typing.get_args(annotation)
        found = next((m.discriminator for m in metadata if isinstance(getattr(m, "discriminator", None), str)), tag)
        return _section_model(inner, raw_value, found)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        candidates = _models_in(annotation)
        if tag is None:  # a union without a discriminator of its own: one may sit on an Annotated member
            tag = next((d for a in typing.get_args(annotation) if typing.get_origin(a) is typing.Annotated
                        for m in typing.get_args(a)[1:] if isinstance(d := getattr(m, "discriminator", None), str)),
                       None)
        if isinstance(raw_value, dict):
            for cand in candidates:  # by the discriminator, else by any Literal field the raw value sets
                tags = [tag] if tag is not None else [n for n, f in cand.model_fields.items()
                                                      if typing.get_origin(f.annotation) is typing.Literal]
                if any(t in raw_value and t in cand.model_fields and raw_value[t] == cand.model_fields[t].default
                       for t in tags):
                    return cand
        return candidates[0] if candidates else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _discriminator(field: Any) -> str | None:
    """The discriminator a field declares (pydantic keeps an Annotated field's ``discriminator`` on its FieldInfo)."""
    found = getattr(field, "discriminator", None)
    return found if isinstance(found, str) else None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a (possibly nested, Annotated or Optional) union annotation allows."""
    if isinstance(annotation, type):
        return [annotation] if issubclass(annotation, BaseModel) else []
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        args = args[:1]
    return [m for a in args for m in _models_in(a)]


def _valid_keys(raw: dict[str, Any], loc: tuple) -> list[str]:
    """Valid keys of the section that holds ``loc[-1]`` (loc as pydantic reports it)."""
    model: type[BaseModel] | None = RunConfig
    node: Any = raw
    for part in loc[:-1]:
        if model is None:
            return []
        if part not in model.model_fields:
            continue  # a discriminator tag inserted by pydantic, e.g. ('peft', 'lora', 'rr')
        node = node.get(part, {}) if isinstance(node, dict) else {}
        model = _section_model(field_type(model, part), node, _discriminator(model.model_fields[part]))
    return sorted(model.model_fields) if model is not None else []


def _override_key(raw: dict[str, Any], loc: tuple) -> str:
    """``loc`` as a ``--set`` key: without the discriminator tags pydantic inserts (peft.lora.r -> peft.r)."""
    model: type[BaseModel] | None = RunConfig
    node: Any = raw
    parts = []
    for part in loc:
        if model is not None and part not in model.model_fields:
            continue  # a discriminator tag
        parts.append(part)
        if model is not None:
            node = node.get(part, {}) if isinstance(node, dict) else {}
            model = _section_model(field_type(model, part), node, _discriminator(model.model_fields[part]))
    return ".".join(parts)


def _format(err: dict[str, Any], raw: dict[str, Any]) -> str:
    loc = tuple(str(p) for p in err.get("loc", ()))
    key = ".".join(loc) or "(config)"
    if err["type"] == "extra_forbidden":
        valid = _valid_keys(raw, loc)
        return f"{key}: unknown key; valid keys here: {', '.join(valid)}"
    if err["type"] == "union_tag_invalid":
        ctx = err.get("ctx", {})
        tag = str(ctx.get("discriminator", "")).strip("'")
        return f"{key}.{tag}: unknown choice {ctx.get('tag')!r}; valid choices: {ctx.get('expected_tags')}"
    if err["type"] == "union_tag_not_found":
        return f"{key}: missing {err.get('ctx', {}).get('discriminator', 'tag')}"
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, OptionValueError):  # raised by a section about one of its keys
        section = _override_key(raw, tuple(err.get("loc", ())))
        return f"{section}.{cause.key}: {cause.message}" if section else f"{cause.key}: {cause.message}"
    got = err.get("input")
    if isinstance(got, dict) and err["type"].endswith("_type") and len(got) == 1:
        # `--set peft.init_text=Review sentiment:` -> YAML reads 'text:' as a one-key mapping
        (k, v), = got.items()
        text = f"{k}:" if v is None else f"{k}: {v}"
        return (f"{key}: {msg} (got the mapping {got!r}: a value ending in ':' or holding ': ' reads as YAML; "
                f"quote it, e.g. --set '{_override_key(raw, loc)}=\"{text}\"')")
    shown = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"{key}: {msg}{shown}"


def validate_config(raw: dict[str, Any], base_dir: str | Path | None = None,
                    switched: dict[str, set[str]] | None = None, *, plugins: Iterable[str] = (),
                    trust_plugins: bool = False, source: str = "the config", quiet: bool = False) -> RunConfig:
    """A RunConfig from a raw mapping, after loading the installed plugins (fedpeft.plugins), the user's
    ``plugins`` (files relative to the working directory, or module names; added to the config's list) and the
    plugins the mapping lists (relative paths taken from ``base_dir``: the config file's directory) when
    ``trust_plugins``, or when the user named them too. A plugin is code: a listed one that is not trusted is
    not imported, and a config that needs it (an unknown method name) is refused naming it and both ways to
    load it (``source``: the file, in that message); one it does not need is reported with a warning (unless
    ``quiet``). ``switched`` (:func:`switched_sections`): sections whose method an override replaced, and the keys
    that may go."""
    if not isinstance(raw, dict):
        raise ConfigError("config: the top level must be a mapping of sections (task:, model:, ...)")
    raw = dict(raw)
    listed = raw.get("plugins") or []
    if not isinstance(listed, list) or not all(isinstance(x, str) for x in listed):
        raise ConfigError("plugins: give a list of plugin modules or .py files, e.g. plugins: [./my_plugin.py]")
    if isinstance(plugins, str):
        raise ConfigError(f"plugins={plugins!r}: give a list of plugins, e.g. plugins=[{plugins!r}]")
    from fedpeft.plugins import (  # registers their algorithms and methods first
        load_installed_plugins,
        load_plugins,
        resolve_plugin,
        untrusted_hint,
        untrusted_plugins,
    )

    load_installed_plugins()  # first: what an installed package imports is no longer the file's to name
    listed = [resolve_plugin(x, base_dir) for x in listed]
    named = [resolve_plugin(x) for x in plugins]
    raw["plugins"] = list(dict.fromkeys([*listed, *named]))
    untrusted = untrusted_plugins(listed, named, trust_plugins)
    load_plugins([spec for spec in raw["plugins"] if spec not in untrusted])
    if switched:
        _drop_switched_keys(raw, switched)
    # A section given without its tag means the default method/algorithm with those options.
    for section, (tag, default) in SWITCHABLE.items():
        if isinstance(raw.get(section), dict) and tag not in raw[section]:
            raw[section] = {tag: default, **raw[section]}
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [_format(e, raw) for e in exc.errors()]
        unknown = next((line for line in lines if "unknown choice" in line), None)
        if untrusted and unknown is not None:  # a name the untrusted plugins may register: one line, the ways out
            raise ConfigError(f"{unknown}; {untrusted_hint(untrusted, source)}") from None
        raise ConfigError("\n".join(lines)) from None
    if untrusted and not quiet:
        log.warning("not imported: %s", untrusted_hint(untrusted, source))
    return cfg


def load_config(path: str | Path | None, overrides: Iterable[str] = (), plugins: Iterable[str] = (), *,
                trust_plugins: bool = False) -> RunConfig:
    """Read ``path`` (YAML; None = all defaults), apply overrides, validate. ``plugins`` (files relative to the
    working directory, or module names) are loaded and added to the config's own; the config's own are imported
    only with ``trust_plugins`` (or when ``plugins`` names them too): see :func:`validate_config`."""
    raw: dict[str, Any] = {}
    base_dir = None
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found; pass a YAML file such as configs/quickstart.yaml")
        raw = read_yaml(p)
        if raw is None:  # an empty file (or comments only) would silently run every default
            raise ConfigError(f"{p}: the config file is empty; write the sections to set (task:, model:, peft:, ...), "
                              "e.g. start from configs/quickstart.yaml")
        base_dir = p.parent
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (task:, model:, ...)")
    overrides = list(overrides)
    switched = switched_sections(raw, overrides)
    raw = apply_overrides(raw, overrides)
    return validate_config(raw, base_dir, switched, plugins=plugins, trust_plugins=trust_plugins,
                           source=str(path) if path is not None else "the config")


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
