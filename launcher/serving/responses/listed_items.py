"""A kept turn's input items in the shape GET /v1/responses/{id}/input_items lists them (OpenAI's
ResponseItem: every item with an id and a status, a message's content as typed parts), and one page
of such a listing. Pure: dicts in, dicts out.

The input a client sends may leave ids out and write a message's content as a string; the store keeps
each turn's input in this listed shape (ids given once, when the turn is kept, so a listing shows the
same ids every time), which chat_body takes back as input unchanged: a string content becomes one
text part, which the chat template reads as the string.
"""

from __future__ import annotations

import copy

from launcher.serving.openai_protocol import ProtocolError, _short
from launcher.serving.responses.output import item_id

ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
MAX_PAGE, DEFAULT_PAGE = 100, 20
"""OpenAI's bounds on a listing's `limit`, and its default."""
ORDERS = ("asc", "desc")


def listed(items: list[dict]) -> list[dict]:
    """A turn's input items (as chat_body took them) in the listed shape, copies of them: an id
    each, unique in the turn (one the client sent twice is given a new one the second time, so a
    page's `after` is never ambiguous), a status, a message's content as parts of its role's type
    (an absent content one empty part: no content at all is refused when the turn comes back as
    history), a reasoning item's summary a list."""
    shaped_items, seen = [], set()
    for item in copy.deepcopy(items):
        kind = item.get("type") or "message"  # chat_body took a null type as a message
        given = item.get("id")
        shaped = {**item, "type": kind, "status": item.get("status") or "completed",
                  "id": given if given and given not in seen else item_id(ID_PREFIXES[kind])}
        seen.add(shaped["id"])
        if kind == "message":
            shaped["content"] = _parts(item.get("content"), item["role"] == "assistant")
        elif kind == "reasoning" and shaped.get("summary") is None:
            shaped["summary"] = []
        shaped_items.append({key: value for key, value in shaped.items() if value is not None})
    return shaped_items


def _parts(content, assistant: bool) -> list[dict]:
    """A message's content as parts of its role's type: output_text (with its annotations) for the
    assistant's, its refusal parts as they are (OpenAI's output message holds either), input_text
    (the text alone) for the others'."""
    kind = "output_text" if assistant else "input_text"
    parts = [{"type": kind, "text": content or ""}] if content is None or isinstance(content, str) else content
    if not assistant:
        return [{"type": kind, "text": part["text"]} for part in parts]
    return [{"type": "refusal", "refusal": part["refusal"]} if part.get("type") == "refusal" else
            {"annotations": [], **{k: v for k, v in part.items() if v is not None}, "type": kind} for part in parts]


def page(items: list[dict], after: str | None, limit, order: str) -> dict:
    """One page of a listing: the items after `after` (an item id) in `order` ("desc": the latest
    first), at most `limit`; ProtocolError 400 naming the query parameter for a bad one."""
    if order not in ORDERS:
        raise ProtocolError(f"order ({_short(order)}) must be asc or desc", param="order")
    given = limit
    try:
        limit = int(limit)
    except (TypeError, ValueError):
        limit = None
    if limit is None or not 1 <= limit <= MAX_PAGE:
        raise ProtocolError(f"limit ({_short(given)}) must be an integer from 1 to {MAX_PAGE} (default "
                            f"{DEFAULT_PAGE})", param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ProtocolError(f"after ({_short(after)}) is no item of this response's input; send an id "
                                f"from an earlier page (its last_id)", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}
