"""A params key is declared once: `key(...)` keeps its JSON-schema rules, default and description in the metadata of a
typed section's dataclass field, and the field's annotation gives its type. `Section.from_dict` checks a params dict
against those fields; iclnoise.config.schema writes params.schema.yaml from them (`iclnoise schema`).
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

SEED_MAX = 2**32 - 1   # seeds are uint32
M_MAX = 2**20          # largest finite task-pool size
M_ITEM = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": M_MAX}, {"type": "string", "enum": ["inf"]}]}
NAME = "^[a-z0-9_]{1,32}$"   # a noise condition's name

_BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


class ParamsError(ValueError):
    """An invalid parameter; the message names the key and the allowed values."""


def key(*, doc: str | None = None, default: Any = dataclasses.MISSING, optional: bool = False, null: bool = False,
        schema: dict | None = None, **rules: Any) -> Any:
    """A params key. `doc`: its description. `rules`: its JSON-schema keywords beyond the type (`ge`, `gt`, `le`,
    `lt` for the bounds; `enum`, `items`, `minItems`, `pattern`, ... as JSON Schema spells them). `schema`: the
    key's whole schema where the annotation cannot say it (anyOf, oneOf); `doc` and `default` are added to it.

    A key is required unless it has a `default` (its value when absent, the schema's `default:`) or is `optional`
    (it may be absent: None, and `doc` says what that means). `null`: null is allowed, and means what `doc` says.
    The field's Python default is `default`, else None where the key may be absent or null."""
    required = default is dataclasses.MISSING and not optional
    py = default if default is not dataclasses.MISSING else None if optional or null else dataclasses.MISSING
    meta = {"doc": doc, "default": default, "required": required, "null": null, "schema": schema,
            "rules": {_BOUNDS.get(k, k): v for k, v in rules.items()}}
    return dataclasses.field(default=py, metadata={"key": meta})


def seeds(doc: str, optional: bool = True) -> Any:
    """A key listing seeds (may be absent unless not `optional`)."""
    return key(doc=doc, optional=optional, minItems=1, items={"type": "integer", "minimum": 0, "maximum": SEED_MAX})


def meta(f: dataclasses.Field) -> dict:
    """The key(...) declaration of a field."""
    return f.metadata["key"]


def union(tp: Any) -> tuple:
    """The members of a union annotation, None's type left out; (tp,) for any other."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return tuple(t for t in typing.get_args(tp) if t is not type(None))
    return (tp,)


def section_type(tp: Any) -> type[Section] | None:
    """The Section class a field holds (`X` or `X | None`), else None."""
    ts = union(tp)
    return ts[0] if len(ts) == 1 and isinstance(ts[0], type) and issubclass(ts[0], Section) else None


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass's fields."""
    h = typing.get_type_hints(cls)
    return {f.name: h[f.name] for f in dataclasses.fields(cls)}


_AT: dict[str, list[type]] = {}   # section path -> the classes declaring its keys (a typed section, its params form)


@dataclass(frozen=True)
class Section:
    """Base of the typed sections: `from_dict` builds one from its params.yaml dict, checking the keys against the
    fields. A class whose params.yaml section holds keys the code reads elsewhere (the workflow's `enabled`,
    `every`, `seeds`) has a subclass declaring them, for the same SECTION: `from_dict` accepts and ignores those."""
    SECTION: ClassVar[str] = ""   # dotted path of the section in params.yaml
    SCHEMA: ClassVar[str] = ""    # its path with * for a mapping's values, when it differs (noise conditions)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.SECTION:
            _AT.setdefault(cls.SCHEMA or cls.SECTION, []).append(cls)

    @classmethod
    def from_dict(cls, d: dict | None):
        """The section from its dict; a ParamsError names an unknown or a missing key. Fields holding a section are
        built with its from_dict; a key that may be absent is None when it is."""
        name = cls.SECTION
        if not isinstance(d, dict):
            raise ParamsError(f"{name}: expected a mapping of keys, got {d!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        allowed = set(fields).union(*({f.name for f in dataclasses.fields(c)} for c in declared(cls)))
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ParamsError(f"{name}: unknown key(s) {', '.join(map(str, unknown))}; allowed: "
                              f"{', '.join(sorted(allowed))}")
        required = [k for k, f in fields.items() if meta(f)["required"]]
        missing = [k for k in required if k not in d]
        if missing:
            raise ParamsError(f"{name}.{missing[0]} is missing; {name} needs the keys {', '.join(required)} "
                              f"(params.yaml is the single source of truth: no value is filled in)")
        h = hints(cls)
        return cls(**{k: sub.from_dict(v) if v is not None and (sub := section_type(h[k])) else v
                      for k, v in d.items() if k in fields})


def declared(cls: type[Section]) -> list[type[Section]]:
    """The classes declaring keys of `cls`'s section (itself and its params form)."""
    return _AT.get(cls.SCHEMA or cls.SECTION, [cls])


def schema_default(path: str, name: str) -> Any:
    """The `default:` declared for key `name` of section `path` ("llc.sampler"); KeyError if it has none."""
    for c in _AT.get(path, ()):
        for f in dataclasses.fields(c):
            if f.name == name and meta(f)["default"] is not dataclasses.MISSING:
                return meta(f)["default"]
    raise KeyError(f"{path}.{name} has no default")
