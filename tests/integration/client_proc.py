"""A client in its own process, for tests that kill clients.

usage: client_proc.py SOCKET attach PATH   attach (loading if needed), map the memfd,
                                          print {"lease": ...}, then sleep
       client_proc.py SOCKET load PATH     start a load, print the first progress
                                          event, then keep reading (never exits)

Each milestone is one JSON line on stdout, flushed, so the parent can wait for it.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import wdclient  # noqa: E402


def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(sock, mode, path):
    c = wdclient.Conn(sock)
    if mode == "attach":
        att, fd = c.attach(path=path, device=0)
        m, size = wdclient.map_readonly(fd)
        first = m[0:1]
        say({"lease": att["lease"], "set": att["set"], "bytes": size, "first": first.hex()})
        while True:
            time.sleep(3600)
    elif mode == "load":
        rid = c.start("load", path=path, device=0)
        said = []

        def on_event(ev):
            if not said:
                said.append(ev)
                say({"progress": ev["bytes_done"], "total": ev["bytes_total"]})

        rep, _ = c.wait(rid, on_event)
        say({"reply": rep})
        while True:
            time.sleep(3600)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
