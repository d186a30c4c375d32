"""The serving processes. Subpackages by role, importing only downward (the import-linter
contract in pyproject.toml): :mod:`.launch` (``epdserve serve``: local and Ray placement,
child supervision) → :mod:`.router` (the OpenAI HTTP front and request flows) →
:mod:`.worker` (engine and encode workers) and :mod:`.elastic` (role and scaling policy) →
:mod:`.api` (the OpenAI surface: request models, errors, tool calls, structured output,
logprobs, detokenizer, images) → the modules shared by all: :mod:`.metrics`, :mod:`.handshake`,
:mod:`.flags`, :mod:`.protocol` (router↔worker messages), :mod:`.auth`, :mod:`.deployment`
(deployment names, modes and roles).
"""

__all__ = ["api", "elastic", "launch", "router", "worker", "auth", "deployment", "flags",
           "handshake", "metrics", "protocol"]
