"""The box's two default ports, known to the server, the client and the command line alike."""
PORT = 7878        # the msgpack protocol
HTTP_PORT = 7879   # HTTP: the OpenAI and Ollama APIs, /metrics, the chat page
