#!/usr/bin/env python3
"""Runs the workspace's test binaries several at a time, then prints each one's time, longest
first (`ci-time-binary: NAME SECONDS s`), so that CI shows where its minutes go.

    python3 scripts/test-lanes.py [--lanes N] [--also NAME=COMMAND]... [CARGO TEST ARGS...]
                                  [-- TEST BINARY ARGS...]
    e.g. python3 scripts/test-lanes.py --workspace --release

`--also NAME=COMMAND` runs a shell command (from the repository's root) in a lane too, once the
build is done, before the binaries: CI's other test scripts (etcd, E12, HTTP/3, ...), which
reuse the build.

Why: most of keel's test binaries wait rather than compute (real sockets, real processes, the
lab's timed runs): `cargo test` runs them one after another, 440 s in all, with the machine's two
cores mostly idle. Here they run in N lanes (default 4; KEEL_TEST_LANES), each binary as cargo
would run it (from its package's directory, with its own test threads), the longest known
first; the binaries that compute (simulations) one at a time, in the first lane; those that
hold timed traffic to a closed form tightly (ALONE), alone after the lanes. Each binary's output is printed whole when it ends, so lanes never interleave; the
doctests run after, through cargo. The exit status is 1 if any binary failed, and the failed
ones are named again at the end.
"""
import json
import os
import subprocess
import sys
import threading
import time

# The binaries measured longest (CI's logs), started first so that no long one starts last.
# A name missing here runs after these, in cargo's order; a stale name does nothing.
LONGEST_FIRST = [
    "tests/proxy/main.rs",
    "tests/lab_cli.rs",
    "tests/advise_inference.rs",
    "tests/process_wide/main.rs",
    "tests/lab_e18.rs",
    "tests/lab_peers.rs",
    "tests/lab_inference.rs",
    "tests/simulate_cli.rs",
    "tests/proxy_cli.rs",
    "tests/lab_tail_cli.rs",
    "tests/e10_cli.rs",
]

# Binaries that compute rather than wait (CPU time / wall time 0.8-1.0 measured alone, each one
# core): they run one at a time in the first lane, so that the binaries whose tests measure
# real traffic against a closed form never share the machine with two of them.
COMPUTE = {
    "keel/tests/simulate_cli.rs",
    "keel/tests/analyze_cli.rs",
    "keel/tests/distribute_cli.rs",
    "keel/tests/manual_cli.rs",
    "keel-model/src/lib.rs",
    "keel-model/tests/sim_experiments.rs",
    "keel-model/tests/fleet.rs",
    "keel-model/tests/sim_tail.rs",
    "keel-model/tests/sim_queues.rs",
    "keel-model/tests/sim_scenarios.rs",
    "keel-model/tests/shares.rs",
    "keel-model/tests/load_report_liar.rs",
    "keel-model/tests/fit.rs",
    "keel-model/tests/engine_twins.rs",
    "keel-model/tests/zones.rs",
}

# Binaries whose tests hold real traffic on loopback to a closed form with tight tolerances
# (E8/E9's open-loop load: a late arrival is a late sample): they run alone, after the lanes,
# with nothing else on the machine. In the lanes they failed a CI run on a 2-core machine that
# three other binaries shared.
ALONE = {
    "keel/tests/lab_tail_cli.rs",
}

# Test threads for binaries whose tests mostly wait (keel-proxy's: 253 tests, 195 s of tests
# for 14 s of CPU); the others keep libtest's default (one a core).
THREADS = {"tests/proxy/main.rs": 4}


def why_failed(output: str, limit: int = 4000) -> str:
    """libtest's "failures:" section (each failed test's panic and output), or the output's
    tail when there is none (a script, a crash)."""
    start = output.find("\nfailures:\n")
    text = output[start + 1 :] if start >= 0 else output
    end = text.find("\ntest result:")
    if end >= 0:
        text = text[:end]
    return text[-limit:]


