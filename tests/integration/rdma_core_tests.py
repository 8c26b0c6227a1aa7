#!/usr/bin/env python3
"""rdma-core's own test suite, baseline against preloaded libkrcore.so.

Runs the unmodified tests/ directory of rdma-core v44.0
(../shared/rdma-core-tests) three times in the same boot, inside the
Soft-RoCE VM (scripts/vm-run.sh) or on a host that has an RDMA device: on
the plain libibverbs, with LD_PRELOAD=libkrcore.so, and preloaded with
KRCORE_VIRTUALIZE=1 (a krcore-meta started here: the RC QPs become virtual;
a test may then differ from the baseline only if VIRT_EXCEPTIONS lists it,
with the reason). unittest's verbose output of
each run is parsed into one outcome per test (ok, skipped, FAIL, ERROR,
expected failure, unexpected success), keyed "module.Class.test", and the two
are compared: a test passes here when its outcome is the same in both modes,
whatever that outcome is (most vendor tests skip on rxe), and fails when it
differs, including a test that passes only preloaded.

The run as a whole also fails (each problem counted as one more failure in
the closing "N passed, M failed" line) when a run timed out, when the
baseline parsed fewer than --min-tests tests (a broken harness must not
pass), when unittest's own "Ran N tests" disagrees with the parse, or when
no process of the preloaded run wrote a stats file (KRCORE_STATS_FILE)
showing it opened a device context through the library.

Without the tests directory (a user's checkout has no ../shared) it says so
and exits 0. The tests need Debian's python3-pyverbs, built for the system
Python: they run under /usr/bin/python3, whatever python3 runs this script.

Python 3.11 standard library only. Typical use (as root, inside the VM):
    python3 tests/integration/rdma_core_tests.py --setup-rxe --out target/rdma-core-tests
Results: <out>/results.json and <out>/results.txt (one line per test).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODES = ("baseline", "preloaded", "virtualized")

# Tests whose outcome under KRCORE_VIRTUALIZE=1 may differ from the
# baseline's, by test key prefix, and why (docs/vqp.md lists them too).
# Each entry is a test that depends on what only a real QP has.
VIRT_EXCEPTIONS: dict[str, str] = {
    "test_atomic.AtomicTest.test_atomic_invalid_qp_access":
        "a VQP enforces the remote MR's access flags, not the responder QP's",
    "test_mr.MWTest.": "memory windows need a real QP (bind EOPNOTSUPP, BIND_MW/LOCAL_INV EINVAL)",
    "test_mr.MRTest.test_mr_rereg_access_bad_flow":
        "rxe cannot rereg (the baseline skips); a VQP's PD with links re-registers aside, and the "
        "old key keeps its remote access for peers until the MR lease ends (docs/vqp.md, the MR lease)",
}


def virt_exception(key: str) -> str | None:
    return next((why for k, why in VIRT_EXCEPTIONS.items() if key.startswith(k)), None)

# --------------------------------------------------------------------------
# Parsing unittest's verbose (-v) output (it goes to stderr).
#
# Python 3.11 prints one line per test:
#     test_reg_mr (tests.test_mr.MRTest.test_reg_mr) ... ok
# (3.10 and older: "(tests.test_mr.MRTest)"), with the first line of the
# docstring, if any, on a second line before " ... ". Text the test or a C
# library writes to stderr may land between " ... " and the status, so the
# status is taken as the first status word after " ... " either right after
# it or at the start of a later line, before the next test's line. Subtests
# are indented and carry "[msg]" / "(params)"; they are folded into their
# test. Class/module fixtures that fail print e.g. "setUpClass (tests.m.C)".

START = re.compile(r"^(?P<sub>  )?(?P<meth>\w+) \((?P<id>[\w.]+)\)(?P<rest>.*)$", re.M)
STATUS = re.compile(r"(?:^|\.\.\. )(?P<st>ok|FAIL|ERROR|expected failure|unexpected success"
                    r"|skipped\b(?P<why>.*))$", re.M)
RULE_EQ, RULE_DASH = "=" * 70, "-" * 70
RAN = re.compile(r"^Ran (\d+) tests? in ([\d.]+)s$", re.M)
FIXTURES = ("setUpClass", "tearDownClass", "setUpModule", "tearDownModule")
# Worst first: how subtest outcomes combine into their test's.
SEVERITY = ("ERROR", "FAIL", "unexpected success", "ok", "expected failure", "skipped")


def test_key(meth: str, ident: str) -> str:
    """'module.Class.test' without the package prefix ('tests.')."""
    if ident.startswith("tests."):
        ident = ident[len("tests."):]
    if meth in FIXTURES:                         # "setUpClass (tests.m.C)"
        return f"{ident}.{meth}"
    if not ident.endswith("." + meth):           # Python <= 3.10 prints the class only
        ident = f"{ident}.{meth}"
    return ident


def split_summary(text: str) -> tuple[str, str]:
    """The per-test lines, and the closing part (failure tracebacks, 'Ran N')."""
    cut = len(text)
    m = re.search(rf"^{RULE_EQ}$", text, re.M)
    if m:
        cut = m.start()
    m = re.search(rf"^{RULE_DASH}\nRan \d+ test", text, re.M)
    if m and m.start() < cut:
        cut = m.start()
    return text[:cut], text[cut:]


def parse_tracebacks(summary: str) -> dict[str, str]:
    """'FAIL: test_x (tests.m.C.test_x)' blocks -> {key: traceback text}."""
    out: dict[str, str] = {}
    blocks = re.split(rf"^{RULE_EQ}$\n", summary, flags=re.M)
    for b in blocks[1:]:
        head, _, body = b.partition(RULE_DASH + "\n")
        m = re.match(r"(?:FAIL|ERROR|UNEXPECTED SUCCESS): (\w+) \(([\w.]+)\)", head)
        if not m:
            continue
        body = re.split(rf"^{RULE_DASH}\nRan \d+ test", body, flags=re.M)[0].strip("\n")
        key = test_key(m[1], m[2])
        out[key] = (out[key] + "\n\n" + body) if key in out else body
    return out


def parse_unittest(text: str) -> dict:
    """unittest -v output -> {'tests': {key: {...}}, 'ran': N or None, ...}."""
    text = text.replace("\r", "")
    body, summary = split_summary(text)
    starts = list(START.finditer(body))
    tests: dict[str, dict] = {}
    subs: dict[str, list[str]] = {}
    for i, m in enumerate(starts):
        seg = body[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(body)]
        dots = (m["rest"] + seg).find(" ... ")
        st = STATUS.search((m["rest"] + seg)[dots:]) if dots >= 0 else None
        key = test_key(m["meth"], m["id"])
        if m["sub"] and m["rest"].strip():           # a subtest: fold into its test
            if st:
                subs.setdefault(key, []).append(st["st"].split()[0] if st["st"].startswith(
                    "skipped") else st["st"])
            continue
        ent = tests.setdefault(key, {"outcome": None})
        if st:
            if st["st"].startswith("skipped"):
                ent["outcome"] = "skipped"
                ent["reason"] = (st["why"] or "").strip().strip("'\"")
            else:
                ent["outcome"] = st["st"]
    for key, sts in subs.items():
        ent = tests.setdefault(key, {"outcome": None})
        worst = min(sts, key=SEVERITY.index)
        if ent["outcome"] is None or SEVERITY.index(worst) < SEVERITY.index(ent["outcome"]):
            if worst in ("ERROR", "FAIL") or ent["outcome"] is None:
                ent["outcome"] = worst
                ent["subtests"] = sts
    for ent in tests.values():
        if ent["outcome"] is None:
            ent["outcome"] = "no result"             # started, never finished (crash, kill)
    for key, tb in parse_tracebacks(summary).items():
        tests.setdefault(key, {"outcome": "no result"})["traceback"] = tb
    ran = RAN.search(summary)
    fin = re.search(r"^(OK|FAILED)\b(.*)$", summary, re.M)
    return {"tests": tests, "ran": int(ran[1]) if ran else None,
            "ran_seconds": float(ran[2]) if ran else None,
            "verdict": (fin[1] + fin[2]).strip() if fin else None}


def last_error_line(tb: str | None) -> str:
    """The exception line(s) at the end of a traceback, for the table."""
    if not tb:
        return ""
    lines = [x for x in tb.splitlines() if x.strip()]
    # From the last line that is not indented (the exception) to the end.
    for i in range(len(lines) - 1, -1, -1):
        if not lines[i].startswith((" ", "\t")):
            return " | ".join(lines[i:])[:300]
    return lines[-1][:300] if lines else ""


# --------------------------------------------------------------------------
# Running

def clean_env() -> dict[str, str]:
    """Nothing of the caller's krcore or Python settings leaks into the runs."""
    drop = ("LD_PRELOAD", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KRCORE_") and k not in drop}
    # The tests directory is read-only: no __pycache__. Unbuffered: the test
    # lines and anything a test prints keep their order.
    env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    return env


def run_mode(a, mode: str, out: Path) -> dict:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = clean_env()
    if mode != "baseline":
        for old in out.glob("stats-*.json"):
            old.unlink()
        env["KRCORE_STATS_FILE"] = str(out / "stats-%p.json")
        env["LD_PRELOAD"] = str(Path(a.lib).resolve())
    if mode == "virtualized":
        env.update(KRCORE_VIRTUALIZE="1", KRCORE_META=a.meta, KRCORE_GID_INDEX=str(a.gid))
    argv = [a.python, "run_tests.py", "--dev", a.dev, "--port", str(a.port),
            "--gid", str(a.gid), "-v", *a.unittest_args]
    res = {"argv": argv, "cwd": str(a.tests_dir), "errors": []}
    print(f"==> {mode}: {' '.join(argv)}" + (f"  (LD_PRELOAD={env['LD_PRELOAD']})"
                                              if mode != "baseline" else ""), flush=True)
    t0 = time.monotonic()
    with open(logs / f"{mode}.err", "wb") as fe, open(logs / f"{mode}.out", "wb") as fo:
        try:
            p = subprocess.Popen(argv, cwd=a.tests_dir, env=env, stdin=subprocess.DEVNULL,
                                 stdout=fo, stderr=fe, start_new_session=True)
        except OSError as e:
            res["errors"].append(f"cannot start: {e}")
            return res
        try:
            res["rc"] = p.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            res["rc"] = None
            res["errors"].append(f"timed out after {a.timeout:.0f} s (process group killed)")
        finally:
            # The whole group: forked test processes (rdmacm, test_device) too.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    res["pid"] = p.pid
    res["seconds"] = round(time.monotonic() - t0, 1)
    text = (logs / f"{mode}.err").read_text(errors="replace")
    parsed = parse_unittest(text)
    res.update(ran=parsed["ran"], verdict=parsed["verdict"], tests=parsed["tests"])
    n = sum(not k.endswith(FIXTURES) for k in parsed["tests"])
    res["parsed"] = n
    if res["rc"] is not None and parsed["ran"] is None:
        res["errors"].append(f"exit {res['rc']} without unittest's 'Ran N tests' line "
                             "(crashed?)")
    if parsed["ran"] is not None and parsed["ran"] != n:
        res["errors"].append(f"unittest ran {parsed['ran']} tests but {n} results were parsed")
    if mode != "baseline":
        res["stats"], err = read_stats(out, p.pid)
        if err:
            res["errors"].append(err)
        if mode == "virtualized" and not res["stats"]["total"].get("qps_virtualized"):
            res["errors"].append("no QP was virtualized (qps_virtualized = 0 in every process)")
    counts: dict[str, int] = {}
    for t in parsed["tests"].values():
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    res["counts"] = counts
    print(f"    {mode}: {res['seconds']} s, exit {res['rc']}, {n} tests parsed "
          f"(unittest: Ran {parsed['ran']}, {parsed['verdict']}): "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), flush=True)
    return res


