"""The JSON Schema of each vector function's cases, and a small validator for it.

Every vector function declares the JSON shape of its inputs and outputs (`registry.Fn`'s
`inputs`, `outputs`, `tensor_inputs`, `tensor_outputs`) with the helpers below; `case_schema`
turns that into a JSON Schema (draft 2020-12) of the function's `case.json`, written beside its
cases as `schema.json`. A consumer may validate case files with any JSON Schema validator;
`errors` here is a small one for exactly the keywords these schemas use (type, const, enum,
anyOf, properties, required, additionalProperties, patternProperties, maxProperties, items,
prefixItems, minItems, maxItems, if/then/else), so raggedspec needs no extra dependency.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DRAFT = "https://json-schema.org/draft/2020-12/schema"
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
STR = {"type": "string"}
NUM = {"type": "number"}
NULL = {"type": "null"}
REFUSAL_CLASSES = (
    "CacheRefusal",
    "AlignRefusal",
    "DispatchRefusal",
    "MaskRefusal",
    "CapabilityRefusal",
    "StepRefusal",
    "SchedulerRefusal",
)


@dataclass(frozen=True)
class Maybe:
    """A property that a case may leave out (every other declared property is required)."""

    schema: dict


def opt(schema: dict) -> dict:
    """`schema` or null."""
    return {"anyOf": [schema, NULL]}


def arr(schema: dict) -> dict:
    """A list of `schema` items."""
    return {"type": "array", "items": schema}


def tup(*schemas: dict) -> dict:
    """A fixed-length list whose i-th item is `schemas[i]`."""
    n = len(schemas)
    return {
        "type": "array",
        "prefixItems": list(schemas),
        "items": False,
        "minItems": n,
        "maxItems": n,
    }


def enum(*values) -> dict:
    """One of `values`."""
    return {"enum": list(values)}


def doc(schema: dict, text: str) -> dict:
    """`schema` with a description."""
    return dict(schema, description=text)


def tensor(dtype: str, rank: int | None = None) -> dict:
    """A tensor declaration: safetensors dtype code (`F64`, `I64`) and rank (None: any)."""
    return {"dtype": dtype, "rank": rank}


def _pattern(name: str) -> str:
    """`k.<i>` -> a regex matching `k.0`, `k.1`, ...; a plain name -> itself."""
    return "^" + re.escape(name).replace(re.escape("<i>"), "[0-9]+") + "$"


def obj(props: dict, closed: bool = True) -> dict:
    """An object with `props` (a `Maybe` value is optional; a `<i>` name is a pattern)."""
    fixed = {k: v for k, v in props.items() if "<i>" not in k}
    pattern = {_pattern(k): v for k, v in props.items() if "<i>" in k}
    out = {
        "type": "object",
        "properties": {k: v.schema if isinstance(v, Maybe) else v for k, v in fixed.items()},
        "required": sorted(k for k, v in fixed.items() if not isinstance(v, Maybe)),
        "additionalProperties": not closed,
    }
    if pattern:
        out["patternProperties"] = {
            k: v.schema if isinstance(v, Maybe) else v for k, v in pattern.items()
        }
    return out


def _tensor_meta(decl: dict, with_compare: bool) -> dict:
    shape = arr(INT)
    if decl["rank"] is not None:
        shape = dict(shape, minItems=decl["rank"], maxItems=decl["rank"])
    props = {"dtype": {"const": decl["dtype"]}, "shape": shape}
    if with_compare:
        props["compare"] = enum("exact", "close")
    meta = obj(props)
    return doc(meta, decl["description"]) if "description" in decl else meta


def _tensors(decls: dict, with_compare: bool) -> dict:
    """The `tensor_inputs` / `tensor_outputs` object: every declared tensor may be absent (a
    slot with no buffer, an optional input), none undeclared may appear."""
    return obj({k: Maybe(_tensor_meta(v, with_compare)) for k, v in decls.items()})


EMPTY = {"type": "object", "maxProperties": 0}
RAISES = obj(
    {
        "kind": enum("refusal", "malformed"),
        "class": enum(*REFUSAL_CLASSES, "ValueError"),
        "message": STR,
        "values": doc(
            arr({"anyOf": [INT, STR]}),
            "the values the message names: each integer and each `backticked` name, in order",
        ),
    }
)


def case_schema(fn, schema_version: int) -> dict:
    """The JSON Schema of `fn`'s case.json: its declared inputs always, its declared outputs
    when `expect` is "outputs", an empty `outputs` and a `raises` object otherwise."""
    outputs = {
        "properties": {
            "outputs": obj(fn.outputs),
            "tensor_outputs": _tensors(fn.tensor_outputs, True),
            "raises": NULL,
        }
    }
    raised = {"properties": {"outputs": EMPTY, "tensor_outputs": EMPTY, "raises": RAISES}}
    case = obj(
        {
            "schema_version": {"const": schema_version},
            "family": {"const": fn.family},
            "function": {"const": fn.name},
            "case": STR,
            "spec": {"const": fn.spec},
            "inputs": obj(fn.inputs),
            "tensor_inputs": _tensors(fn.tensor_inputs, False),
            "expect": enum("outputs", "refusal", "malformed"),
            "outputs": {"type": "object"},
            "tensor_outputs": {"type": "object"},
            "raises": {"anyOf": [NULL, {"type": "object"}]},
            "policy": arr(enum(*fn.policy, "raises")),
            "tolerance": Maybe({"type": "object"}),
        }
    )
    return {
        "$schema": DRAFT,
        "title": f"{fn.key} case",
        "description": f"One case.json of {fn.key} ({fn.spec}; pins {fn.reference}).",
        **case,
        "if": {"properties": {"expect": {"const": "outputs"}}},
        "then": outputs,
        "else": raised,
    }


# ------------------------------------------------------------------------------ validator

_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _object_errors(value: dict, schema: dict, where: str) -> list[str]:
    out = [f"{where}: no `{k}`" for k in schema.get("required", []) if k not in value]
    if len(value) > schema.get("maxProperties", len(value)):
        out.append(f"{where}: more than {schema['maxProperties']} properties")
    props, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    for k, v in value.items():
        subs = [props[k]] if k in props else [s for p, s in patterns.items() if re.search(p, k)]
        extra = schema.get("additionalProperties", True)
        if not subs and extra is False:
            out.append(f"{where}: `{k}` is not declared")
        subs = subs or ([extra] if isinstance(extra, dict) else [])
        for sub in subs:
            out += errors(v, sub, f"{where}.{k}")
    return out


def _array_errors(value: list, schema: dict, where: str) -> list[str]:
    out = []
    if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
        out.append(f"{where}: {len(value)} items")
    head = schema.get("prefixItems", [])
    for i, (v, sub) in enumerate(zip(value, head, strict=False)):
        out += errors(v, sub, f"{where}[{i}]")
    rest = schema.get("items", True)
    for i, v in enumerate(value[len(head):], len(head)):
        if rest is False:
            out.append(f"{where}[{i}]: not allowed")
        elif isinstance(rest, dict):
            out += errors(v, rest, f"{where}[{i}]")
    return out


def errors(value, schema: dict | bool, where: str = "$") -> list[str]:
    """Where `value` (parsed JSON) breaks `schema`: a list of "PATH: problem" lines, empty
    when it conforms. Covers the keywords `case_schema` writes (see the module docstring);
    `integer` excludes booleans and floats, as the vectors' comparison does."""
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [f"{where}: not allowed"]
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not any(_TYPES[t](value) for t in names):
            return [f"{where}: {value!r:.60} is not of type {types}"]
    if "const" in schema and not _same(value, schema["const"]):
        return [f"{where}: {value!r:.60} is not {schema['const']!r}"]
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return [f"{where}: {value!r:.60} is not one of {schema['enum']}"]
    if "anyOf" in schema and all(errors(value, s, where) for s in schema["anyOf"]):
        return [f"{where}: {value!r:.60} matches none of anyOf"]
    out = []
    if "if" in schema:
        branch = "then" if not errors(value, schema["if"], where) else "else"
        out += errors(value, schema.get(branch, True), where)
    if isinstance(value, dict):
        out += _object_errors(value, schema, where)
    elif isinstance(value, list):
        out += _array_errors(value, schema, where)
    return out


def _same(a, b) -> bool:
    """JSON equality with types: True is not 1, 1 is not 1.0."""
    return type(a) is type(b) and a == b
