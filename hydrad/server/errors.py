"""Errors as OpenAI-style JSON: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from aiohttp import web

from hydrad.errors import RequestError
from hydrad.cluster.worker_client import WorkerLost
from hydrad.cluster.requests import ServiceStopping
from hydrad.cluster.router import NoInstanceAvailable

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "service_unavailable"}

# No instance can serve the request; the message says why.
UNAVAILABLE = (WorkerLost, NoInstanceAvailable, ServiceStopping)
# Retry-After (seconds) of those 503s: about a worker's restart, or the daemon's under its
# service manager.
RETRY_UNAVAILABLE_AFTER = 5


class APIError(Exception):
    """An HTTP error with an explicit status (404 model, 401 key, ...)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.headers: dict[str, str] = {}  # sent with the error (Retry-After)

    def __reduce__(self):  # crosses from the daemon to a front-end process as itself
        return (type(self), (self.status, str(self), self.param, self.code), {"headers": self.headers})


def exception_status(e: BaseException) -> int:
    if isinstance(e, APIError):
        return e.status
    if isinstance(e, RequestError):
        return 400
    if isinstance(e, UNAVAILABLE):
        return 503
    if isinstance(e, web.HTTPException):
        return e.status
    return 500


def error_body(status: int, e: BaseException | str) -> dict:
    if isinstance(e, web.HTTPException):
        message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
    elif status >= 500 and not isinstance(e, (*UNAVAILABLE, APIError, str)):
        message = "internal server error"
    else:
        message = str(e)
    if status == 400:
        error_type = "invalid_request_error"
    elif status >= 500:
        error_type = _TYPES.get(status, "server_error")
    else:
        error_type = _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": getattr(e, "param", None),
                      "code": getattr(e, "code", None)}}


def error_response(e: BaseException) -> web.Response:
    status = exception_status(e)
    headers = e.headers if isinstance(e, APIError) else None
    if isinstance(e, UNAVAILABLE):
        headers = {"Retry-After": str(RETRY_UNAVAILABLE_AFTER)}
    return web.json_response(error_body(status, e), status=status, headers=headers)