def start_meta(a, out: Path) -> tuple[subprocess.Popen, str]:
    """krcore-meta (next to the library) for the virtualized run, waited for."""
    log = out / "logs" / "krcore-meta"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{log}.out", "wb") as fo:
        p = subprocess.Popen([str(Path(a.lib).resolve().parent / "krcore-meta"), "--listen",
                              a.meta_listen, "--slots", "65536"], env=clean_env(),
                             stdin=subprocess.DEVNULL, stdout=fo, stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.monotonic() + 30
    while "serving on" not in Path(f"{log}.out").read_text(errors="replace"):
        if p.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"krcore-meta did not start (see {log}.out)")
        time.sleep(0.05)
    return p, a.meta_listen


def read_stats(out: Path, main_pid: int) -> tuple[dict, str | None]:
    """The library writes <out>/stats-<pid>.json at each process's exit; at
    least one must show a context opened through it."""
    per_pid, bad = {}, []
    for f in sorted(out.glob("stats-*.json")):
        try:
            c = json.loads(f.read_text()).get("counters")
        except (OSError, ValueError, AttributeError) as e:
            bad.append(f"{f.name}: {e}")
            continue
        if isinstance(c, dict):
            per_pid[f.stem[len("stats-"):]] = c
        else:
            bad.append(f"{f.name}: no counters")
    opened = {p: c.get("contexts_opened", 0) for p, c in per_pid.items()}
    summary = {"processes": len(per_pid), "main_pid_file": str(main_pid) in per_pid,
               "contexts_opened": opened, "unreadable": bad,
               "total": {k: sum(c.get(k, 0) for c in per_pid.values()
                                if isinstance(c.get(k, 0), int))
                         for k in sorted({k for c in per_pid.values() for k in c})}}
    if not per_pid:
        return summary, ("no stats file from any process (KRCORE_STATS_FILE): "
                         "the library was not on the path")
    if not any(isinstance(v, int) and v >= 1 for v in opened.values()):
        return summary, f"no process opened a context through the library ({opened})"
    return summary, None


