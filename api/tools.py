"""Tool calling at the gateway: the request's tools, their rendering, and forced calls.

- `chat_tools` / `responses_tools` read `tools` and `tool_choice` into a `ToolPlan`
  (Responses' flat function tools become chat's nested ones).
- `render_messages` turns chat messages with `tool_calls` and `role: tool` results into
  what the chat template renders: a template that mentions `tools` gets them as
  transformers passes them (`tools=[...]`, arguments as objects); any other template gets
  the default rendering, a system block in the Hermes style listing the functions and
  asking for calls in the served model's parser format, prior calls written in that
  format and results as `<tool_response>` user turns.
- `tool_choice` `required` or a named function adds a Lark grammar (llguidance's
  `%json`) that admits only well-formed calls in that format; `auto` constrains nothing
  and `none` still renders the tools but reads no calls back (vLLM's behaviour).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sluice.api.errors import InvalidRequest
from sluice.bus.messages import StructuredSpec

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's tools (chat's shape: `{"type": "function", "function": {...}}`)."""

    tools: list[dict[str, Any]]
    choice: str  # none | auto | required | function
    function: str | None = None  # the named function of choice "function"
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")


def _invalid(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param, code="invalid_value")


def _function(fn: Any, param: str) -> dict[str, Any]:
    if not isinstance(fn, dict):
        raise _invalid(param, "must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _invalid(f"{param}.name", "must be 1 to 64 letters, digits, '_', '.' or '-'")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise _invalid(f"{param}.parameters", "must be a JSON schema object")
    out: dict[str, Any] = {"name": name}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    out["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    if fn.get("strict") is not None:
        out["strict"] = bool(fn["strict"])
    return out


def _plan(
    tools: list[dict[str, Any]], choice: Any, named: str | None, parallel: bool | None
) -> ToolPlan:
    names = {t["function"]["name"] for t in tools}
    if choice is None:
        choice = "auto" if tools else "none"
    if choice in ("required", "function") and not tools:
        raise _invalid("tool_choice", f"{choice!r} needs tools")
    if named is not None and named not in names:
        raise _invalid("tool_choice", f"names the function {named!r}, which is not in tools")
    return ToolPlan(tools, choice, named, parallel is not False)


def chat_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Chat's `tools` and `tool_choice` (400s name the field)."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _invalid(f"tools[{i}].type", "only function tools are supported")
        out.append(
            {
                "type": "function",
                "function": _function(tool.get("function"), f"tools[{i}].function"),
            }
        )
    choice, named = _choice(tool_choice, nested=True)
    return _plan(out, choice, named, parallel)


def responses_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Responses' flat function tools (`{"type": "function", "name", ...}`)."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequest(
                f"tools[{i}].type: only function tools are supported, got {kind!r}",
                param=f"tools[{i}].type",
                code="unsupported_parameter",
            )
        out.append({"type": "function", "function": _function(tool, f"tools[{i}]")})
    choice, named = _choice(tool_choice, nested=False)
    return _plan(out, choice, named, parallel)


def _choice(value: Any, nested: bool) -> tuple[str | None, str | None]:
    if value is None or value in ("none", "auto", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function") if nested else value
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            field = "tool_choice.function.name" if nested else "tool_choice.name"
            raise _invalid(field, "must name a function")
        return "function", name
    raise _invalid("tool_choice", 'must be "none", "auto", "required" or a function')


# -- history -------------------------------------------------------------------------------
def call_history(tool_calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked: [{id, name, arguments (JSON text)}]."""
    if not isinstance(tool_calls, list):
        raise _invalid(param, "must be a list")
    out = []
    for i, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _invalid(f"{param}[{i}].function.name", "must be a string")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append({"id": str(call.get("id") or ""), "name": fn["name"], "arguments": args})
    return out


def _arguments_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def render_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, family: str, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages for the chat template and its extra variables.

    `messages` hold role, content (text), and for an assistant `tool_calls` (from
    `call_history`), for a tool result `tool_call_id` and maybe `name`.
    """
    tools = plan.tools if plan is not None else []
    if template_takes_tools(template):
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {
                            "name": c["name"],
                            "arguments": _arguments_object(c["arguments"]),
                        },
                    }
                    for c in m["tool_calls"]
                ]
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):  # one user turn for consecutive results
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
            continue
        content = m["content"]
        if m.get("tool_calls"):
            calls = write_calls(family, [(c["name"], c["arguments"]) for c in m["tool_calls"]])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m["role"], "content": content})
    for m in out:
        m.pop("_tool_turn", None)
    if tools:
        block = tools_system_block(tools, family)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, {}


