"""Who may read what: the daemon reads for a client only what that client may read itself.

The daemon opens checkpoints with its own rights (root here), for clients
of other uids. Each test builds a tree the client (a forked child running
as nobody, with the supplementary groups a test gives it) can or cannot
read, shows what the kernel answers the child directly, and checks that
the daemon answers the same: PERMISSION naming the path and the part it
may not read or search, with no byte of the file in the message, whether
the checkpoint is opened for it, already open (shared with root), known
to fail, or reached through a set id. Root, which could read the files
itself, is served. These need root to run a client as another uid.
"""
import json
import os
import shutil
import struct
import tempfile

import pytest

from conftest import TINY_TENSORS, write_single
from wdclient import Closed, Conn, write_safetensors

NOBODY = 65534
GROUP = 4344  # a group no account has: the test gives it to the child, and files to it

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")

HELLO = {"op": "hello", "id": 1, "protocol": 1}
SETTINGS = {"allowed_uids": str(NOBODY), "socket_mode": "0666"}
# The ops that read a checkpoint for the client, as requests with ids from 10 on.
READING_OPS = [
    {"op": "open"},
    {"op": "prefetch", "wait": True},
    {"op": "load", "device": 0},
    {"op": "attach", "device": 0},
    {"op": "load_group", "group": {"tp_size": 1}, "plan": {"preset": "whole"}},
]


