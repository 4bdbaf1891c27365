"""Stored responses of the Responses API: in memory, bounded, lost on restart.

A stored response keeps its response object (GET /v1/responses/{id}) and its conversation as
chat messages (what `previous_response_id` continues from: the earlier inputs and outputs,
not the earlier `instructions`). At most `server.max_stored_responses` are kept; storing one
more drops the oldest (0: none are stored). A server restart (or a reload that rebuilds the
server state) forgets them all.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from appliance.server.responses_schema import ResponseObject
from appliance.server.schemas import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]


class ResponseStore:
    def __init__(self) -> None:
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse, capacity: int) -> None:
        self._items[stored.response.id] = stored
        while len(self._items) > capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
