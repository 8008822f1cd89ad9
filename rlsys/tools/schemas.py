"""The tools' JSON schemas (OpenAI's function format), which a chat template shows the model (`tools=`): the
built-ins' written here, the user's read off each function's signature and docstring (its first paragraph, and
each argument's line under `Args:`), an environment's from its class's `tools` (schemas, or functions to read)."""
from __future__ import annotations

import inspect
import re

from rlsys.config import ToolsConfig
from rlsys.plugins import PluginError, is_spec, load_function

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
BUILTIN = {
    "calculator": ("Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
                   {"expression": "string"}),
    "python": ("Run Python code; the answer is what it printed, ended by its exception if one was raised.",
               {"code": "string"}),
}


def tool_schemas(cfg: ToolsConfig) -> list[dict] | None:
    """One schema per tool of `tools.fns`, in order, then those an environment (tools.env) declares in its class's
    `tools`; None without any (a template then shows none)."""
    schemas = []
    for spec in cfg.fns:
        if is_spec(spec):
            fn = load_function(spec, "tools.fns")
            schemas.append(function_schema(fn, getattr(fn, "__name__", spec.rpartition(":")[2])))
        else:
            description, arguments = BUILTIN[spec]
            schemas.append(_schema(spec, description, {a: {"type": t} for a, t in arguments.items()}, list(arguments)))
    if cfg.env:
        schemas += env_schemas(load_function(cfg.env, "tools.env"), cfg.env) or []
    return schemas or None


def env_schemas(env_class, spec: str) -> list[dict] | None:
    """The schemas an environment shows the model: its class's `tools`, each an OpenAI function schema (a dict) or
    a function read as a user's tool is; None if it declares none."""
    declared = getattr(env_class, "tools", None)
    if declared is None:
        return None
    if not isinstance(declared, (list, tuple)) or not all(isinstance(t, dict) or callable(t) for t in declared):
        raise PluginError(f"tools.env: {spec!r} has `tools` = {declared!r:.100}; it must be a list of schemas "
                          '({"type": "function", "function": {...}}) or of functions')
    return [t if isinstance(t, dict) else function_schema(t, t.__name__) for t in declared] or None


def function_schema(fn, name: str) -> dict:
    """`fn`'s schema: its docstring's first paragraph, its parameters typed by their annotations (a parameter
    without a default is required) and described by their lines under the docstring's `Args:`."""
    described = argument_descriptions(inspect.getdoc(fn) or "")
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = param.annotation
        if isinstance(annotation, str):  # `from __future__ import annotations`
            annotation = {t.__name__: t for t in JSON_TYPES}.get(annotation, annotation)
        properties[param.name] = {"type": JSON_TYPES[annotation]} if annotation in JSON_TYPES else {}
        if param.name in described:
            properties[param.name]["description"] = described[param.name]
        if param.default is param.empty:
            required.append(param.name)
    description = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
    return _schema(name, description, properties, required)


def argument_descriptions(doc: str) -> dict[str, str]:
    """{argument: description} from a docstring's `Args:` section (Google style: `name (type): what it is`, a
    longer description continued on lines indented further)."""
    found, current, indent = {}, None, None
    for line in f"\n{doc}".partition("\nArgs:\n")[2].splitlines():
        if not line.strip():
            break
        depth = len(line) - len(line.lstrip())
        match = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
        if match and (indent is None or depth == indent):
            indent, current = depth, match.group(1)
            found[current] = match.group(2).strip()
        elif current and indent is not None and depth > indent:
            found[current] = f"{found[current]} {line.strip()}".strip()
        else:
            break
    return found


def _schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}
