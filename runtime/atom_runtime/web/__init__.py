"""HTTP plumbing the API server and the router share: OpenAI-style error bodies, strict body
parsing, JSON and SSE responses that notice a client leaving."""
