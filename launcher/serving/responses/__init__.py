"""OpenAI's Responses API (POST /v1/responses) as a translation over the chat route, with no server in
it: a Responses request becomes a /v1/chat/completions body, which the chat parser
(openai_protocol.ChatCompletionRequest) then checks and the chat machinery (template, tool-call
parsers, reasoning splitter, structured outputs) answers; the chat answer comes back here and is told
as a Response object, or as the Responses stream's events. Pure: dicts in, dicts and strings out.

request.py: the request as a chat body, its echo, refusals in its terms; output.py: the answer as a
Response object or the stream's events; store.py: the responses a server keeps for
previous_response_id; listed_items.py: a kept turn's input items in GET .../input_items' shape, and a
page of them.
"""

from launcher.serving.responses.output import ResponseEvents, item_id, output_items, response_object, sse, usage
from launcher.serving.responses.listed_items import DEFAULT_PAGE, listed, page
from launcher.serving.responses.request import (KEEPS_NONE, NOT_KEPT_WHY, ResponsesEcho, chat_body,
                                                previous_response_id, responses_param, turn_items)

__all__ = ["DEFAULT_PAGE", "KEEPS_NONE", "NOT_KEPT_WHY", "ResponseEvents", "ResponsesEcho", "chat_body", "item_id", "listed",
           "output_items", "page", "previous_response_id", "response_object", "responses_param", "sse",
           "turn_items", "usage"]
