"""Run the benchmark suites of benchmarks/suites.py and collect their results in one place.

    python benchmarks/run.py --list                   # the suites and what each measures
    python benchmarks/run.py --dry-run w1 w2          # the commands, run nothing
    python benchmarks/run.py --check                  # every path and flag known here (CPU)
    OUT=results python benchmarks/run.py w1 w2 kernels
    python benchmarks/run.py --out results all        # every suite but the pending ones

From the repository root of a checkout on a GPU machine (`./install.sh` done, or the packages of
pyproject.toml importable). Results go to the output folder (`--out`, else `$OUT`, else
`results/`): `run.log` holds every command's whole output, `results.json` each command's exit
status, seconds, time, commit and the JSON it wrote, rewritten after every command so an
interrupted run keeps what finished; a later run into the same folder appends to both. Before anything runs, every config, script and test path of the chosen suites must
exist and every flag must appear in its command's `--help`; a suite whose flags this checkout
lacks fails there, by name, and nothing runs. A failed command does not stop the others; the exit
status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import re
import shlex
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

from suites import MODELS, SUITES, Step, Suite

ROOT = Path(__file__).resolve().parent.parent
TOOLS = {
    "atom": [sys.executable, "-m", "atom_runtime"],
    "python": [sys.executable],
    "pytest": [sys.executable, "-m", "pytest"],
}
STOP_GRACE_S = 60


def environment(json_dir: Path) -> dict[str, str]:
    """The commands' environment: this checkout's packages first on the path, unbuffered output,
    and the GPU tests' report folder."""
    env = dict(os.environ)
    paths = [str(ROOT / p) for p in ("runtime", "kernels", "operator")] + [str(ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    env["ATOM_REPORT_DIR"] = str(json_dir)  # tests/runtime/worker/test_gpu_engine.py writes there
    return env


def expand(step: Step, json_dir: Path, port: int) -> list[str]:
    """The step's command as an argument list, placeholders filled in."""
    values = dict(MODELS, json=str(json_dir), port=str(port))
    try:
        text = string.Template(step.command).substitute(values)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{step.command!r}: unknown placeholder {e}") from None
    return shlex.split(text)


def shown(step: Step, argv: list[str]) -> str:
    env = " ".join(f"{k}={v}" for k, v in step.env.items())
    return (env + " " if env else "") + shlex.join(argv)


def all_steps(suite: Suite):
    for step in suite.steps:
        yield step
        yield from step.clients


# -- checks before running -----------------------------------------------------------------------


def help_prefix(argv: list[str]) -> tuple[str, ...]:
    """The words that select a command's parser: the tool, the script, its subcommands."""
    words = list(argv[:2]) if argv[0] == "python" else [argv[0]]
    for word in argv[len(words) :]:
        if word.startswith("-"):
            break
        words.append(word)
    return tuple(words)


def flags_of(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def paths_of(argv: list[str]) -> list[str]:
    """Repository paths a command names: configs, scripts, test files (comma lists split)."""
    found = []
    for arg in argv:
        value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
        for part in value.split(","):
            part = part.split("::", 1)[0]
            if part.startswith(("benchmarks/", "tests/")):
                found.append(part)
    return found


def read_help(prefix: tuple[str, ...], env: dict[str, str]) -> tuple[str | None, str]:
    """(help text, None) or (None, why) for a command prefix."""
    argv = TOOLS[prefix[0]] + list(prefix[1:]) + ["--help"]
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None, f"`{' '.join(prefix)} --help` did not finish in 300 s"
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        return None, f"`{' '.join(prefix)} --help` failed: {last}"
    return done.stdout, ""


def problems(suites: list[Suite], env: dict[str, str]) -> dict[str, list[str]]:
    """Per suite, what stops its commands from running in this checkout."""
    found: dict[str, list[str]] = {s.name: [] for s in suites}
    wanted: dict[tuple[str, ...], list[tuple[str, list[str]]]] = collections.defaultdict(list)
    for suite in suites:
        for step in all_steps(suite):
            try:
                argv = expand(step, Path("$json"), 8000)
            except ValueError as e:
                found[suite.name].append(str(e))
                continue
            if not argv or argv[0] not in TOOLS:
                found[suite.name].append(f"{step.command!r}: starts with none of {list(TOOLS)}")
                continue
            missing = [p for p in paths_of(argv) if not (ROOT / p).exists()]
            found[suite.name] += [f"{shown(step, argv)}: no such path {p}" for p in missing]
            if argv[0] != "pytest" and not missing:
                wanted[help_prefix(argv)].append((suite.name, argv))
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        helps = dict(zip(wanted, pool.map(lambda p: read_help(p, env), wanted), strict=True))
    for prefix, uses in wanted.items():
        text, why = helps[prefix]
        for name, argv in uses:
            if text is None:
                found[name].append(why)
                continue
            for flag in flags_of(argv):
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                    found[name].append(f"`{' '.join(prefix)}` has no flag {flag}")
    return {name: sorted(set(p)) for name, p in found.items()}


def report_problems(found: dict[str, list[str]], suites: list[Suite], running: bool) -> bool:
    """Print what was found; True when nothing blocks (pending suites may lack their flags
    unless they are to run)."""
    ok = True
    for suite in suites:
        for p in found[suite.name]:
            if suite.pending and not running:
                print(f"{suite.name}: pending, needs the flags of {suite.pending}: {p}")
            else:
                ok = False
                hint = f" (this suite needs the flags of {suite.pending})" if suite.pending else ""
                print(f"{suite.name}: error: {p}{hint}", file=sys.stderr)
    return ok


# -- running -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], step: Step, env: dict[str, str], log, prefix: str = ""):
    """Start a command in its own process group, its output copied to the log line by line;
    returns the process, the thread copying its output and its last lines."""
    proc = subprocess.Popen(
        TOOLS[argv[0]] + argv[1:],
        cwd=ROOT,
        env=dict(env, **step.env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    last: collections.deque[str] = collections.deque(maxlen=200)

    def pump() -> None:
        for line in proc.stdout:
            log.write(prefix + line)
            last.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    return proc, reader, last


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group, SIGKILL if it is still there after a grace."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Run:
    """One invocation: the output folder, the log, results.json."""

    def __init__(self, out: Path, tail: int) -> None:
        self.out, self.tail = out, tail
        self.json_dir = out / "json"
        self.json_dir.mkdir(parents=True, exist_ok=True)
        self.env = environment(self.json_dir)
        self.log = open(out / "run.log", "a", buffering=1)
        self.commit = _git_commit()
        self.results: dict = {"suites": {}}
        if (out / "results.json").exists():  # an earlier run into this folder: append to it
            self.results = json.loads((out / "results.json").read_text())
        self.failed = 0

    def record(self, suite: str, line: str, rc: int, seconds: float) -> None:
        files = sorted(self.json_dir.glob("*.json"))
        entry = {
            "command": line,
            "rc": rc,
            "seconds": round(seconds, 1),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "commit": self.commit,
            "results": {},
        }
        for f in files:  # whatever the command wrote, folded in
            try:
                entry["results"][f.stem] = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                entry["results"][f.stem] = {"unreadable": str(e)}
            f.unlink()
        self.results["suites"].setdefault(suite, []).append(entry)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))
        self.failed += rc != 0
        print(f"-- rc {rc} in {seconds:.0f} s", flush=True)

    def step(self, suite: Suite, step: Step, port: int) -> None:
        argv = expand(step, self.json_dir, port)
        line = shown(step, argv)
        print(f"\n-- {suite.name}: {line}", flush=True)
        self.log.write(f"\n== {suite.name}: {line}\n")
        if step.clients:
            return self.server(suite, step, argv, line, port)
        began = time.monotonic()
        proc, reader, last = start(argv, step, self.env, self.log)
        try:
            rc = proc.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            rc = 124
            last.append(f"(stopped after its {step.timeout_s} s limit)")
        finally:
            stop(proc)
        reader.join()
        for text in list(last)[-self.tail :] if self.tail else []:
            print("   " + text)
        self.record(suite.name, line, rc, time.monotonic() - began)

    def server(self, suite: Suite, step: Step, argv: list[str], line: str, port: int) -> None:
        """Start the server, run its clients (each waits for it: `--ready-check-timeout-sec`),
        stop it; its own exit status is recorded after theirs."""
        began = time.monotonic()
        proc, reader, last = start(argv, step, self.env, self.log, prefix="[server] ")
        try:
            for client in step.clients:
                if proc.poll() is not None:
                    print(f"   the server exited early (rc {proc.returncode}):")
                    for text in list(last)[-self.tail :]:
                        print("   " + text)
                    break
                self.step(suite, client, port)
        finally:
            early = proc.poll()
            stop(proc)
            reader.join()
        self.record(suite.name, line, early if early is not None else 0, time.monotonic() - began)

    def close(self) -> None:
        self.log.close()
        if self.json_dir.exists() and not any(self.json_dir.iterdir()):
            self.json_dir.rmdir()


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


# -- command line --------------------------------------------------------------------------------


def choose(names: list[str]) -> list[Suite]:
    by_name = {s.name: s for s in SUITES}
    if names == ["all"]:
        return [s for s in SUITES if not s.pending]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(
            f"run.py: error: unknown suite {', '.join(unknown)}; the suites: "
            f"{', '.join(by_name)} (or all)"
        )
    return [by_name[n] for n in names]


def print_list() -> None:
    for s in SUITES:
        mark = f"  [pending: needs {s.pending}]" if s.pending else ""
        n = sum(1 for _ in all_steps(s))
        print(f"{s.name:9s} {n:2d} command{'s' if n > 1 else ' '}  {s.about}{mark}")


def print_commands(suites: list[Suite], json_dir: Path) -> None:
    print("# from the repository root; atom = python -m atom_runtime, with")
    print("# PYTHONPATH=runtime:kernels:operator:. (what run.py sets)")
    for suite in suites:
        print(f"\n# {suite.name}: {suite.about}")
        if suite.pending:
            print(f"# pending: needs the flags of {suite.pending}")
        for step in suite.steps:
            line = shown(step, expand(step, json_dir, 8000))
            if not step.clients:
                print(line)
                continue
            print(line + " &")
            for client in step.clients:
                print(shown(client, expand(client, json_dir, 8000)))
            print("kill %1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suites", nargs="*", help="suite names, or all (every suite but pending ones)")
    ap.add_argument("--out", help="output folder (default: $OUT, else results)")
    ap.add_argument("--list", action="store_true", help="list the suites and exit")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument(
        "--check", action="store_true", help="check paths and flags of the suites (all if none)"
    )
    ap.add_argument("--tail", type=int, default=15, help="output lines shown after each command")
    args = ap.parse_args(argv)
    if args.list:
        print_list()
        return 0
    if not args.suites and not args.check:
        ap.error("name the suites to run (--list shows them), or all")
    suites = choose(args.suites) if args.suites else list(SUITES)
    out = Path(args.out or os.environ.get("OUT") or "results").resolve()
    if args.dry_run:
        print_commands(suites, out / "json")
        return 0
    env = environment(out / "json")
    found = problems(suites, env)
    if args.check:
        ok = report_problems(found, suites, running=False)
        print(f"checked {len(suites)} suites: {'ok' if ok else 'problems above'}")
        return 0 if ok else 1
    if not report_problems(found, suites, running=True):
        print("run.py: nothing was run", file=sys.stderr)
        return 2
    run = Run(out, args.tail)
    try:
        for suite in suites:
            print(f"\n== {suite.name}: {suite.about}", flush=True)
            for step in suite.steps:
                run.step(suite, step, free_port())
    finally:
        run.close()
    print(f"\nresults: {out / 'results.json'}; whole output: {out / 'run.log'}")
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
