"""weightctl's and weightd's command lines: misspelt options and commands named with the
closest valid one, --opt=value, help for every command and option, exit codes in the help,
the man pages and the bash completion generated from the same tables.

None of these needs a daemon: usage errors are found before anything connects.
"""
import os
import re
import subprocess

import pytest

from cliutil import ctl, json_error, json_out, one_error_line, weightd
from conftest import WEIGHTCTL

COMMANDS = ["status", "health", "open", "prefetch", "load", "attach", "prewarm", "cancel", "release", "evict",
            "shutdown", "inspect", "plan", "export", "mkcheckpoint", "demo"]


# ---- misspellings ----------------------------------------------------------------------------


@pytest.mark.parametrize("args,bad,good", [
    (["load", "--tp-sise", "2", "/x"], "--tp-sise", "--tp-size"),
    (["status", "--jsn"], "--jsn", "--json"),
    (["prewarm", "/x", "--devcie", "0"], "--devcie", "--device"),
    (["attach", "s1", "--verfy"], "--verfy", "--verify"),
    (["prefetch", "/x", "--wiat"], "--wiat", "--wait"),
    (["export", "/x", "--out", "/y", "--max-shard-bites", "9"], "--max-shard-bites", "--max-shard-bytes"),
    (["--sokcet", "/s", "status"], "--sokcet", "--socket"),
])
def test_misspelt_option_is_named_with_a_suggestion(args, bad, good):
    """The first friction of the issue: a typo printed only the usage line."""
    res = ctl("--socket", "/nonexistent/s", *args) if args[0] != "--sokcet" else ctl(*args)
    line = one_error_line(res, 2, f"'{bad}'", f"did you mean '{good}'?")
    assert "help" in line, line


def test_misspelt_option_in_json_mode():
    res = ctl("status", "--jsn", "--json")
    msg = json_error(res, "USAGE", 2)
    assert "--jsn" in msg and "--json" in msg


def test_unknown_command_and_help_topic():
    one_error_line(ctl("stauts"), 2, "'stauts'", "did you mean 'status'?")
    one_error_line(ctl("help", "prewarn"), 2, "'prewarn'", "did you mean 'prewarm'?")
    one_error_line(ctl("load"), 2, "load needs PATH")
    one_error_line(ctl("load", "/a", "/b"), 2, "unexpected argument '/b'")
    one_error_line(ctl("load", "/x", "--device"), 2, "--device needs a value")
    one_error_line(ctl("status", "--json=yes"), 2, "--json takes no value")
    one_error_line(ctl("load", "/x", "--tp", "2"), 2, "ambiguous", "--tp-size", "--tp-rank")


def test_option_equals_value(tiny, tmp_path):
    """--opt=value is the same as --opt value, for global and command options alike."""
    a = ctl("plan", tiny["a"], "--preset=whole", "--json")
    b = ctl("plan", tiny["a"], "--preset", "whole", "--json")
    assert a.code == 0 and b.code == 0, a.describe() + b.describe()
    assert json_out(a) == json_out(b)
    res = ctl(f"--socket={tmp_path}/none.sock", "status")
    assert res.code == 3 and f"{tmp_path}/none.sock" in res.err, res.describe()
    res = ctl("status", f"--socket={tmp_path}/none.sock", "--timeout=5s")
    assert res.code == 3 and f"{tmp_path}/none.sock" in res.err, res.describe()
    one_error_line(ctl("status", "--timeout=soon"), 2, "--timeout", "'soon'")


# ---- help ---------------------------------------------------------------------------------------


def option_lines(text):
    """{option: its help text} from a help listing ("  -h, --help  Describe ..." and continuation lines)."""
    opts, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (?:-\w, )?\s*(--[a-z][a-z0-9-]*)(?: [A-Z][A-Z=.]*)?(\s+(.*))?$", line)
        if m:
            cur = m.group(1)
            opts[cur] = (m.group(3) or "").strip()
        elif cur and line.startswith(" " * 20) and line.strip():
            opts[cur] = (opts[cur] + " " + line.strip()).strip()
        elif not line.strip() or not line.startswith(" "):
            cur = None
    return opts


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_describes_every_option(cmd):
    """`help CMD` and `CMD --help` agree, exit 0 and say what every option does."""
    a, b = ctl("help", cmd), ctl(cmd, "--help")
    assert a.code == 0 and b.code == 0 and a.out == b.out, a.describe() + b.describe()
    assert a.out.startswith(f"usage: weightctl {cmd}"), a.out
    opts = option_lines(a.out)
    assert "--help" in opts and "--json" in opts, a.out
    for name, text in opts.items():
        assert len(text) >= 10, f"{cmd} {name} is not described: {text!r}\n{a.out}"
    assert re.search(r"^  3  the daemon cannot be reached", a.out, re.M), a.out
    assert re.search(r"^  4  timed out", a.out, re.M), a.out


