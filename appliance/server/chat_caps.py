"""What a model's chat template can do with tools, found from the template itself:

- its tool-call format, when it has one (`detect_parser`): the parser that reads the model's
  calls back, for `tool_choice: auto` when `model.tool_call_parser` is not set;
- whether it renders a system message, an assistant turn's `tool_calls` and a `tool` result
  (`template_caps`): probe conversations are rendered once per template and the output
  searched for their marker strings (a template that raises, or drops the marker, cannot);
- `adapt_conversation`: the conversation rewritten for what the template cannot render
  (calls as the generic answer JSON, results as user turns, the tool description in the
  first user turn when there is no system role), so every template takes a tool conversation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from appliance.server.tool_generic import calls_text, tool_result_text


def detect_parser(template: str | None) -> str:
    """The tool-call parser of a template's own call format ("" for none), by the markers
    each family writes for an assistant call (tests/templates hold real examples). A template
    that never reads `tools` cannot offer them in its format: none."""
    if not isinstance(template, str) or "tools" not in template:
        return ""
    if "<tool_call>" in template:
        return "hermes"  # Hermes, Qwen2/2.5/3: <tool_call>{"name", "arguments"}</tool_call>
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or (
        "<|start_header_id|>" in template and "ipython" in template
    ):
        return "llama3_json"  # Llama 3.1+: {"name", "parameters"}, tool results as ipython
    return ""


@dataclass(frozen=True)
class TemplateCaps:
    system: bool = True
    tool_calls: bool = True
    tool_role: bool = True


_SYS = "zq-system-probe"
_FN = "zq_probe_function"
_RESULT = "zq-tool-result-probe"
_ROLE = "zqproberole"
_PROBE_CALL = {
    "id": "call12345",
    "type": "function",  # 9 characters: Mistral's rule
    "function": {"name": _FN, "arguments": {"zq_arg": "x"}},
}
_cache: dict[str, TemplateCaps] = {}
_lock = threading.Lock()


def _render(tok: Any, template: str, convo: list[dict[str, Any]]) -> str | None:
    try:
        return str(
            tok.apply_chat_template(
                convo, chat_template=template, add_generation_prompt=False, tokenize=False
            )
        )
    except Exception:  # noqa: BLE001 - a template that raises cannot render this
        return None


def _probe(tok: Any, template: str) -> TemplateCaps:
    user = {"role": "user", "content": "hi"}
    out = _render(tok, template, [{"role": "system", "content": _SYS}, user])
    system = out is not None and _SYS in out
    call = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
    out = _render(tok, template, [user, call])
    tool_calls = out is not None and _FN in out
    before = [user, call if tool_calls else {"role": "assistant", "content": "ok"}]
    result = {"role": "tool", "tool_call_id": "call12345", "content": _RESULT}
    out = _render(tok, template, [*before, result])
    tool_role = out is not None and _RESULT in out
    if tool_role:
        # A template that writes any role's name as is (ChatML) has no tool role of its own:
        # `<|im_start|>tool` is a turn the model never saw. It renders "tool" exactly as an
        # invented role.
        other = _render(tok, template, [*before, {**result, "role": _ROLE}])
        tool_role = other is None or other.replace(_ROLE, "tool") != out
    return TemplateCaps(system, tool_calls, tool_role)


def template_caps(tok: Any) -> TemplateCaps:
    """The capabilities of `tok`'s chat template, probed once per template text."""
    template = getattr(tok, "chat_template", None)
    if not isinstance(template, str):
        return TemplateCaps()  # none or several named templates: render as given
    caps = _cache.get(template)
    if caps is None:
        caps = _probe(tok, template)
        with _lock:
            _cache[template] = caps
    return caps


def adapt_conversation(
    convo: list[dict[str, Any]], caps: TemplateCaps, preamble: str = "", parallel: bool = True
) -> list[dict[str, Any]]:
    """`convo` (message dicts as the template takes them) rewritten for what the template
    cannot render; `preamble` (the generic tool description) goes into the system message, or
    the first user turn without a system role."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, for the results
    for msg in convo:
        msg = dict(msg)
        calls = msg.get("tool_calls")
        if calls:
            names.update({c["id"]: c["function"]["name"] for c in calls if c.get("id")})
            if not caps.tool_calls:
                text = calls_text(calls, parallel)
                msg.pop("tool_calls")
                msg["content"] = f"{msg['content']}\n{text}" if msg.get("content") else text
        if msg["role"] == "tool" and not caps.tool_role:
            call_id = msg.pop("tool_call_id", None)
            text = tool_result_text(msg.get("content") or "", names.get(call_id or ""), call_id)
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + text  # several results: one user turn
                continue
            msg = {"role": "user", "content": text, "_results": True}
        out.append(msg)
    for msg in out:
        msg.pop("_results", None)
    if not preamble:
        return out
    if caps.system:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": preamble})
        return out
    # No system role: the system messages' text and the tool description open the first user
    # turn (a template that raises on "system" would refuse those messages anyway).
    lead = [m["content"] for m in out if m["role"] == "system" and m["content"]]
    rest = [m for m in out if m["role"] != "system"]
    head = "\n\n".join([*lead, preamble])
    for i, m in enumerate(rest):
        if m["role"] == "user":
            rest[i] = {**m, "content": f"{head}\n\n{m['content']}" if m["content"] else head}
            return rest
    return [{"role": "user", "content": head}, *rest]