def main() -> int:
    args = sys.argv[1:]
    lanes = int(os.environ.get("KEEL_TEST_LANES", "4"))
    also = []
    while args[:1] in (["--lanes"], ["--also"]):
        if args[0] == "--lanes":
            lanes = int(args[1])
        else:
            name, _, command = args[1].partition("=")
            if not command:
                sys.exit(f"test-lanes: --also wants NAME=COMMAND, got {args[1]!r}")
            also.append((name, command))
        args = args[2:]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cargo_args, bin_args = args, []
    if "--" in args:
        i = args.index("--")
        cargo_args, bin_args = args[:i], args[i + 1 :]

    build = subprocess.Popen(
        ["cargo", "test", "--no-run", "--message-format=json-render-diagnostics", *cargo_args],
        stdout=subprocess.PIPE,
        text=True,
    )
    binaries = []
    for line in build.stdout:
        msg = json.loads(line)
        if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
            continue
        if not msg["profile"]["test"]:
            continue
        pkg_dir = os.path.dirname(msg["manifest_path"])
        src = os.path.relpath(msg["target"]["src_path"], pkg_dir)
        binaries.append((src, msg["executable"], pkg_dir))
    if build.wait() != 0:
        print("test-lanes: the test build failed", file=sys.stderr)
        return build.returncode

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    def key(cwd, src):
        return f"{os.path.basename(cwd)}/{src}"

    # The extra commands first: each is longer than all but the longest binary.
    queue = [(name, ["bash", "-c", command], root) for name, command in also]
    compute, alone = [], []
    for src, exe, cwd in sorted(binaries, key=lambda b: rank.get(b[0], len(rank))):
        k = key(cwd, src)
        room = compute if k in COMPUTE else alone if k in ALONE else queue
        room.append((src, [exe, *bin_args], cwd))
    lock = threading.Lock()
    times, failed = [], []

    def run_one(src, argv, cwd):
        env = dict(os.environ)
        if src in THREADS and "RUST_TEST_THREADS" not in env:
            env["RUST_TEST_THREADS"] = str(THREADS[src])
        t0 = time.monotonic()
        p = subprocess.run(
            argv,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        secs = time.monotonic() - t0
        crate = os.path.basename(cwd) if cwd != root else "ci"
        output = p.stdout.decode(errors="replace")
        with lock:
            sys.stdout.write(f"     Running {src} ({crate}, {secs:.1f} s)\n")
            sys.stdout.write(output)
            sys.stdout.flush()
            times.append((secs, f"{crate}/{src}"))
            if p.returncode != 0:
                failed.append((f"{crate}/{src} (exit {p.returncode})", why_failed(output)))

    def run_lane(first):
        while True:
            with lock:
                if first and compute:
                    job = compute.pop(0)
                elif queue:
                    job = queue.pop(0)
                elif compute:
                    job = compute.pop(0)
                else:
                    return
            run_one(*job)

    t0 = time.monotonic()
    threads = [threading.Thread(target=run_lane, args=(i == 0,)) for i in range(max(1, lanes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job in alone:
        run_one(*job)
    wall = time.monotonic() - t0

    doc = subprocess.run(["cargo", "test", "--doc", *cargo_args, "--", *bin_args])
    if doc.returncode != 0:
        failed.append((f"doctests (exit {doc.returncode})", "(cargo's output above)"))

    for secs, name in sorted(times, reverse=True):
        print(f"ci-time-binary: {name} {secs:.1f} s")
    total = sum(s for s, _ in times)
    print(
        f"ci-time-binary: {len(times) - len(also)} binaries and {len(also)} commands, "
        f"{total:.0f} s of tests in all, {wall:.0f} s of wall time in {lanes} lanes"
    )
    if failed:
        # The panics again, last, where a log cut in its middle still shows them.
        for name, why in failed:
            print(f"test-lanes: why {name} failed:\n{why}", file=sys.stderr)
        print("test-lanes: FAILED: " + ", ".join(name for name, _ in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