def test_global_help_lists_commands_and_exit_codes():
    res = ctl("--help")
    assert res.code == 0, res.describe()
    for c in COMMANDS:
        assert re.search(rf"^  {c} ", res.out, re.M), f"{c} missing from --help"
    assert "  2  usage error" in res.out and "  4  timed out" in res.out


def test_help_of_plan_flags_is_shared():
    """load, attach, prewarm, plan and export take the plan flags, each described."""
    for cmd in ("load", "attach", "prewarm", "plan", "export"):
        opts = option_lines(ctl("help", cmd).out)
        for f in ("--preset", "--plan", "--tp-size", "--tp-rank", "--ep-size", "--ep-rank", "--experts", "--fuse"):
            assert f in opts, f"{cmd}: {f} missing"


# ---- weightd's flags --------------------------------------------------------------------------


def test_weightd_misspelt_flag():
    """weightd --foregrund used to say 'needs a value or is unknown' and dump the config table."""
    res = weightd("--foregrund")
    assert res.code == 2, res.describe()
    assert res.err.splitlines() == [
        "weightd: unknown option '--foregrund'; did you mean '--foreground'? (weightd --help lists the options)"
    ], res.describe()
    res = weightd("--log-levl", "debug")
    assert res.code == 2 and "did you mean '--log-level'?" in res.err, res.describe()
    res = weightd("--socket")
    assert res.code == 2 and "--socket needs a value" in res.err, res.describe()
    res = weightd("stray")
    assert res.code == 2 and "unexpected argument 'stray'" in res.err, res.describe()


def test_weightd_help_and_equals_form(tmp_path):
    res = weightd("--help")
    assert res.code == 0, res.describe()
    for flag in ("--config FILE", "--socket PATH", "--backend NAME", "--model-root DIR", "--foreground",
                 "--log-level LEVEL", "--set KEY=VALUE", "device_memory_budget"):
        assert flag in res.out, flag
    # --opt=value reaches the configuration: a bad value is named.
    res = weightd("--backend=gpu", f"--socket={tmp_path}/s.sock", "--foreground")
    assert res.code == 1 and "'gpu' is not one of auto, cuda, host" in res.err, res.describe()
    res = weightd("--set", "job_thread=2", "--foreground")
    assert res.code == 1 and "did you mean 'job_threads'?" in res.err, res.describe()


# ---- man pages and completion ---------------------------------------------------------------------


def test_man_pages_come_from_the_tables():
    res = ctl("--generate-man")
    assert res.code == 0 and res.out.startswith(".TH WEIGHTCTL 1"), res.describe()[:2000]
    for c in COMMANDS:
        assert f'.SS "{c}' in res.out, c
    for flag in ("tp\\-size", "timeout", "verify", "max\\-shard\\-bytes"):
        assert f"\\fB\\-\\-{flag}\\fR" in res.out, flag
    d = weightd("--generate-man")
    assert d.code == 0 and d.out.startswith(".TH WEIGHTD 8") and "\\fB\\-\\-foreground\\fR" in d.out
    # The build generated the same files next to the binaries, for cmake --install.
    gen = os.path.join(os.path.dirname(WEIGHTCTL), "generated")
    with open(os.path.join(gen, "weightctl.1")) as f:
        assert f.read() == res.out
    with open(os.path.join(gen, "weightd.8")) as f:
        assert f.read() == d.out
    # groff reads them without complaint (where man is installed).
    for page in ("weightctl.1", "weightd.8"):
        try:
            p = subprocess.run(["man", "--warnings", "-l", os.path.join(gen, page)], capture_output=True,
                               text=True, timeout=60, env=dict(os.environ, MANWIDTH="80"))
        except FileNotFoundError:
            break
        assert p.returncode == 0 and "warning" not in p.stderr, p.stderr


def complete(line):
    """What bash completes for `line` with the generated completion loaded."""
    script = ctl("--generate-completion").out
    words = line.split(" ")
    prog = (script + "\nCOMP_WORDS=(" + " ".join(f"'{w}'" for w in words) + ")\n"
            f"COMP_CWORD={len(words) - 1}\n_weightctl\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
    p = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return sorted(p.stdout.split())


def test_bash_completion():
    assert complete("weightctl lo") == ["load"]
    assert complete("weightctl pre") == ["prefetch", "prewarm"]
    assert complete("weightctl load /x --tp-s") == ["--tp-size"]
    assert complete("weightctl --json prewarm /x --d") == ["--device"]
    assert complete("weightctl plan /x --preset ") == ["auto", "deepseek_v3", "dense", "qwen3_moe", "whole"]
    assert complete("weightctl help ev") == ["evict"]
    assert "--verify" in complete("weightctl attach s1 --")
