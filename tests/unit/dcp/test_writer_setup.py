"""What a writer's construction does ahead of the first save, without a server."""

from __future__ import annotations

from s3ckpt import S3Config, S3Writer


def test_construction_makes_the_client_and_its_http_session_sending_nothing() -> None:
    # Nothing listens on port 9: construction must not send a request (nor fail).
    config = S3Config(
        endpoint_url="http://127.0.0.1:9", access_key_id="AKIDSETUP", secret_access_key="x" * 40
    )
    writer = S3Writer("setup-bucket", "run", config=config)
    store = writer._store
    holder = store.calls.clients[0]  # type: ignore[attr-defined]
    assert holder._client is not None, "the S3 client exists before the first save"
    assert holder._client._endpoint.http_session._sessions, "and its HTTP session"
    assert store.stats.requests == 0
