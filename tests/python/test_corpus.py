"""The malformed corpus: weightctl and the reference must agree on every file.

Each case is one file; the reference's verdict is whether
`safetensors.deserialize` raises, weightctl's is `inspect --json`'s exit code.
Where both accept, the reported layout must match too. Every disagreement is
printed with the case's bytes (hex of the prefix and header) and both verdicts.

WD_CORPUS_SEED and WD_CORPUS_MUTATIONS change the random part (defaults:
20261130 and 3000 cases).
"""
import concurrent.futures
import json
import os
import struct
import subprocess

import malformed_corpus
import stref

SEED = int(os.environ.get("WD_CORPUS_SEED", "20261130"))
MUTATIONS = int(os.environ.get("WD_CORPUS_MUTATIONS", "3000"))
MAX_REPORTED = 40


def run_inspect(path):
    p = subprocess.run([stref.weightctl_path(), "inspect", str(path), "--json"], capture_output=True,
                       timeout=stref.CTL_TIMEOUT_S)
    return p.returncode, p.stdout, p.stderr


def judge_all(tmp_path, cases):
    """Runs every case; returns a list of disagreement reports."""
    d = tmp_path / "corpus"
    d.mkdir()
    paths = []
    for i, (_, buf) in enumerate(cases):
        path = d / f"case{i:05d}.safetensors"
        path.write_bytes(buf)
        paths.append(path)
    workers = min(16, 2 * (os.cpu_count() or 2))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(run_inspect, paths))
    reports = []
    for (label, buf), path, (rc, out, err) in zip(cases, paths, results):
        ref = stref.reference(buf)
        problems = []
        if rc < 0:
            problems.append(f"weightctl killed by signal {-rc}")
        elif rc not in (0, 1):
            problems.append(f"weightctl exit {rc} (expected 0 or 1)")
        elif (rc == 0) != ref.ok:
            problems.append("verdicts differ")
        elif rc == 1:
            res = stref.CtlResult([], rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
            why = stref.error_line_problem(res)
            if why:
                problems.append(why)
        else:
            try:
                js = json.loads(out)
                problems += stref.compare_file(ref, js, path.name)
            except ValueError as e:
                problems.append(f"inspect --json printed invalid JSON: {e}")
        if problems:
            reports.append(
                f"case {label} ({path.name}):\n"
                f"    {'; '.join(problems[:6])}\n"
                f"    reference: {'valid' if ref.ok else 'invalid: ' + ref.error}\n"
                f"    weightctl: exit {rc}, stderr {err.decode('utf-8', 'replace').strip()[:300]!r}\n"
                f"    {stref.hexdump_case(buf, 1024)}")
    return reports


def assert_agree(tmp_path, cases, what):
    reports = judge_all(tmp_path, cases)
    if reports:
        shown = "\n".join(reports[:MAX_REPORTED])
        more = f"\n... and {len(reports) - MAX_REPORTED} more" if len(reports) > MAX_REPORTED else ""
        raise AssertionError(f"{len(reports)} of {len(cases)} {what} cases disagree "
                             f"(files kept in {tmp_path / 'corpus'}):\n{shown}{more}")


def test_hand_corpus_covers_both_verdicts():
    """The hand-written corpus is not one-sided (a generator bug would make it so)."""
    cases = malformed_corpus.hand_cases()
    valid = sum(stref.reference(buf).ok for _, buf in cases)
    assert len(cases) >= 600 and valid >= 150 and len(cases) - valid >= 350, (len(cases), valid)


def test_hand_corpus(tmp_path, weightctl):
    assert_agree(tmp_path, malformed_corpus.hand_cases(), "hand-written")


def test_mutation_corpus(tmp_path, weightctl):
    cases = malformed_corpus.mutation_cases(SEED, MUTATIONS)
    valid = sum(stref.reference(buf).ok for _, buf in cases)
    assert valid >= MUTATIONS // 20, f"only {valid} mutated files are valid: the mutations are too blunt"
    assert_agree(tmp_path, cases, f"mutated (seed {SEED})")


def test_header_length_limit(tmp_path, weightctl):
    """n = 100,000,000 is the largest header the reference reads; one more is refused."""
    tensor = '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    for n, want in ((100_000_000, True), (100_000_001, False)):
        buf = struct.pack("<Q", n) + tensor.encode() + b" " * (n - len(tensor)) + b"\x01\x02\x03\x04"
        ref = stref.reference(buf)
        assert ref.ok == want, ref.error
        path = tmp_path / f"n{n}.safetensors"
        path.write_bytes(buf)
        del buf
        res = stref.run_ctl(["inspect", str(path), "--json"])
        assert (res.returncode == 0) == want, f"n={n}: reference {'valid' if want else 'invalid'}; " + res.describe()
        if want:
            assert json.loads(res.stdout)["shards"][0]["header_bytes"] == n
        else:
            assert stref.error_line_problem(res) is None, res.describe()
        path.unlink()
