"""The one error vocabulary of meshd.

Exceptions are raised deep inside (wire parsing, the cache store, the shard, the
head's loop) and mapped to an HTTP status and an OpenAI-style error body in
exactly one place: ``daemon.server.errors``.
"""

from __future__ import annotations


class MeshError(Exception):
    """Base class of every error meshd reports to a client."""

    status = 500
    code = "internal_error"
    type = "server_error"
    retry_after: int | None = None  # seconds, sent as Retry-After

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(MeshError):
    """The request is malformed; ``param`` names the offending field or header."""

    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class NotFound(MeshError):
    status = 404
    code = "not_found"
    type = "invalid_request_error"


class ModelNotFound(NotFound):
    """A request names a model this node does not serve (OpenAI's answer to an unknown model)."""

    code = "model_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class CacheMiss(MeshError):
    """A decode step this node cannot serve from its session cache (answered 409).

    ``reason`` is one of :data:`CACHE_MISS_REASONS`.
    """

    status = 409
    code = "cache_miss"
    type = "invalid_request_error"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


CACHE_MISS_REASONS = (
    "unknown_session",  # never prefilled here, evicted, or the node restarted
    "past_len_mismatch",  # the cache holds a different number of tokens than the head expects
    "start_layer_mismatch",  # the route changed which layers this node must run
    "cache_disabled",  # the node runs stateless (--no-kv-cache or an unsupported model)
    "prefix_unavailable",  # the session a step would start from is gone, shorter, or cached from another layer
    "not_croppable",  # the prefix session's layers cannot be cut back to the asked length (linear attention, windows)
)


class ModelUnavailable(MeshError):
    """The model cannot be found, fetched, converted or loaded. Says what to do."""

    status = 503
    code = "model_unavailable"


class RouteUnavailable(MeshError):
    """No set of known, live nodes covers every layer of the model; ``layers``: the first range none serves."""

    status = 503
    code = "no_route"

    def __init__(self, message: str, *, layers: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.layers = layers  # half-open [start, end)


class UpstreamError(MeshError):
    """A peer on the route failed or answered something this node cannot use."""

    status = 502
    code = "upstream_error"


class HopFailed(UpstreamError):
    """A hop's node did not answer (refused, reset, timed out) or answered 5xx: another node may serve it.

    ``reason`` is ``unreachable``, ``timed_out`` or ``http_status`` (then ``status`` is what it answered).
    """

    def __init__(self, url: str, message: str, *, reason: str, status: int | None = None,
                 moved_to: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.reason = reason
        self.status = status
        self.moved_to = moved_to  # a draining node handed the step's session to this node


class Unauthorized(MeshError):
    """A request without the mesh token (``Authorization: Bearer <token>``)."""

    status = 401
    code = "invalid_api_key"
    type = "invalid_request_error"


class TooManyGenerations(MeshError):
    """The node heads as many generations as it is allowed to; the client should come back shortly."""

    status = 429
    code = "too_many_generations"
    type = "rate_limit_error"
    retry_after = 1


class Draining(MeshError):
    """The node is shutting down: it finishes what it runs and takes nothing new. ``moved_to``: the node a step's
    session was handed to, where it goes on without computing anything again."""

    status = 503
    code = "draining"
    retry_after = 5

    def __init__(self, message: str, *, moved_to: str | None = None) -> None:
        super().__init__(message)
        self.moved_to = moved_to


class NoRoom(MeshError):
    """A session sent to this node does not fit its session cache's bounds."""

    status = 507
    code = "insufficient_storage"
