"""The operator CLI's requests to a running daemon: its admin token, and every failure as
one ``HydradError`` line (the daemon's own OpenAI-style message where it sent one)."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

from hydrad.errors import HydradError


@contextlib.contextmanager
def daemon_request(url: str, path: str, admin_token: str | None = None, *, body: dict | None = None,
                   timeout: float = 10.0) -> Iterator:
    """The response to a GET of ``url`` + ``path`` (a POST of ``body`` as JSON when given),
    open for reading inside the block; failures, reading included, raise ``HydradError``."""
    full = url.rstrip("/") + path
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(full, data=data, method="GET" if body is None else "POST")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if admin_token:
        request.add_header("Authorization", f"Bearer {admin_token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            yield response
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise HydradError(f"{full}: HTTP {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        raise HydradError(f"cannot reach the daemon at {url}: {getattr(e, 'reason', e)}") from None
