"""Records, from a vLLM wheel's Python sources, the facts the plugin's interface checks need.

    pip download vllm==0.34.0 --no-deps -d /tmp/vllmwheels
    python tests/python/record_vllm_interfaces.py /tmp/vllmwheels/vllm-0.34.0-*.whl

writes tests/fixtures/vllm/vllm-0.34.0.json: the wheel's name and sha256, and
for every need of weightd_vllm.interfaces.NEEDS the facts of that object that
the need asks about (None where the wheel has no such object), read with
``ast`` (weightd_vllm.interfaces.SourceTree, the plugin's own reader) from the files
inside the wheel. Nothing is installed or imported from the wheel. CI checks
the plugin's rules against these files (tests/python_vllm/test_interfaces.py).
"""
import argparse
import hashlib
import json
import os
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))

from weightd_vllm import interfaces  # noqa: E402

OUT = os.path.join(REPO, "tests", "fixtures", "vllm")


def wheel_version(z):
    """The Version: of the wheel's METADATA."""
    for name in z.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in z.read(name).decode().splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    raise SystemExit("the wheel has no METADATA with a Version")


def record(wheel):
    with open(wheel, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())

        def read(rel):
            return z.read(rel).decode("utf-8") if rel in names else None

        tree = interfaces.SourceTree(read)
        objects = {f"{n.module}:{n.name}": interfaces.relevant(n, tree.lookup(n.module, n.name))
                   for n in interfaces.NEEDS}
        version = wheel_version(z)
    return {"vllm": version, "wheel": os.path.basename(wheel), "sha256": sha,
            "recorded_by": "tests/python/record_vllm_interfaces.py", "objects": objects}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", nargs="+", help="vLLM wheels (pip download vllm==X --no-deps)")
    ap.add_argument("--out", default=OUT, help="the directory the fixtures go to")
    a = ap.parse_args()
    for wheel in a.wheels:
        data = record(wheel)
        path = os.path.join(a.out, f"vllm-{data['vllm']}.json")
        with open(path, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        problems = interfaces.check(interfaces.FixtureInterface(data))
        print(f"{path}: {len(data['objects'])} objects, {len(problems)} problem(s)")
        for p in problems:
            print(f"  {p}")


if __name__ == "__main__":
    main()
