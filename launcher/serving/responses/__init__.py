"""OpenAI's Responses API (POST /v1/responses) as a translation over the chat route, with no server in
it: a Responses request becomes a /v1/chat/completions body, which the chat parser
(openai_protocol.ChatCompletionRequest) then checks and the chat machinery (template, tool-call
parsers, reasoning splitter, structured outputs) answers; the chat answer comes back here and is told
as a Response object, or as the Responses stream's events. Pure: dicts in, dicts and strings out.

request.py: the request as a chat body, its echo, refusals in its terms; output.py: the answer as a
Response object or the stream's events.
"""

from launcher.serving.responses.output import ResponseEvents, output_items, response_object, sse, usage
from launcher.serving.responses.request import ResponsesEcho, chat_body, responses_param

__all__ = ["ResponseEvents", "ResponsesEcho", "chat_body", "output_items", "response_object", "responses_param",
           "sse", "usage"]