# --------------------------------------------------------------------------
# Comparing and reporting

def compare(runs: dict) -> dict[str, dict]:
    keys = sorted(set().union(*(r.get("tests", {}).keys() for r in runs.values())))
    rows = {}
    for k in keys:
        row = {}
        for m in MODES:
            t = runs.get(m, {}).get("tests", {}).get(k)
            row[m] = t["outcome"] if t else "not run"
            if t and t.get("reason"):
                row[f"{m}_reason"] = t["reason"]
            if t and t.get("traceback"):
                row[f"{m}_error"] = last_error_line(t["traceback"])
        # Baseline only (--no-preload): nothing to compare.
        row["same"] = row["baseline"] == row["preloaded"] or "preloaded" not in runs
        if "virtualized" in runs and row["baseline"] != row["virtualized"]:
            row["virt_exception"] = virt_exception(k)
            row["same"] = row["same"] and row["virt_exception"] is not None
        rows[k] = row
    return rows


def write_txt(path: Path, rows: dict[str, dict]):
    w = max([len(k) for k in rows] + [4])
    wo = max([len(r[m]) for r in rows.values() for m in MODES] + [9])
    lines = [f"{'test':{w}}  {'baseline':{wo}}  {'preloaded':{wo}}  {'virtualized':{wo}}  diff"]
    for k, r in rows.items():
        note = "" if r["same"] else "DIFF"
        if r["same"] and r.get("virt_exception"):
            note = "listed: " + r["virt_exception"]
        lines.append(f"{k:{w}}  {r['baseline']:{wo}}  {r['preloaded']:{wo}}  "
                     f"{r.get('virtualized', '-'):{wo}}  {note}".rstrip())
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tests-dir", default=str(REPO.parent / "shared" / "rdma-core-tests"),
                    help="rdma-core's tests/ directory (read-only is fine)")
    ap.add_argument("--out", default=str(REPO / "target/rdma-core-tests"))
    ap.add_argument("--lib", default=str(REPO / "target/release/libkrcore.so"))
    ap.add_argument("--python", default="/usr/bin/python3",
                    help="the interpreter python3-pyverbs is installed for")
    ap.add_argument("--setup-rxe", action="store_true", help="run scripts/rxe-up.sh 2 first")
    ap.add_argument("--dev", default=os.environ.get("KRCORE_TEST_DEV", "rxe0"))
    ap.add_argument("--port", type=int, default=1)
    ap.add_argument("--gid", type=int, default=1)
    # A run takes about 40 s in the 2-CPU TCG VM.
    ap.add_argument("--timeout", type=float, default=900,
                    help="limit per run (whole suite, one mode), seconds")
    ap.add_argument("--min-tests", type=int, default=200,
                    help="fail if the baseline parsed fewer tests than this")
    ap.add_argument("--no-preload", action="store_true",
                    help="baseline run only (developing the harness)")
    ap.add_argument("--no-virtualize", action="store_true",
                    help="no KRCORE_VIRTUALIZE=1 run")
    ap.add_argument("--meta-listen", default="10.77.0.1:18599",
                    help="where the virtualized run's krcore-meta listens (the GID's address)")
    ap.add_argument("unittest_args", nargs="*", metavar="UNITTEST_ARG",
                    help="passed to run_tests.py after '--' (e.g. -- -k test_mr; "
                         "lower --min-tests to match)")
    a = ap.parse_args()
    a.tests_dir = Path(a.tests_dir).resolve()

    if not (a.tests_dir / "run_tests.py").is_file():
        print(f"rdma-core-tests: SKIPPED: {a.tests_dir} not found (rdma-core's own test "
              "suite is provided next to the repository as ../shared/rdma-core-tests; "
              "nothing to run in this checkout)")
        return 0
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not Path(a.python).is_file():
        print(f"rdma-core-tests: {a.python} not found", file=sys.stderr)
        return 2
    r = subprocess.run([a.python, "-c", "import pyverbs"], env=clean_env(),
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"rdma-core-tests: {a.python} cannot import pyverbs (install python3-pyverbs: "
              f"scripts/install-deps.sh):\n{r.stderr}", file=sys.stderr)
        return 2
    if not a.no_preload and not Path(a.lib).is_file():
        print(f"rdma-core-tests: {a.lib} does not exist (cargo build --release)",
              file=sys.stderr)
        return 2
    if a.setup_rxe:
        r = subprocess.run(["bash", str(REPO / "scripts/rxe-up.sh"), "2"])
        if r.returncode != 0:
            print("rxe-up.sh failed", file=sys.stderr)
            return 2

    t_start = time.monotonic()
    runs = {}
    modes = MODES[:1] if a.no_preload else MODES[:2] if a.no_virtualize else MODES
    meta = None
    try:
        for m in modes:
            if m == "virtualized":
                meta, a.meta = start_meta(a, out)
            runs[m] = run_mode(a, m, out)
    finally:
        if meta is not None:
            os.killpg(meta.pid, signal.SIGKILL)
            meta.wait()
    rows = compare(runs)
    errors = [f"{m}: {e}" for m, r in runs.items() for e in r.get("errors", [])]
    if runs["baseline"].get("parsed", 0) < a.min_tests:
        errors.append(f"baseline: only {runs['baseline'].get('parsed', 0)} tests parsed "
                      f"(< {a.min_tests}): the harness is broken")
    diffs = {k: r for k, r in rows.items() if not r["same"]} if not a.no_preload else {}
    n_pass = len(rows) - len(diffs)
    n_fail = len(diffs) + len(errors)

    doc = {"suite": "rdma-core-tests", "tests_dir": str(a.tests_dir), "lib": str(a.lib),
           "python": a.python, "kernel": os.uname().release,
           "seconds": round(time.monotonic() - t_start, 1),
           "passed": n_pass, "failed": n_fail, "differences": sorted(diffs),
           "errors": errors,
           "runs": {m: {k: v for k, v in r.items() if k != "tests"} for m, r in runs.items()},
           "tests": rows,
           "details": {m: r.get("tests", {}) for m, r in runs.items()}}
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_txt(out / "results.txt", rows)

    print()
    if diffs:
        print(f"{len(diffs)} test(s) with a different outcome under LD_PRELOAD"
              " (preloaded, or virtualized and not listed in VIRT_EXCEPTIONS):")
        w = max(len(k) for k in diffs)
        print(f"  {'test':{w}}  {'baseline':18}  {'preloaded':18}  virtualized")
        for k, r in diffs.items():
            print(f"  {k:{w}}  {r['baseline']:18}  {r['preloaded']:18}  {r.get('virtualized', '-')}")
            for m in MODES:
                if r.get(f"{m}_error"):
                    print(f"      {m}: {r[f'{m}_error']}")
                elif r.get(f"{m}_reason"):
                    print(f"      {m}: skipped: {r[f'{m}_reason']}")
    elif rows and not a.no_preload:
        print(f"all {len(rows)} tests have the same outcome with and without LD_PRELOAD")
    for e in errors:
        print(f"ERROR: {e}")
    b = runs["baseline"].get("counts", {})
    print("baseline outcomes: " + ", ".join(f"{v} {k}" for k, v in sorted(b.items())))
    print(f"results: {out / 'results.txt'}, {out / 'results.json'}; logs: {out / 'logs'} "
          f"({doc['seconds']} s)")
    print(f"{n_pass} passed, {n_fail} failed")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
