"""The OpenAI surface as epdserve speaks it (docs/architecture.md, Layers); no HTTP server, no sockets."""

__all__ = ["detokenizer", "errors", "fields", "logprobs", "multimodal", "openai",
           "structured_output", "tool_calls", "tool_parsers"]
