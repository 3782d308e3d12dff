"""The node's OpenAI-compatible HTTP API: app wiring, routes, request and response
shapes, the admission gate, and the state every route shares."""