def as_client(sock, reqs, groups=(), read=(), uid=NOBODY):
    """Runs in a forked child under uid `uid` (gid nobody) with supplementary groups `groups`.

    First it tries to read each path of `read` itself ({path: "ok" | errno name}),
    then sends reqs on a fresh connection. Returns (what it read, {id: final reply}).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(NOBODY)
            os.setuid(uid)
            direct = {}
            for p in read:
                try:
                    with open(p, "rb") as f:
                        f.read(8)
                    direct[p] = "ok"
                except OSError as e:
                    direct[p] = os.strerror(e.errno)
            replies = {}
            try:
                c = Conn(sock, hello=False, timeout=30)
                for req in [HELLO] + list(reqs):
                    c.send(req)
                    while True:
                        m = c.recv_msg()
                        if "event" not in m:
                            break
                    replies[m.get("id")] = m
            except Closed:
                replies["eof"] = True
            os.write(w, json.dumps([direct, replies]).encode())
        except BaseException as e:  # report, never raise into the parent's test
            os.write(w, json.dumps([{"child_error": repr(e)}, {}]).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    direct, replies = json.loads(data)
    assert status == 0, direct
    return direct, {int(k) if k.isdigit() else k: v for k, v in replies.items()}


def reading_requests(path, first_id=10):
    out = []
    for i, r in enumerate(READING_OPS):
        q = dict(r, id=first_id + i, path=path)
        out.append(q)
    return out


def assert_refused(replies, path, part, first_id=10, n=len(READING_OPS), forbidden=()):
    """Every reading request was PERMISSION naming path and part, and no message holds a forbidden text."""
    for i in range(first_id, first_id + n):
        m = replies[i]
        err = m.get("error", {})
        assert err.get("code") == "PERMISSION", m
        assert path in err["message"] and part in err["message"] and f"uid {NOBODY}" in err["message"], m
        for f in forbidden:
            assert f not in err["message"], m


def assert_served(replies, first_id=10, n=len(READING_OPS)):
    for i in range(first_id, first_id + n):
        assert replies[i].get("ok") is True, replies[i]


@pytest.fixture
def tree():
    """A fresh directory every user may search (the session's workdir is 0700), removed at the end."""
    d = tempfile.mkdtemp(prefix="wda-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def private_checkpoint(base, name="private"):
    """A root-only checkpoint: a 0700 directory holding a 0600 model.safetensors."""
    d = write_single(os.path.join(base, name), TINY_TENSORS, 11)
    os.chmod(os.path.join(d, "model.safetensors"), 0o600)
    os.chmod(d, 0o700)
    return d


def test_root_only_checkpoint_in_the_roots(start_daemon, tree):
    """Open, prefetch, load, attach, load_group and close of a root-only checkpoint: PERMISSION for nobody, as
    its own open is; root is served. Whether root opened it first (an open checkpoint shared) or not."""
    ck = private_checkpoint(tree)
    shard = os.path.join(ck, "model.safetensors")
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    direct, got = as_client(d.socket, reading_requests(ck), read=[shard])
    assert direct[shard] == "Permission denied"
    assert_refused(got, ck, f"may not search {ck}")
    with d.connect() as root:
        assert root.call("open", path=ck)["checkpoint"]["tensors"] == len(TINY_TENSORS)
        att, fd = root.attach(path=ck, device=0)
        os.close(fd)
        # Now open, with a resident set and a lease: nobody's requests are still refused, close too.
        _, got = as_client(d.socket, reading_requests(ck) + [{"op": "close", "id": 20, "path": ck}])
        assert_refused(got, ck, f"may not search {ck}")
        assert got[20]["error"]["code"] == "PERMISSION", got[20]
        assert [s["leases"] for s in root.status()["sets"]] == [1]
    d.assert_alive()


def test_root_only_checkpoint_without_model_roots(start_daemon, tree):
    """With no model_roots any path the daemon can read was served to anyone; now only what the client may read."""
    ck = private_checkpoint(tree)
    d = start_daemon(SETTINGS, roots=[], public=True)
    _, got = as_client(d.socket, reading_requests(ck))
    assert_refused(got, ck, f"may not search {ck}")
    # A readable checkpoint anywhere is still served to nobody.
    ok = write_single(os.path.join(tree, "public"), TINY_TENSORS, 12)
    _, got = as_client(d.socket, reading_requests(ok))
    assert_served(got)
    with d.connect() as root:
        assert root.call("load", path=ck)["tensors"] == len(TINY_TENSORS)


def test_no_byte_of_an_unreadable_file_in_a_message(start_daemon, tree):
    """A root-only file that is no safetensors file: nobody learns nothing of its bytes (its first 8 bytes as a
    header length), whether root tried it first (a failure the daemon remembers) or not."""
    d0 = os.path.join(tree, "notst")
    os.makedirs(d0)
    secret = b"SECRET!!" + b"the rest of a root-only file\n" * 4
    shard = os.path.join(d0, "model.safetensors")
    with open(shard, "wb") as f:
        f.write(secret)
    os.chmod(shard, 0o600)
    n = struct.unpack("<Q", secret[:8])[0]
    # An index whose weight_map names a value root alone may read.
    d1 = os.path.join(tree, "badindex")
    os.makedirs(d1)
    index = os.path.join(d1, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"weight_map": {"w": "SECRETSHARD.safetensors"}}, f)
    os.chmod(index, 0o600)
    # A readable index whose root-only second shard holds a tensor it does not list: the failed check
    # names that tensor, and the daemon remembers the verdict by the files' identities.
    d2 = os.path.join(tree, "hiddentensor")
    os.makedirs(d2)
    write_safetensors(os.path.join(d2, "s1.safetensors"), [("a", "F32", [4])], seed=1)
    s2 = os.path.join(d2, "s2.safetensors")
    write_safetensors(s2, [("b", "F32", [4]), ("SECRETTENSOR", "F32", [4])], seed=2)
    os.chmod(s2, 0o600)
    with open(os.path.join(d2, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}, f)
    forbidden = (str(n), "SECRET", "rest of a", "SECRETSHARD", "SECRETTENSOR")
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    with d.connect() as root:  # root sees what is wrong (and the daemon remembers what it can)
        assert root.error("open", path=d0) == "BAD_HEADER"
        assert root.error("open", path=d1) in ("NOT_FOUND", "BAD_INDEX")
        m, _ = root.request("open", path=d2)
        assert m["error"]["code"] == "BAD_INDEX" and "SECRETTENSOR" in m["error"]["message"], m
    for ck, unreadable in ((d0, shard), (d1, index), (d2, s2)):
        direct, got = as_client(d.socket, reading_requests(ck), read=[unreadable])
        assert direct[unreadable] == "Permission denied"
        assert_refused(got, ck, f"may not read {unreadable}", forbidden=forbidden)


def test_root_only_config_value_not_echoed(start_daemon, tree):
    """Readable shards beside a root-only config.json whose model_type a plan error would quote."""
    ck = write_single(os.path.join(tree, "cfg"), TINY_TENSORS, 13)
    cfg = os.path.join(ck, "config.json")
    with open(cfg, "w") as f:
        json.dump({"model_type": "SECRETMODELTYPE"}, f)
    os.chmod(cfg, 0o600)
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    reqs = [dict(q, plan={"preset": "auto"}) if q["op"] in ("load", "attach", "load_group") else q
            for q in reading_requests(ck)]
    direct, got = as_client(d.socket, reqs, read=[cfg])
    assert direct[cfg] == "Permission denied"
    assert_refused(got, ck, f"may not read {cfg}", forbidden=("SECRETMODELTYPE",))
    with d.connect() as root:
        m, _ = root.request("load", path=ck, plan={"preset": "auto"})
        assert "SECRETMODELTYPE" in m["error"]["message"], m  # root may read it: the daemon tells it


def test_attach_by_set_id_of_a_root_only_checkpoint(start_daemon, tree):
    """A set root loaded from a root-only checkpoint: nobody's attach by its id is PERMISSION, naming the set."""
    ck = private_checkpoint(tree)
    ok = write_single(os.path.join(tree, "public"), TINY_TENSORS, 14)
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    with d.connect() as root:
        sid = root.call("load", path=ck)["set"]
        public_sid = root.call("load", path=ok)["set"]
        _, got = as_client(d.socket, [{"op": "attach", "id": 10, "set": sid},
                                      {"op": "attach", "id": 11, "set": public_sid}])
        err = got[10].get("error", {})
        assert err.get("code") == "PERMISSION" and sid in err["message"] and f"may not search {ck}" in err["message"], got
        assert got[11].get("ok") is True and got[11]["set"] == public_sid, got
        # The refused attach left no lease.
        assert [s["leases"] for s in root.status()["sets"] if s["set"] == sid] == [0]


def test_directory_nobody_may_search(start_daemon, tree):
    """0644 files in a directory others may list but not search (0744): PERMISSION, as the kernel says."""
    ck = write_single(os.path.join(tree, "nosearch"), TINY_TENSORS, 15)
    os.chmod(ck, 0o744)
    shard = os.path.join(ck, "model.safetensors")
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    direct, got = as_client(d.socket, reading_requests(ck), read=[shard])
    assert direct[shard] == "Permission denied"
    assert_refused(got, ck, f"may not search {ck}")


def test_shard_linked_into_a_private_directory(start_daemon, tree):
    """A readable directory whose shard is a symlink into a 0700 directory: the link is no way around it."""
    hidden = os.path.join(tree, "hidden")
    os.makedirs(hidden)
    write_safetensors(os.path.join(hidden, "blob"), TINY_TENSORS, seed=16)
    os.chmod(hidden, 0o700)
    ck = os.path.join(tree, "linked")
    os.makedirs(ck)
    os.symlink("../hidden/blob", os.path.join(ck, "model.safetensors"))
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    shard = os.path.join(ck, "model.safetensors")
    direct, got = as_client(d.socket, reading_requests(ck), read=[shard])
    assert direct[shard] == "Permission denied"
    assert_refused(got, ck, f"may not search {hidden}")
    with d.connect() as root:
        root.call("open", path=ck)
    _, got = as_client(d.socket, reading_requests(ck))  # open now: the same
    assert_refused(got, ck, f"may not search {hidden}")


def test_group_access_through_a_supplementary_group(start_daemon, tree):
    """A 0640 checkpoint of group GROUP in a 0750 directory of that group: served to a client with the group
    among its supplementary ones, refused to one without."""
    ck = write_single(os.path.join(tree, "grp"), TINY_TENSORS, 17)
    shard = os.path.join(ck, "model.safetensors")
    for p, mode in ((shard, 0o640), (ck, 0o750)):
        os.chown(p, 0, GROUP)
        os.chmod(p, mode)
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    direct, got = as_client(d.socket, reading_requests(ck), read=[shard])
    assert direct[shard] == "Permission denied"
    assert_refused(got, ck, f"may not search {ck}")
    direct, got = as_client(d.socket, reading_requests(ck), groups=(GROUP,), read=[shard])
    assert direct[shard] == "ok"
    assert_served(got)


def acl_bytes(entries):
    """system.posix_acl_access in the kernel's format: version 2, then (tag, perm, id) per entry."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, p, i) for t, p, i in entries)


USER_OBJ, USER, GROUP_OBJ, GROUP_T, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEF = 0xFFFFFFFF


def test_access_through_an_acl(start_daemon, tree):
    """A 0600 shard with an ACL entry for nobody (user:nobody:r) is served to nobody; the same with a mask of
    nothing is refused (the mask limits named entries), as the kernel says both times."""
    ck = write_single(os.path.join(tree, "acl"), TINY_TENSORS, 18)
    shard = os.path.join(ck, "model.safetensors")
    os.chmod(shard, 0o600)
    try:
        os.setxattr(shard, "system.posix_acl_access",
                    acl_bytes([(USER_OBJ, 6, UNDEF), (USER, 4, NOBODY), (GROUP_OBJ, 0, UNDEF), (MASK, 4, UNDEF),
                               (OTHER, 0, UNDEF)]))
    except OSError as e:
        pytest.skip(f"this file system takes no POSIX ACL: {e}")
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    direct, got = as_client(d.socket, reading_requests(ck), read=[shard])
    assert direct[shard] == "ok"
    assert_served(got)
    os.setxattr(shard, "system.posix_acl_access",
                acl_bytes([(USER_OBJ, 6, UNDEF), (USER, 4, NOBODY), (GROUP_OBJ, 0, UNDEF), (MASK, 0, UNDEF),
                           (OTHER, 0, UNDEF)]))
    direct, got = as_client(d.socket, reading_requests(ck, 20), read=[shard])
    assert direct[shard] == "Permission denied"
    assert_refused(got, ck, f"may not read {shard}", first_id=20)


OTHER_UID = 65533  # a second client uid, for what one client may do with another's set


def test_config_swapped_after_the_open_is_read_again(start_daemon, tree):
    """Root opened a checkpoint whose config.json only root may read; then a readable config.json is renamed over
    it. The open entry still holds the old file's values: the files' identity covers config.json, so nobody's
    request reopens it and sees the new values, never the old ones."""
    ck = write_single(os.path.join(tree, "swapcfg"), TINY_TENSORS, 21)
    cfg = os.path.join(ck, "config.json")
    with open(cfg, "w") as f:
        json.dump({"model_type": "SECRETMODELTYPE"}, f)
    os.chmod(cfg, 0o600)
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    with d.connect() as root:
        root.call("open", path=ck)
    new = cfg + ".new"
    with open(new, "w") as f:
        json.dump({"model_type": "PUBLICMODELTYPE"}, f)
    os.chmod(new, 0o644)
    os.rename(new, cfg)
    direct, got = as_client(d.socket, [{"op": "load", "id": 10, "path": ck, "device": 0, "plan": {"preset": "auto"}}],
                            read=[cfg])
    assert direct[cfg] == "ok"
    text = json.dumps(got[10])
    assert "SECRETMODELTYPE" not in text and "PUBLICMODELTYPE" in text, got[10]
    d.assert_alive()


def test_group_past_the_64th(start_daemon, tree):
    """A client in 100 supplementary groups, `last` the highest (the kernel sorts them, so it comes last): a 0604
    shard of group `last` is refused to it (the group class decides, and denies), a 0640 one is served, as the
    kernel says; a list cut short would say the reverse."""
    last = 64000
    groups = [50000 + i for i in range(99)] + [last]
    denied = write_single(os.path.join(tree, "denied"), TINY_TENSORS, 22)
    granted = write_single(os.path.join(tree, "granted"), TINY_TENSORS, 23)
    ds, gs = os.path.join(denied, "model.safetensors"), os.path.join(granted, "model.safetensors")
    for p, mode in ((ds, 0o604), (gs, 0o640)):
        os.chown(p, 0, last)
        os.chmod(p, mode)
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    direct, got = as_client(d.socket, reading_requests(denied) + reading_requests(granted, 20), groups=groups,
                            read=[ds, gs])
    assert direct == {ds: "Permission denied", gs: "ok"}
    assert_refused(got, denied, f"may not read {ds}")
    assert_served(got, first_id=20)


def test_no_oracle_behind_a_directory_nobody_may_search(start_daemon, tree):
    """Whether a name exists behind a 0700 directory, leads outside the roots or is no checkpoint, is not learnt:
    every answer is PERMISSION naming that directory, as the kernel answers the client itself. Also through
    links from readable checkpoints into it (model.safetensors, a shard an index names)."""
    priv = os.path.join(tree, "priv")
    write_single(os.path.join(priv, "exists"), TINY_TENSORS, 24)
    os.makedirs(os.path.join(priv, "empty"))
    os.symlink("/etc", os.path.join(priv, "out"))
    os.chmod(priv, 0o700)
    links = {}
    for name, target in (("to_missing", "../priv/missing.safetensors"), ("to_outside", "../priv/out/passwd"),
                         ("to_dir", "../priv/empty"), ("to_exists", "../priv/exists/model.safetensors")):
        os.makedirs(os.path.join(tree, name))
        os.symlink(target, os.path.join(tree, name, "model.safetensors"))
        links[name] = os.path.join(tree, name)
    ix = os.path.join(tree, "index_to_missing")
    os.makedirs(ix)
    os.symlink("../priv/missing.safetensors", os.path.join(ix, "a.safetensors"))
    with open(os.path.join(ix, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"w": "a.safetensors"}}, f)
    d = start_daemon(SETTINGS, roots=[tree], public=True)
    behind = [os.path.join(priv, n) for n in ("missing", "out", "out/passwd", "exists", "empty", "exists/nothing")]
    reqs = []
    for i, p in enumerate(behind):
        reqs += [{"op": "open", "id": 100 + 2 * i, "path": p}, {"op": "close", "id": 101 + 2 * i, "path": p}]
    for i, p in enumerate(list(links.values()) + [ix]):
        reqs.append({"op": "open", "id": 200 + i, "path": p})
    _, got = as_client(d.socket, reqs)
    for q in reqs:
        m = got[q["id"]]
        err = m.get("error", {})
        assert err.get("code") == "PERMISSION" and f"may not search {priv}" in err["message"], (q, m)
    d.assert_alive()


def test_attach_by_set_id_once_the_files_are_gone_or_replaced(start_daemon, tree):
    """A set outlives its files: once they are deleted or replaced, an attach by its id cannot show the client's
    access to what was read, so it is PERMISSION, but for the set's own loader (and root)."""
    own = write_single(os.path.join(tree, "own"), TINY_TENSORS, 25)
    gone = write_single(os.path.join(tree, "gone"), TINY_TENSORS, 26)
    priv = private_checkpoint(tree, "replaced")
    d = start_daemon({"allowed_gids": str(NOBODY), "socket_mode": "0666"}, roots=[tree], public=True)
    _, got = as_client(d.socket, [{"op": "load", "id": 10, "path": own, "device": 0}])
    own_sid = got[10]["set"]
    with d.connect() as root:
        gone_sid = root.call("load", path=gone)["set"]
        priv_sid = root.call("load", path=priv)["set"]
        shutil.rmtree(own)
        shutil.rmtree(gone)
        # The root-only shard replaced by a readable file of other bytes, in a directory now open to all.
        new = os.path.join(priv, "new.safetensors")
        write_safetensors(new, TINY_TENSORS, seed=27)
        os.rename(new, os.path.join(priv, "model.safetensors"))
        os.chmod(priv, 0o755)
        attach = [{"op": "attach", "id": 10 + i, "set": s} for i, s in enumerate((own_sid, gone_sid, priv_sid))]
        _, got = as_client(d.socket, attach + [{"op": "status", "id": 20}])
        st = got[20]  # its own set shows to its loader; the others' files cannot be shown to be its to read
        assert [s["set"] for s in st["sets"]] == [own_sid] and st["sets_hidden"] == 2, st
        assert st["checkpoints"] == [] and st["checkpoints_hidden"] == 3, st
        assert got[10].get("ok") is True and got[10]["set"] == own_sid, got[10]
        for i, sid in ((11, gone_sid), (12, priv_sid)):
            err = got[i].get("error", {})
            assert err.get("code") == "PERMISSION" and sid in err["message"] and "cannot be shown" in err["message"], got[i]
        _, got = as_client(d.socket, [{"op": "attach", "id": 10, "set": own_sid}], uid=OTHER_UID)
        err = got[10].get("error", {})
        assert err.get("code") == "PERMISSION" and "cannot be shown" in err["message"], got[10]
        for sid in (own_sid, gone_sid, priv_sid):  # root is served all three
            m, fds = root.request("attach", set=sid)
            for fd in fds:
                os.close(fd)
            assert m.get("ok") is True, m
        assert sorted(s["leases"] for s in root.status()["sets"]) == [1, 1, 1]
    d.assert_alive()


def test_status_shows_only_what_the_client_may_read(start_daemon, tree):
    """status for a client that is no admin lists only the checkpoints it may read, their sets and leases, and
    counts what it hid; no path of the rest shows anywhere (metrics labels included). Root and a member of
    admin_gids see everything; weightctl status prints the counts."""
    from cliutil import ctl

    priv = private_checkpoint(tree, "SECRETNAME")
    pub = write_single(os.path.join(tree, "pub"), TINY_TENSORS, 28)
    d = start_daemon({"allowed_gids": str(NOBODY), "socket_mode": "0666", "admin_gids": str(GROUP)}, roots=[tree],
                     public=True)
    with d.connect() as root:
        root.call("load", path=priv)
        _, fd = root.attach(path=priv, device=0)  # a lease of the hidden set
        os.close(fd)
        root.call("load", path=pub)
        _, got = as_client(d.socket, [{"op": "status", "id": 10}])
        st = got[10]
        assert st.get("ok") is True, st
        assert [c["path"] for c in st["checkpoints"]] == [pub]
        assert [s["path"] for s in st["sets"]] == [pub]
        assert st["leases"] == []
        assert (st["checkpoints_hidden"], st["sets_hidden"], st["leases_hidden"]) == (1, 1, 1)
        assert st["totals"]["checkpoints"] == 1 and st["totals"]["sets"] == 1
        assert "SECRETNAME" not in json.dumps(st), st
        # A member of admin_gids, and root, see all of it.
        _, got = as_client(d.socket, [{"op": "status", "id": 10}], groups=(GROUP,))
        for st in (got[10], root.status()):
            assert sorted(c["path"] for c in st["checkpoints"]) == sorted([priv, pub]), st
            assert len(st["sets"]) == 2 and len(st["leases"]) == 1
            assert (st["checkpoints_hidden"], st["sets_hidden"], st["leases_hidden"]) == (0, 0, 0)
            assert any(s["labels"].get("path") == priv for s in st["metrics"]["weightd_checkpoint_bytes"]["samples"])
        # Once nobody may read the private one, it shows there too (the verdict is not kept past its files' state).
        os.chmod(priv, 0o755)
        os.chmod(os.path.join(priv, "model.safetensors"), 0o644)
        _, got = as_client(d.socket, [{"op": "status", "id": 10}])
        assert sorted(c["path"] for c in got[10]["checkpoints"]) == sorted([priv, pub]), got[10]
        os.chmod(priv, 0o700)
        res = ctl("--socket", d.socket, "status", user=NOBODY)
        assert res.code == 0, res.describe()
        assert "checkpoints (1), 1 more hidden" in res.out and "sets (1), 1 more hidden" in res.out, res.out
        assert "SECRETNAME" not in res.out + res.err, res.out
    d.assert_alive()


def test_status_hides_the_paths_of_other_clients_requests(start_daemon, tree):
    """A load root started (held at the test load gate) is listed to nobody as a request of uid 0, without the
    path or set it works on; nobody's own requests keep theirs."""
    priv = private_checkpoint(tree, "SECRETNAME")
    gate = os.path.join(tree, "gate")
    os.mkfifo(gate)
    held = os.open(gate, os.O_RDWR | os.O_NONBLOCK)  # shut while open: the load waits at its first window
    try:
        d = start_daemon({"allowed_gids": str(NOBODY), "socket_mode": "0666", "test_load_gate": gate},
                         roots=[tree], public=True)
        with d.connect() as root:
            rid = root.start("load", path=priv, device=0)
            for _ in range(3000):
                if any(x["op"] == "load" for x in root.status()["requests"]):
                    break
            (mine,) = [x for x in root.status()["requests"] if x["op"] == "load"]
            assert mine["path"] == priv, mine  # root sees it whole
            _, got = as_client(d.socket, [{"op": "status", "id": 10}])
            st = got[10]
            (theirs,) = [x for x in st["requests"] if x["op"] == "load"]
            assert theirs["uid"] == 0 and "path" not in theirs and "set" not in theirs, theirs
            assert "SECRETNAME" not in json.dumps(st), st
            assert st["sets_hidden"] == 1 and st["sets"] == [], st
            os.close(held)
            held = -1
            m, _ = root.wait(rid)
            assert m.get("ok") is True, m
        d.assert_alive()
    finally:
        if held >= 0:
            os.close(held)


def test_close_does_not_tell_whether_an_unreadable_checkpoint_is_open(start_daemon, tree):
    """Two checkpoints of files nobody may read (in directories it may search), one open (by root), one not:
    nobody's close gets the same answer for both; a readable one it opened itself it closes; an admin is told."""
    answers = {}
    d = start_daemon(dict(SETTINGS, admin_gids=str(GROUP)), roots=[tree], public=True)
    paths = {}
    for name in ("opened", "notopen"):
        ck = write_single(os.path.join(tree, name), TINY_TENSORS, 29)
        os.chmod(os.path.join(ck, "model.safetensors"), 0o600)
        paths[name] = ck
    pub = write_single(os.path.join(tree, "pub"), TINY_TENSORS, 30)
    with d.connect() as root:
        root.call("open", path=paths["opened"])
        _, got = as_client(d.socket, [{"op": "close", "id": 10, "path": paths["opened"]},
                                      {"op": "close", "id": 11, "path": paths["notopen"]},
                                      {"op": "open", "id": 12, "path": pub}, {"op": "close", "id": 13, "path": pub}])
        for i, name in ((10, "opened"), (11, "notopen")):
            err = got[i].get("error", {})
            answers[name] = (err.get("code"), err.get("message", "").replace(paths[name], "CK"))
        assert answers["opened"] == answers["notopen"] and answers["opened"][0] == "NOT_FOUND", answers
        assert got[13].get("closed") is True, got[13]
        # A member of admin_gids, who sees it in status anyway, is told why it may not close it.
        _, got = as_client(d.socket, [{"op": "close", "id": 10, "path": paths["opened"]}], groups=(GROUP,))
        err = got[10].get("error", {})
        assert err.get("code") == "PERMISSION" and "may not read" in err["message"], got[10]
        assert [c["path"] for c in root.status()["checkpoints"]] == [paths["opened"]]  # still open for root
        assert root.error("close", path=paths["notopen"]) == "NOT_FOUND"
        assert root.call("close", path=paths["opened"])["closed"] is True
    d.assert_alive()


def test_admin_group_past_the_64th(start_daemon, tree):
    """admin_gids counts every supplementary group: a client whose admin group is its 100th (the highest, so the
    kernel lists it last) sees root's checkpoints in status and may evict root's set."""
    last = 64000
    groups = [50000 + i for i in range(99)] + [last]
    priv = private_checkpoint(tree)
    d = start_daemon({"allowed_gids": str(NOBODY), "socket_mode": "0666", "admin_gids": str(last)}, roots=[tree],
                     public=True)
    with d.connect() as root:
        sid = root.call("load", path=priv)["set"]
        _, got = as_client(d.socket, [{"op": "status", "id": 10}, {"op": "evict", "id": 11, "set": sid}],
                           groups=groups)
        assert got[11].get("evicted") == [sid], got[11]
        assert [c["path"] for c in got[10]["checkpoints"]] == [priv] and got[10]["checkpoints_hidden"] == 0, got[10]
        assert root.status()["sets"] == []
    d.assert_alive()
