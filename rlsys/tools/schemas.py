"""The tools' JSON schemas (OpenAI's function format), which a chat template shows the model (`tools=`): the
built-ins' written here, the user's read off each function's signature and docstring."""
from __future__ import annotations

import inspect

from rlsys.config import ToolsConfig
from rlsys.plugins import is_spec, load_function

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
BUILTIN = {
    "calculator": ("Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
                   {"expression": "string"}),
    "python": ("Run Python code; the answer is what it printed, ended by its exception if one was raised.",
               {"code": "string"}),
}


def tool_schemas(cfg: ToolsConfig) -> list[dict] | None:
    """One schema per tool of `tools.fns`, in order; None without tools (a template then shows none)."""
    if not cfg.fns:
        return None
    schemas = []
    for spec in cfg.fns:
        if is_spec(spec):
            fn = load_function(spec, "tools.fns")
            schemas.append(function_schema(fn, getattr(fn, "__name__", spec.rpartition(":")[2])))
        else:
            description, arguments = BUILTIN[spec]
            schemas.append(_schema(spec, description, {a: {"type": t} for a, t in arguments.items()}, list(arguments)))
    return schemas


def function_schema(fn, name: str) -> dict:
    """`fn`'s schema: its docstring's first paragraph, its parameters typed by their annotations (a parameter
    without a default is required)."""
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = param.annotation
        if isinstance(annotation, str):  # `from __future__ import annotations`
            annotation = {t.__name__: t for t in JSON_TYPES}.get(annotation, annotation)
        properties[param.name] = {"type": JSON_TYPES[annotation]} if annotation in JSON_TYPES else {}
        if param.default is param.empty:
            required.append(param.name)
    description = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
    return _schema(name, description, properties, required)


def _schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}
