"""Errors as OpenAI-style JSON, with the status and headers a client acts on."""

from __future__ import annotations

import json

import pytest

from hydrad.cluster.requests import ServiceStopping
from hydrad.cluster.router import NoInstanceAvailable
from hydrad.cluster.worker_client import WorkerLost
from hydrad.errors import RequestError
from hydrad.server.admission import ServerBusy
from hydrad.server.errors import error_response


@pytest.mark.parametrize("error", [NoInstanceAvailable("no live instance can take stage E"),
                                   WorkerLost("worker 0 (cpu, E) exited"), ServiceStopping("stopping")])
def test_no_instance_to_serve_is_503_with_retry_after(error):
    response = error_response(error)
    assert response.status == 503 and response.headers["Retry-After"] == "5"
    body = json.loads(response.body)
    assert body["error"]["type"] == "service_unavailable" and body["error"]["message"] == str(error)


def test_other_errors_keep_their_own_headers():
    assert "Retry-After" not in error_response(RequestError("bad", "max_tokens")).headers
    assert error_response(ServerBusy("no room", 12)).headers["Retry-After"] == "12"
