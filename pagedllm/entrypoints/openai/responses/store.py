"""Stored responses (store: true), for GET /v1/responses/{id} and previous_response_id: in memory,
bounded by count (the oldest go first) and by age, each visible only to the tenant whose key made it."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.entrypoints.openai.responses.protocol import ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[dict]   # chat messages up to and including the answer (instructions are not carried on)
    tenant: str | None
    stored_at: float


class ResponseStore:
    def __init__(self, max_entries: int, ttl_seconds: float, clock=time.monotonic):
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, conversation: list[dict], tenant: str | None) -> None:
        self._drop_expired()
        self._entries[response.id] = StoredResponse(response, conversation, tenant, self._clock())
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        """The entry, if it exists, has not expired and belongs to this tenant (another tenant's looks absent)."""
        self._drop_expired()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.tenant == tenant else None

    def delete(self, response_id: str, tenant: str | None) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        del self._entries[response_id]
        return True

    def _drop_expired(self) -> None:
        """Entries are in the order they were stored, so the expired ones are at the front."""
        horizon = self._clock() - self.ttl_seconds
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at >= horizon:
                break
            self._entries.popitem(last=False)
