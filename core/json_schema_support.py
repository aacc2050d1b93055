"""Which JSON Schema keywords the structured-output grammars can enforce.

xgrammar compiles a JSON schema into a grammar, and silently ignores the keywords it cannot express
(a `not`, an `if`/`then`/`else`, `uniqueItems`, ...): generation would then follow a looser schema
than the one asked for, with no error. `unsupported_keyword` finds the first such keyword (with
its place in the schema), so that the request is refused with a message naming it instead. The
list was found by compiling, with xgrammar 0.2.9, a schema using each keyword and checking whether
an instance violating it is rejected (`patternProperties` rejected valid instances too).
Annotations (`title`, `description`, `default`, `examples`, unknown `format`s, ...) constrain
nothing and are accepted.
"""
from __future__ import annotations

from typing import Any

#: keyword -> what it would have enforced
UNSUPPORTED_KEYWORDS: dict[str, str] = {
    "not": "a schema the value must not match",
    "if": "a conditional schema",
    "then": "a conditional schema",
    "else": "a conditional schema",
    "uniqueItems": "distinct array items",
    "contains": "an array item matching a schema",
    "minContains": "a least number of matching array items",
    "maxContains": "a largest number of matching array items",
    "dependentRequired": "properties required by another property",
    "dependentSchemas": "schemas applied when a property is present",
    "dependencies": "properties or schemas required by another property",
    "patternProperties": "schemas for properties whose names match a pattern",
    "$dynamicRef": "a dynamic reference",
    "$recursiveRef": "a recursive reference",
}

# keywords whose value is one subschema / a list of them / a map of name -> subschema
_SUBSCHEMA = ("additionalProperties", "items", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def unsupported_keyword(schema: Any, where: str = "schema") -> str | None:
    """The first keyword of `schema` (or of a subschema) the grammar cannot enforce, as a message
    naming it and where it is; None when every constraint can be enforced."""
    stack: list[tuple[Any, str]] = [(schema, where)]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for keyword, meaning in UNSUPPORTED_KEYWORDS.items():
            if keyword in node:
                return (f"{path}: the JSON schema keyword '{keyword}' ({meaning}) cannot be enforced by "
                        f"the structured-output grammar; remove it from the schema (and check the value "
                        f"yourself), or express the constraint with other keywords")
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return (f"{path}: 'allOf' with {len(all_of)} schemas cannot be enforced by the structured-output "
                    f"grammar (only one); merge them into one schema")
        for key in _SUBSCHEMA:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{path}.{key}"))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack += [(sub, f"{path}.{key}.{i}") for i, sub in enumerate(node[key])]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack += [(sub, f"{path}.{key}.{name}") for name, sub in node[key].items()]
    return None
