"""OpenAI's Responses API: POST /v1/responses, its stored responses, and their streamed events."""