def write_calls(family: str, calls: list[tuple[str, str]], compact: bool = False) -> str:
    """Calls as the model writes them in `family`'s format (arguments are JSON text);
    `compact`: JSON without blanks, as the forced-call grammar has it."""
    key = "parameters" if family == "llama3_json" else "arguments"
    sep = ":" if compact else ": "
    objs = [
        f'{{"name"{sep}{json.dumps(name)},{"" if compact else " "}"{key}"{sep}{args or "{}"}}}'
        for name, args in calls
    ]
    if family == "llama3_json":
        return "; ".join(objs)
    if family == "mistral":
        return "[TOOL_CALLS][" + ", ".join(objs) + "]"
    return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)


_EXAMPLE = {
    "hermes": "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    "llama3_json": '{"name": <function-name>, "parameters": <args-json-object>}',
    "mistral": '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]',
}


def tools_system_block(tools: list[dict[str, Any]], family: str) -> str:
    """The default rendering's system text (Hermes' function-calling prompt)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You are a function calling AI model. You are provided with function signatures "
        "within <tools></tools> XML tags. You may call one or more functions to assist "
        "with the user query. Don't make assumptions about what values to plug into "
        f"functions. Here are the available tools:\n<tools>\n{listed}\n</tools>\n"
        "For each function call, return a JSON object with the function name and "
        f"arguments as follows:\n{_EXAMPLE[family]}\n"
        "Function results come back within <tool_response></tool_response> XML tags."
    )


# -- forced calls --------------------------------------------------------------------------
MAX_FORCED_CALLS = 4  # calls one turn may hold under tool_choice "required"


def call_schema(plan: ToolPlan, family: str) -> dict[str, Any]:
    """The JSON schema of one call allowed by `plan` (one function, or any of them)."""
    key = "parameters" if family == "llama3_json" else "arguments"
    shapes = []
    defs: dict[str, Any] = {}
    for tool in plan.tools:
        fn = tool["function"]
        if plan.choice == "function" and fn["name"] != plan.function:
            continue
        shapes.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, key: _lift_defs(fn, defs)},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    if defs:
        schema = {**schema, "$defs": defs}
    # compact JSON, as the engine's own JSON constraints: free whitespace lets a weak
    # model spin in blanks until max_tokens
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def _lift_defs(fn: dict[str, Any], defs: dict[str, Any]) -> Any:
    """`fn`'s parameters with their `$defs` (or `definitions`) moved into `defs` under
    names prefixed by the function's, and their `#/$defs/...` references rewritten: the
    parameters sit inside the call's schema, where a reference from the root would not
    resolve (pydantic writes nested models as such references)."""
    params = fn["parameters"]
    if not isinstance(params, dict):
        return params
    own = {**params.get("definitions", {}), **params.get("$defs", {})}
    if not own:
        return params
    prefix = f"{fn['name']}__"

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
        ref = out.get("$ref")
        if isinstance(ref, str):
            for base in ("#/$defs/", "#/definitions/"):
                if ref.startswith(base):
                    out["$ref"] = "#/$defs/" + prefix + ref[len(base) :]
        return out

    for name, sub in own.items():
        defs[prefix + name] = rewrite(sub)
    return rewrite(params)


def call_grammar(plan: ToolPlan, family: str) -> StructuredSpec:
    """A Lark grammar (llguidance dialect) admitting one call, or up to `MAX_FORCED_CALLS`
    for `required` when `parallel_tool_calls` allows, in `family`'s format, and nothing
    else."""
    schema = json.dumps(call_schema(plan, family), separators=(",", ":"))
    separator = {"hermes": '"\\n"', "llama3_json": '"; "', "mistral": '", "'}[family]
    # a named function is called once (as vLLM forces it); `required` with parallel calls
    # allows a few, since a weak model forced to call repeats its call until max_tokens
    more = MAX_FORCED_CALLS - 1 if plan.parallel and plan.choice != "function" else 0
    body = "call" + f" ({separator} call)?" * more
    if family == "hermes":
        call = f'call: "<tool_call>\\n" %json{schema} "\\n</tool_call>"'
    else:
        call = f"call: %json{schema}"
    start = f'start: "[TOOL_CALLS][" {body} "]"' if family == "mistral" else f"start: {body}"
    return StructuredSpec(kind="grammar", value=f"{start}\n{call}\n")
