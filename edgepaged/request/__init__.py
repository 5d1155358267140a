"""The request side: one request's schema and rules, the front end that validates, renders
and tokenizes it, the answer stream every door reads, tool calls and thinking, the msgpack
protocol's frames."""
