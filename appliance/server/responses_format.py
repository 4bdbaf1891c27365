"""Engine outputs -> Responses API objects: the response (output items, status, usage) and the
streamed event sequence, over the same Generation and tool plan chat uses.

The stream: response.created, response.in_progress, then per output item
response.output_item.added, (a message) response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done, (a
function call) response.function_call_arguments.delta..., ...arguments.done, then
response.output_item.done; last response.completed, whose response says `incomplete` when
max_output_tokens cut it (as vLLM does: the SDK's `responses.stream` helper ends only on
response.completed). Every event carries its sequence_number, from 0.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import msgspec

from appliance.engine.outputs import RequestOutput
from appliance.server import responses_schema as rs
from appliance.server import schemas as s
from appliance.server.format import assistant_message, usage
from appliance.server.generate import Choice, Generation
from appliance.server.scoring import ResponsePlan
from appliance.server.tool_calls import ToolStream

_encode = msgspec.json.Encoder().encode


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def response_usage(gen: Generation, plan: ResponsePlan) -> rs.ResponseUsage:
    u = usage(gen, plan)
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return rs.ResponseUsage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=rs.InputTokensDetails(cached),
        output_tokens=u.completion_tokens,
        output_tokens_details=rs.OutputTokensDetails(),
        total_tokens=u.total_tokens,
    )


def finished(
    skeleton: rs.ResponseObject,
    output: list[rs.OutputItem],
    reason: str | None,
    gen: Generation,
    plan: ResponsePlan,
) -> rs.ResponseObject:
    """The final response object: completed, or incomplete when max_output_tokens cut it."""
    cut = reason == "length"
    return msgspec.structs.replace(
        skeleton,
        status="incomplete" if cut else "completed",
        incomplete_details=rs.IncompleteDetails("max_output_tokens") if cut else None,
        output=output,
        usage=response_usage(gen, plan),
        completed_at=None if cut else skeleton.created_at,
    )


def output_items(message: s.ResponseMessage) -> list[rs.OutputItem]:
    """A chat assistant message as output items: its text (when any, or when there is
    nothing else) as one message item, then one function_call item per tool call."""
    items: list[rs.OutputItem] = []
    if message.content or not message.tool_calls:
        text = rs.OutputText(text=message.content or "")
        items.append(rs.OutputMessage(id=item_id("msg"), status="completed", content=[text]))
    for call in message.tool_calls:
        items.append(
            rs.FunctionCallItem(
                id=item_id("fc"),
                call_id=call.id,
                name=call.function.name,
                arguments=call.function.arguments,
                status="completed",
            )
        )
    return items


def response_body(
    skeleton: rs.ResponseObject, gen: Generation, plan: ResponsePlan
) -> rs.ResponseObject:
    ch = gen.choices[0]  # a response has one choice (n = 1)
    message, reason = assistant_message(ch, plan)
    return finished(skeleton, output_items(message), reason, gen, plan)


def conversation_of(output: list[rs.OutputItem]) -> list[s.ChatMessage]:
    """The output items as the chat messages a continuation replays."""
    text = "".join(
        part.text for item in output if isinstance(item, rs.OutputMessage) for part in item.content
    )
    calls = [
        {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        for item in output
        if isinstance(item, rs.FunctionCallItem)
    ]
    return [s.ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)]


def event_bytes(event: rs.StreamEvent) -> bytes:
    return b"event: " + event.type.encode() + b"\ndata: " + _encode(event) + b"\n\n"


class ResponsesStreamFormatter:
    """The event sequence of one streamed response, and the final response it assembles
    (handed to `on_done`, which stores it). The interface of format.StreamFormatter."""

    def __init__(
        self,
        gen: Generation,
        skeleton: rs.ResponseObject,
        plan: ResponsePlan,
        on_done: Callable[[rs.ResponseObject], None],
    ) -> None:
        self.gen, self.skeleton, self.plan, self.on_done = gen, skeleton, plan, on_done
        self.seq = 0
        self.output: list[rs.OutputItem] = []
        # The open message item's text so far (None: no message open); the open call.
        self.text: str | None = None
        self.call: rs.FunctionCallItem | None = None
        self.tools = ToolStream(plan.tools) if plan.tools is not None else None
        self.reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = rs.StreamEvent(type=kind, sequence_number=self.seq, **fields)
        self.seq += 1
        return event_bytes(event)

    def opening(self) -> list[bytes]:
        return [
            self._event("response.created", response=self.skeleton),
            self._event("response.in_progress", response=self.skeleton),
        ]

    # -- the message item ------------------------------------------------------------------------
    def _message(self, status: str) -> rs.OutputMessage:
        assert isinstance(self.output[-1], rs.OutputMessage)
        content = [] if self.text is None else [rs.OutputText(text=self.text)]
        return rs.OutputMessage(id=self.output[-1].id, status=status, content=content)

    def _open_item(self) -> dict[str, Any]:
        """The fields that place an event in the open (last) output item's text part."""
        return {"output_index": len(self.output) - 1, "item_id": self.output[-1].id}

    def _text(self, delta: str) -> list[bytes]:
        out = []
        if self.text is None:  # open a message item (no content yet), then its text part
            out += self._close_call()
            self.output.append(rs.OutputMessage(id=item_id("msg"), status="in_progress"))
            item = self._message("in_progress")
            out.append(
                self._event(
                    "response.output_item.added", output_index=len(self.output) - 1, item=item
                )
            )
            self.text = ""
            part = rs.OutputText(text="")
            out.append(
                self._event(
                    "response.content_part.added", **self._open_item(), content_index=0, part=part
                )
            )
        if delta:
            self.text += delta
            out.append(
                self._event(
                    "response.output_text.delta",
                    **self._open_item(),
                    content_index=0,
                    delta=delta,
                    logprobs=[],
                )
            )
        return out

    def _close_message(self) -> list[bytes]:
        if self.text is None:
            return []
        index, iid, text = len(self.output) - 1, self.output[-1].id, self.text
        final = self._message("completed")
        self.output[-1] = final
        self.text = None
        return [
            self._event(
                "response.output_text.done",
                output_index=index,
                item_id=iid,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                output_index=index,
                item_id=iid,
                content_index=0,
                part=rs.OutputText(text=text),
            ),
            self._event("response.output_item.done", output_index=index, item=final),
        ]

    # -- function call items ---------------------------------------------------------------------
    def _call_delta(self, delta: s.DeltaToolCall) -> list[bytes]:
        out = []
        args = delta.function.arguments if delta.function else None
        if delta.id is not None:  # a new call begins
            out += self._close_message() + self._close_call()
            name = (delta.function.name if delta.function else None) or ""
            self.call = rs.FunctionCallItem(
                id=item_id("fc"), call_id=delta.id, name=name, arguments="", status="in_progress"
            )
            self.output.append(self.call)
            out.append(
                self._event(
                    "response.output_item.added", output_index=len(self.output) - 1, item=self.call
                )
            )
        if args and self.call is not None:
            self.call.arguments += args
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    output_index=len(self.output) - 1,
                    item_id=self.call.id,
                    delta=args,
                )
            )
        return out

    def _close_call(self) -> list[bytes]:
        call = self.call
        if call is None:
            return []
        self.call = None
        call.status = "completed"
        index = self.output.index(call)
        return [
            self._event(
                "response.function_call_arguments.done",
                output_index=index,
                item_id=call.id,
                name=call.name,
                arguments=call.arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=call),
        ]

    # -- engine outputs --------------------------------------------------------------------------
    def chunk(self, ch: Choice, ro: RequestOutput) -> bytes | None:
        text = ro.new_text
        calls: list[s.DeltaToolCall] = []
        if self.tools is not None:
            text, calls = self.tools.feed(ro.new_text, ro.finished)
        out = self._text(text) if text else []
        for delta in calls:
            out += self._call_delta(delta)
        if ro.finished:
            self.reason = ch.finish_reason
            if (
                self.tools is not None
                and self.tools.made_calls
                and self.reason in ("stop", "length")
            ):
                if self.reason == "stop" or self.tools.plan.mode in ("auto", "generic"):
                    self.reason = "tool_calls"
            if not self.output:
                out += self._text("")  # an empty answer is still one (empty) message
            out += self._close_message() + self._close_call()
        return b"".join(out) if out else None

    def closing(self) -> list[bytes]:
        response = finished(self.skeleton, self.output, self.reason, self.gen, self.plan)
        self.on_done(response)
        return [self._event("response.completed", response=response)]
