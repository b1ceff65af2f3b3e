"""The demo, shortened: kill mid-upload, gc, resume, retention, exact continuation (SeaweedFS)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from s3ckpt.tools.demo import main
from tests.conftest import S3Env
from tests.helpers import listing, uploads_in_progress


@pytest.mark.slow
@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)
def test_a_short_demo_resumes_exactly_and_draws_its_timeline(
    s3: S3Env,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_access_key)
    out = tmp_path / "timeline.png"
    argv = ["--endpoint-url", s3.endpoint_url, "--bucket", bucket, "--out", str(out)]
    code = main([*argv, "--steps", "6", "--every", "2", "--batch", "2", "--keep-last", "2"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "exact continuation: YES — resumed after step 2;" in text
    # The manager kept the newest two of steps 2, 4 and 6, in both runs.
    assert "2/2 checkpoints bitwise-equal" in text
    assert "kept steps [4, 6], deleted [2] after later commits" in text
    assert "SIGKILL after step" in text and "first (killed)" in text
    removed = re.search(r"gc .*: deleted (\d+) objects .*, aborted (\d+) multipart", text)
    assert removed is not None and int(removed[1]) + int(removed[2]) > 0  # the killed save's
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # On an endpoint it did not start, the demo leaves nothing behind.
    assert listing(s3.client, bucket) == {}
    assert uploads_in_progress(s3.client, bucket) == []
