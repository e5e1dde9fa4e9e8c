"""Finished responses, kept in this router process's memory for `previous_response_id`,
`GET /v1/responses/{id}` and `DELETE /v1/responses/{id}`.

Each entry holds the response object and the whole conversation up to it (the input items
of every turn and the output items), so a follow-up needs only its parent, and evicting
an older turn of a chain never breaks a newer one. The bound is on both the number of
responses and their bytes (the JSON size of an entry); the least recently used go first.

The store is per router process: with several router replicas behind a load balancer, a
follow-up that lands on another replica does not find its previous response (404
`previous_response_not_found`, which says so). Clients that need that send the whole
conversation as `input` instead.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from splitserve.router.errors import APIError

PER_PROCESS = ("responses are stored in the memory of one router process, bounded by --responses-store-max and "
               "--responses-store-mb (the oldest go first); a router restart, or another router replica behind "
               "the same load balancer, does not have it: send the conversation as input instead")


@dataclass
class StoreConfig:
    max_responses: int = 1000
    max_mb: float = 256.0

    def __post_init__(self) -> None:
        if self.max_responses < 0 or self.max_mb < 0:
            raise ValueError("--responses-store-max and --responses-store-mb must be >= 0 (0: store nothing)")


@dataclass
class Entry:
    response: dict
    conversation: list[dict]  # every input item and output item up to this response
    size: int


class ResponseStore:
    def __init__(self, config: StoreConfig | None = None):
        self.config = config or StoreConfig()
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def put(self, response: dict, conversation: list[dict]) -> bool:
        """Store a finished response; False when it is larger than the whole store."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        limit = self.config.max_mb * (1 << 20)
        if size > limit or self.config.max_responses == 0:
            return False
        self.delete(response["id"])
        self.entries[response["id"]] = Entry(response, conversation, size)
        self.bytes += size
        while len(self.entries) > self.config.max_responses or self.bytes > limit:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.size
            self.evicted += 1
        return True

    def get(self, rid: str) -> Entry | None:
        entry = self.entries.get(rid)
        if entry is not None:
            self.entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self.entries.pop(rid, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None

    def conversation(self, previous_id: str | None) -> list[dict]:
        """The conversation a follow-up continues: 404 previous_response_not_found if unknown."""
        if previous_id is None:
            return []
        entry = self.get(previous_id)
        if entry is None:
            raise APIError(404, f"Previous response with id '{previous_id}' not found: {PER_PROCESS}.",
                           "invalid_request_error", "previous_response_id", "previous_response_not_found")
        return entry.conversation

    def lookup(self, rid: str) -> Entry:
        entry = self.get(rid)
        if entry is None:
            raise not_found(rid)
        return entry


def not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found: {PER_PROCESS}.", "invalid_request_error",
                    "response_id", "response_not_found")
