"""What a user runs against a Rill (or any OpenAI-compatible) server, apart from the services:
`chat_client` (`rill chat`, a terminal chat over the WebSocket), `bench_serve` (`rill bench serve`,
the load generator) and `http_stream` (its HTTP response-stream reader)."""
