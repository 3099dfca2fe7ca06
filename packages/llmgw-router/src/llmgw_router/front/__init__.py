"""The router's own HTTP/1.1 server for the OpenAI routes: protocol.py (connections,
parsing, pipelining, deadlines, disconnects), reply.py (one request and the answer
written for it), framing.py (HTTP framing errors in OpenAI shape)."""
