"""The HTTP doors: OpenAI's API, Ollama's, the Responses API. Each maps its own shapes onto
the request schema and the answer stream; none imports another."""
