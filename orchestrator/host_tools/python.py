"""Host tools from Python callables: the schema comes from the signature, the words from the
docstring (Google, NumPy or Sphinx style, read by griffe), as the OpenAI Agents SDK and LangChain
derive theirs. Sync callables run in a thread of their own, so a slow one blocks no other call.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, get_type_hints

import griffe
from pydantic import BaseModel, ConfigDict, PrivateAttr, TypeAdapter, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from orchestrator.host_tools.base import HostTool, ToolInputError
from orchestrator.http_errors import problems

# Sync tools wait here, not in the event loop's small default pool.
_THREADS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="host-tool")
_NO_RETURN_SCHEMA = (inspect.Signature.empty, None, type(None), Any)


class PythonTool(HostTool):
    """A host tool that calls a Python function."""

    _fn: Callable[..., Any] = PrivateAttr()
    _model: type[BaseModel] = PrivateAttr()
    _positional: tuple[str, ...] = PrivateAttr(default=())
    _is_async: bool = PrivateAttr(default=False)

    async def call(self, arguments: dict[str, Any]) -> Any:
        try:
            parsed = self._model.model_validate(arguments)
        except ValidationError as exc:
            raise ToolInputError(_explain(exc)) from None
        values = {name: getattr(parsed, name) for name in type(parsed).model_fields}
        args = [values.pop(name) for name in self._positional]
        if self._is_async:
            return await self._fn(*args, **values)
        run = functools.partial(contextvars.copy_context().run, self._fn, *args, **values)
        return await asyncio.get_running_loop().run_in_executor(_THREADS, run)


def function_tool(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    requires_approval: bool = False,
) -> PythonTool:
    """Make a host tool of `fn` (sync or async): its parameters, with their types, defaults and
    docstring descriptions, become the JSON schema the sandbox's calls are checked against.
    `requires_approval`: each call waits for a human's yes (docs/governance.md)."""
    signature = inspect.signature(fn)
    target = fn.func if isinstance(fn, functools.partial) else fn
    try:
        hints = get_type_hints(target, include_extras=True)
    except Exception:  # an annotation that cannot be resolved: take them as written
        hints = dict(getattr(target, "__annotations__", {}))
    text, param_docs, returns_doc = _read_docstring(inspect.getdoc(target) or "")
    fields: dict[str, Any] = {}
    positional: list[str] = []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(
                f"{_label(fn)}: *{param.name} and **{param.name} cannot be described by a "
                "schema; give the tool named parameters"
            )
        if param.kind is param.POSITIONAL_ONLY:
            positional.append(param.name)
        hint = hints.get(param.name, Any)
        default = PydanticUndefined if param.default is param.empty else param.default
        fields[param.name] = (
            hint,
            FieldInfo(default=default, description=param_docs.get(param.name)),
        )
    tool_name = name or getattr(target, "__name__", None) or "tool"
    model = create_model(f"{tool_name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
    schema = _without_titles(model.model_json_schema())
    returns = _returns_schema(hints.get("return", inspect.Signature.empty), returns_doc)
    tool = PythonTool(
        name=tool_name,
        description=description if description is not None else text,
        parameters=schema,
        returns=returns,
        timeout_s=timeout_s,
        requires_approval=requires_approval,
    )
    tool._fn = fn
    tool._model = model
    tool._positional = tuple(positional)
    tool._is_async = inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    )
    return tool


def _read_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """The text, each parameter's description and the returns' description, whatever the style."""
    if not doc:
        return "", {}, None
    griffe_log = logging.getLogger("griffe")
    level = griffe_log.level
    griffe_log.setLevel(logging.ERROR)  # it warns about every missing annotation
    try:
        sections = griffe.Docstring(doc, lineno=1).parse(griffe.Parser.auto)
    finally:
        griffe_log.setLevel(level)
    text: list[str] = []
    params: dict[str, str] = {}
    returns: str | None = None
    for section in sections:
        kind = section.kind
        if kind is griffe.DocstringSectionKind.text:
            text.append(str(section.value))
        elif kind is griffe.DocstringSectionKind.parameters:
            params.update({p.name: p.description for p in section.value if p.description})
        elif kind is griffe.DocstringSectionKind.returns:
            returns = " ".join(r.description for r in section.value if r.description) or None
    return "\n\n".join(text).strip(), params, returns


def _returns_schema(hint: Any, description: str | None) -> dict[str, Any] | None:
    schema: dict[str, Any] = {}
    if hint not in _NO_RETURN_SCHEMA:
        try:
            schema = _without_titles(TypeAdapter(hint).json_schema())
        except Exception:  # not a type pydantic can describe: the name is still worth having
            schema = {}
    if description:
        schema["description"] = description
    return schema or None


def _without_titles(node: Any) -> Any:
    """pydantic titles every field after its name: noise for a model reading the schema."""
    if isinstance(node, dict):
        if isinstance(node.get("title"), str):
            node.pop("title")
        for key, value in node.items():
            if key in ("properties", "$defs", "definitions", "patternProperties"):
                for sub in value.values():
                    _without_titles(sub)
            elif key in ("items", "additionalProperties", "not", "contains"):
                _without_titles(value)
            elif key in ("anyOf", "allOf", "oneOf", "prefixItems"):
                for sub in value:
                    _without_titles(sub)
    return node


def _explain(exc: ValidationError) -> str:
    return problems(exc.errors(), whole="arguments")


def _label(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
