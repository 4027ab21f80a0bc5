"""The binding with a checkpoint named by URL: load and attach from an object store (SeaweedFS)."""
import os
import sys

import weightd
from conftest import REPO, file_bytes
from wdclient import Checkpoint
from wdfixtures import SLOW

sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
sys.path.insert(0, os.path.join(REPO, "tests", "remote"))
import s3server  # noqa: E402
from test_remote_ckpt import SIGNED, upload, write_checkpoint  # noqa: E402


def test_load_and_attach_a_url(start_daemon, tmp_path):
    d = write_checkpoint(str(tmp_path / "m"))
    with s3server.SeaweedS3(tmp_path / "s3", start_timeout=90 * SLOW) as s3:
        upload(s3, "ckpt", "py/m", d)
        env = dict(SIGNED, AWS_ENDPOINT_URL_S3=s3.endpoint, AWS_EC2_METADATA_DISABLED="true",
                   AWS_SHARED_CREDENTIALS_FILE="/nonexistent-wd-test", AWS_CONFIG_FILE="/nonexistent-wd-test")
        wd = start_daemon(env=env, extra_args=["--remote-root", "s3://ckpt/py"])
        ckpt = Checkpoint(d)
        with weightd.Client(wd.socket) as c:
            # libweightd sends the URL as it is (it makes only relative file paths absolute).
            set_id = c.load("s3://ckpt/py/m")
            with c.attach("s3://ckpt/py/m") as s:
                assert s.id == set_id
                assert set(s) == set(ckpt.where)
                for name in ckpt.where:
                    assert s[name].tobytes() == file_bytes(ckpt, name), name
            # Outside the remote roots: the daemon's PATH_DENIED, as a binding error.
            try:
                c.load("s3://ckpt/elsewhere/m")
                raise AssertionError("a URL outside the remote roots was loaded")
            except weightd.Error as e:
                assert e.name == "PATH_DENIED" and "not within the remote roots" in str(e), e
        ckpt.close()
