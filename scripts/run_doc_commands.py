#!/usr/bin/env python3
"""Run every shell command the README and docs/*.md tell a user to run, and log the results.

    python scripts/run_doc_commands.py --cwd /tmp/docs_clone --venv /tmp/docvenv_fresh
    python scripts/run_doc_commands.py --list      # the commands it would run, runs nothing

What is run:

* every command of the fenced ``bash``/``sh``/``shell``/``console`` blocks of README.md, then
  docs/*.md in name order: one command per logical line (``\\`` continuations joined; comment
  lines and trailing ``#`` comments are not commands; in ``console`` blocks only ``$ `` lines);
* the commands written inline in prose that ``INLINE`` below lists (a placeholder such as
  ``model.onnx`` replaced by a zoo model, said in the log); every other inline mention of
  ``tvm-fusion …``, ``python scripts/…``, ``python -m …`` or ``pip install …`` must be listed in
  ``INLINE`` too, as a mention that is not a command, else it is logged as *unclassified*.

How it runs them: in order, one at a time, each in ``bash`` in ``--cwd`` with ``--venv``
activated, under ``--timeout`` seconds. A ``cd`` carries over to the next command of the same
block (every block starts in ``--cwd``), a variable (``T=…``, ``export …``) to the rest of the
file; the fenced blocks of a file run first, then its prose commands. A command seen
before in the run is not run again (logged as the same as the first). A command whose trailing
comment ends in ``needs: phone`` (``ndk``, ``gpu``, several comma-separated), or any command of a
block whose first line is such a comment, is not run and logged as "not run (needs …)". The RPC
tracker and server scripts (``--server``) run in the background: they pass when still up after
``--server-wait`` seconds, and are stopped (their process group, by pid) at the end of the file.

The log (Markdown, written atomically after every command; by default
``out/doc_commands/commands_checked.md``, which is not committed: a run log is evidence of one
run, not documentation) has one row per command: doc:line,
command, result, seconds, and the last lines of its output; the full output of each command is
in ``--outdir``. A JSON sidecar (``LOG.json``) keeps the results so that ``--only REGEX`` reruns
some commands (and every ``cd`` or variable assignment, which later ones may need) and keeps
the earlier results of the others; without a sidecar the others are logged as not run (the
README's commands include ``pip install -e .`` and the whole test suite).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGS = {"bash", "sh", "shell", "console"}
NEEDS_RE = re.compile(r"#\s*needs:\s*([a-z]+(?:\s*,\s*[a-z]+)*)")
INLINE_RE = re.compile(r"`((?:[A-Z_]+=\S+ )*"
                       r"(?:tvm-fusion|python scripts/|python -m |python -c |pip install )[^`]*)`")
DEFAULT_SERVERS = (r"scripts/rpc_tracker\.py", r"scripts/rpc_server\.py")

# Inline (prose) commands: doc, the text between backticks, then either the command that checks
# it (with a note when a placeholder was replaced) or None and why it is not a command.
TINY = "models/tinybert.onnx"
APOLLO2 = "distilbert,albert,mobilebert,unet,ssd_mobilenet,vgg16,r3d_18,swin_t,vit_b16"
INLINE: list[tuple[str, str, str | None, str]] = [
    ("README.md", "tvm-fusion tune", None, "names the subcommand (commands in the phone block)"),
    ("README.md", "tvm-fusion", None, "names the command"),
    ("README.md", "tvm-fusion tune --local", None, "names the option (tuning: the phone block)"),
    ("README.md", "tvm-fusion demo", "tvm-fusion demo", ""),
    ("README.md", "tvm-fusion report model.onnx [--json] [--why]",
     f"tvm-fusion report {TINY} --json --why", f"model.onnx = {TINY}"),
    ("README.md", "tvm-fusion compile model.onnx -o model.so",
     f"tvm-fusion compile {TINY} -o model.so", f"model.onnx = {TINY}"),
    ("README.md", "python -m pytest -q", "python -m pytest -q", ""),
    ("README.md", "python -m pytest -q -m slow", "python -m pytest -q -m slow", ""),
    ("docs/android.md", "tvm-fusion tune", None, "names the subcommand"),
    ("docs/android.md", "tvm-fusion compile --tuned DIR", None, "names the option"),
    ("docs/android.md", "pip install -e .", "pip install -e .", ""),
    ("docs/android.md", 'python -c "import tvm; print(tvm.__version__)"',
     'python -c "import tvm; print(tvm.__version__)"', ""),
    ("docs/apollo.md", "tvm-fusion report --strategy apollo",
     f"tvm-fusion report {TINY} --strategy apollo", f"model added: {TINY}"),
    ("docs/apollo.md", "tvm-fusion report", None, "names the subcommand"),
    ("docs/architecture.md", "python scripts/draw_architecture.py",
     "python scripts/draw_architecture.py", ""),
    ("docs/architecture.md", "tvm-fusion report", None, "names the subcommand"),
    ("docs/architecture.md", "tvm-fusion bench", None, "names the subcommand"),
    ("docs/benchmarks.md", "python -m tvm_fusion.export_models",
     "python -m tvm_fusion.export_models", ""),
    ("docs/benchmarks.md",
     "python scripts/measure_smartmem.py time swin_block models/swin_t.onnx --rounds 3 "
     "--strategy dnnfusion",
     "python scripts/measure_smartmem.py time swin_block models/swin_t.onnx --rounds 3 "
     "--strategy dnnfusion", ""),
    ("docs/benchmarks.md", "python scripts/bench_conv_chains.py",
     "python scripts/bench_conv_chains.py", ""),
    ("docs/benchmarks.md", "python scripts/gpu_bundle.py --out .gpu_bundle", None,
     "the GPU run's build step (needs: gpu, to be of use; docs/targets.md)"),
    ("docs/benchmarks.md", "python scripts/apollo_zoo.py --only " + APOLLO2 + " --check " + APOLLO2,
     "python scripts/apollo_zoo.py --only " + APOLLO2 + " --check " + APOLLO2, ""),
    ("docs/codegen.md", "tvm-fusion bench", None, "names the subcommand"),
    ("docs/codegen.md",
     "TVM_NUM_THREADS=1 python scripts/kernel_breakdown.py models/bert_base.onnx",
     "TVM_NUM_THREADS=1 python scripts/kernel_breakdown.py models/bert_base.onnx && "
     "TVM_NUM_THREADS=1 python scripts/kernel_breakdown.py models/gpt2.onnx",
     "and `models/gpt2.onnx`, as the sentence says"),
    ("docs/codegen.md", "tvm-fusion tune", None, "names the subcommand"),
    ("docs/optifx.md", "tvm-fusion report", None, "names the subcommand"),
    ("docs/optifx.md", "python scripts/bench_conv_chains.py",
     "python scripts/bench_conv_chains.py", ""),
    ("docs/optifx.md", "tvm-fusion report models/mobilenet_v2.onnx -O conv_chains=cost_model",
     "tvm-fusion report models/mobilenet_v2.onnx -O conv_chains=cost_model", ""),
    ("docs/profiling.md", r"tvm-fusion db stats \| list \| export \| import \| prune", None,
     "names the subcommands (synopsis block checked below)"),
    ("docs/profiling.md", "tvm-fusion bench", None, "names the subcommand"),
    ("docs/rewrite.md", "python scripts/measure_rewrite.py --rules",
     "python scripts/measure_rewrite.py --rules", ""),
    ("docs/symbolic.md", "tvm-fusion report", None, "names the subcommand"),
    ("docs/visualize.md", "tvm-fusion report --why", None, "names the option"),
    ("docs/visualize.md", "tvm-fusion report models/X.onnx --html docs/plans/X.html --no-check",
     "tvm-fusion report models/bert_base.onnx --html out/plans/bert_base.html --no-check",
     "X = bert_base, written to out/plans/"),
    ("docs/visualize.md", "python -m tvm_fusion.export_models --only bert_base,swin_t,gpt2_lm",
     "python -m tvm_fusion.export_models --only bert_base,swin_t,gpt2_lm", ""),
]

# Lines of unlabelled blocks (usage synopses) checked with concrete arguments: doc, the line's
# text, the command run. They run after the fenced commands of the same doc.
SYNOPSIS: list[tuple[str, str, str, str]] = [
    ("docs/profiling.md", "tvm-fusion db stats  [--db PATH] [--json] [--check]",
     "tvm-fusion db stats --db out/profile/zoofb.db --json --check",
     "PATH = profile_zoo's out/profile/zoofb.db"),
    ("docs/profiling.md", "tvm-fusion db list   [--db PATH]",
     "tvm-fusion db list --db out/profile/zoofb.db --target llvm --limit 5 --sort slowest",
     "PATH = out/profile/zoofb.db"),
    ("docs/profiling.md", "tvm-fusion db export [--db PATH] OUT.json",
     "tvm-fusion db export --db out/profile/zoofb.db out/profile/zoofb_export.json",
     "OUT = out/profile/zoofb_export.json"),
    ("docs/profiling.md", "tvm-fusion db import [--db PATH] IN.json",
     "rm -f out/profile/zoofb_import.db && tvm-fusion db import --db out/profile/zoofb_import.db "
     "out/profile/zoofb_export.json", "into a new database"),
    ("docs/profiling.md", "tvm-fusion db prune  [--db PATH]",
     "tvm-fusion db prune --db out/profile/zoofb_import.db --all --dry-run",
     "PATH = the imported copy"),
]

# Commands in comments or prose that run elsewhere than this computer: doc, text, needs.
ELSEWHERE: list[tuple[str, str, str]] = [
    ("README.md", "# on each phone: tvm_rpc server --tracker=127.0.0.1:9190 --key=android",
     "phone"),
    ("docs/android.md", "`adb devices`", "phone"),
    ("docs/android.md", '`sdkmanager "ndk;26.3.11579264"`', "ndk"),
]


@dataclass
class Command:
    doc: str
    line: int
    text: str
    kind: str = "block"          # block | inline | synopsis | elsewhere
    needs: str = ""
    note: str = ""
    block: int = 0               # index of the fenced block in its doc (cwd resets per block)


@dataclass
class Result:
    doc: str
    line: int
    text: str
    kind: str
    status: str        # passed | failed | timeout | not run | same | started | unclassified
    rc: int | None = None
    seconds: float = 0.0
    tail: list[str] = field(default_factory=list)
    note: str = ""
    when: str = ""
    commit: str = ""             # the checkout's commit when it ran


# ----------------------------------------------------------------------------------------
# extraction

def strip_comment(line: str) -> tuple[str, str]:
    """Split a shell line into code and trailing comment (a ``#`` starting a word, unquoted)."""
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 2
                continue
            if c == quote:
                quote = None
        elif c == "\\":
            i += 2
            continue
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] in " \t;&|("):
            return line[:i].rstrip(), line[i:]
        i += 1
    return line.rstrip(), ""


def parse_needs(comment: str) -> str:
    found = NEEDS_RE.findall(comment)
    return ", ".join(x.strip() for x in found[-1].split(",")) if found else ""


def extract_blocks(doc: Path, rel: str) -> list[Command]:
    out: list[Command] = []
    lines = doc.read_text(encoding="utf-8").splitlines()
    in_block, lang, block_needs, nblock, seen_cmd = False, "", "", 0, False
    pending, pending_line = "", 0
    for no, raw in enumerate(lines, 1):
        fence = re.match(r"^\s*(```+|~~~+)\s*([\w-]*)", raw)
        if fence:
            if not in_block:
                in_block, lang = True, fence.group(2).lower()
                block_needs, seen_cmd, nblock = "", False, nblock + 1
            else:
                in_block = False
            continue
        if not in_block or lang not in SHELL_LANGS:
            continue
        line = raw
        if lang == "console" and not pending:
            if not line.lstrip().startswith("$ "):
                continue
            line = line.lstrip()[2:]
        code, comment = strip_comment(line)
        if not pending and not code.strip():
            if comment and not seen_cmd and parse_needs(comment):
                block_needs = parse_needs(comment)
            continue
        if not pending:
            pending_line = no
        if code.endswith("\\"):
            pending += code[:-1].strip() + " "
            continue
        text = (pending + code.strip()).strip()
        if incomplete(text):                 # a for/if/while spanning lines: read on
            pending = text + "\n"
            continue
        text = re.sub(r"\s{2,}", " ", text) if "'" not in text and '"' not in text else text
        needs = parse_needs(comment) or block_needs
        out.append(Command(rel, pending_line, text, "block", needs, block=nblock))
        seen_cmd = True
        pending = ""
    return out


def incomplete(text: str) -> bool:
    """True when bash reads ``text`` as unfinished (an open ``for … do``, ``if``, quote)."""
    p = subprocess.run(["bash", "-n", "-c", text], capture_output=True, text=True)
    return p.returncode != 0 and "unexpected end of file" in p.stderr


def sets_state(text: str) -> bool:
    """``T=…``, ``export A=… B=…`` or ``cd …``: cheap, and later commands need it, so ``--only``
    runs it again rather than reusing its earlier result."""
    try:
        toks = shlex.split(text)
    except ValueError:
        return False
    if toks[:1] == ["cd"]:
        return True
    if toks[:1] == ["export"]:
        toks = toks[1:]
    return bool(toks) and all(re.match(r"[A-Za-z_]\w*=", x) for x in toks)


def find_line(doc: Path, needle: str) -> int:
    for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        if needle in line:
            return no
    return 0


def extract_inline(doc: Path, rel: str) -> tuple[list[Command], list[Result]]:
    """Inline commands of one doc: listed ones to run, mentions, and unclassified ones."""
    cmds: list[Command] = []
    extra: list[Result] = []
    listed = {(d, t): (c, n) for d, t, c, n in INLINE if d == rel}
    in_block = False
    seen: set[str] = set()
    for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        if re.match(r"^\s*(```+|~~~+)", line):
            in_block = not in_block
            continue
        if in_block:
            continue
        for m in INLINE_RE.finditer(line):
            text = m.group(1)
            key = (rel, text)
            if key not in listed:
                extra.append(Result(rel, no, text, "inline", "unclassified",
                                    note="inline mention not classified in INLINE"))
                continue
            if text in seen:
                continue
            seen.add(text)
            cmd, note = listed[key]
            if cmd is None:
                extra.append(Result(rel, no, text, "inline", "mention", note=note))
            else:
                cmds.append(Command(rel, no, cmd, "inline",
                                    note=("as written" if cmd == text else note)))
    for d, t, c, n in SYNOPSIS:
        if d == rel:
            no = find_line(doc, t)
            if no:
                cmds.append(Command(rel, no, c, "synopsis", note=n))
            else:
                extra.append(Result(rel, 0, t, "synopsis", "failed",
                                    note="synopsis line not found in the doc"))
    for d, t, needs in ELSEWHERE:
        if d == rel:
            no = find_line(doc, t)
            extra.append(Result(rel, no, t.strip("`").lstrip("# "), "elsewhere",
                                "not run", note=f"needs {needs}"
                                + ("" if no else "; text not found in the doc")))
    return cmds, extra


def collect(cwd: Path) -> tuple[list[Command], list[Result]]:
    docs = [cwd / "README.md"] + sorted((cwd / "docs").glob("*.md"))
    cmds: list[Command] = []
    extra: list[Result] = []
    for d in docs:
        rel = str(d.relative_to(cwd))
        cmds += extract_blocks(d, rel)
        c, e = extract_inline(d, rel)
        cmds += c
        extra += e
    return cmds, extra


# ----------------------------------------------------------------------------------------
# running

def venv_env(venv: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if venv:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.pop("PYTHONHOME", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# TVM's own log lines, repeated hundreds of times per model; left out of the log's tails
NOISE = re.compile(r"^\[\d\d:\d\d:\d\d\] /project/\S+: Warning: ")


def tail(path: Path, n: int) -> list[str]:
    """The last ``n`` non-empty lines of a command's output (its ``$ command`` header left out)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return []
    body = raw.split(b"\n", 1)[1] if raw.startswith(b"$ ") and b"\n" in raw else raw
    data = body[-20000:].decode("utf-8", "replace")
    lines = [re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", x).split("\r")[-1]
             for x in data.splitlines()]
    lines = [x for x in lines if x.strip() and not NOISE.search(x)]
    return lines[-n:]


# After a command: print the shell's variables (shell and exported, not bash's own or read-only
# ones) as `declare -p` lines, which the next command sources.
SAVE_VARS = (
    "for __v in $(compgen -v); do case $__v in BASH*|SHELLOPTS|EUID|PPID|UID|GROUPS|FUNCNAME|"
    "PIPESTATUS|RANDOM|SRANDOM|SECONDS|LINENO|HISTCMD|DIRSTACK|COMP_*|SHLVL|_|PWD|OLDPWD|__*|"
    "EPOCH*|IFS|PS1|PS2|PS4|OPTIND|OPTERR|OPTARG|MACHTYPE|HOSTTYPE|OSTYPE|COLUMNS|LINES) "
    "continue;; "
    "esac; __d=$(declare -p \"$__v\" 2>/dev/null) || continue; __f=${__d#declare -}; "
    "__f=${__f%% *}; [[ $__f == *r* ]] && continue; printf '%s\\n' \"$__d\"; done")


class Shell:
    """Runs commands one at a time; carries cwd within a block and exports within a file."""

    def __init__(self, base: Path, env: dict[str, str], work: Path):
        self.base, self.env, self.work = base, env, work
        self.cwd = base
        self.exports = ""
        self.servers: list[tuple[subprocess.Popen, Command]] = []

    def reset_file(self) -> None:
        self.exports = ""
        self.cwd = self.base

    def reset_block(self) -> None:
        self.cwd = self.base

    def _script(self, cmd: str, state: Path | None) -> str:
        parts = [f"cd {shlex.quote(str(self.cwd))} || exit 97"]
        if self.exports:
            parts.append(self.exports)
        parts.append(cmd)
        if state:
            q = shlex.quote(str(state))
            parts.append(f"__rc=$?; pwd > {q}.cwd; {SAVE_VARS} > {q}.env; exit $__rc")
        return "\n".join(parts) + "\n"

    def run(self, cmd: str, out: Path, timeout: float) -> tuple[int, float, bool]:
        state = self.work / "state"
        t0 = time.monotonic()
        with open(out, "wb") as f:
            f.write(f"$ {one_line(cmd)}\n".encode())
            f.flush()
            p = subprocess.Popen(["bash", "-c", self._script(cmd, state)], stdout=f,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=self.env, start_new_session=True)
            timed_out = False
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                stop_group(p)
                rc = 124
        secs = time.monotonic() - t0
        if not timed_out:
            try:
                self.cwd = Path(Path(f"{state}.cwd").read_text().strip())
                self.exports = Path(f"{state}.env").read_text()
            except OSError:
                pass
        return rc, secs, timed_out

    def start_server(self, cmd: Command, out: Path, wait: float) -> tuple[int | None, float]:
        t0 = time.monotonic()
        f = open(out, "wb")
        f.write(f"$ {one_line(cmd.text)}   (background)\n".encode())
        f.flush()
        p = subprocess.Popen(["bash", "-c", self._script("exec " + cmd.text, None)], stdout=f,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                             start_new_session=True)
        f.close()
        try:
            rc = p.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            rc = None
            self.servers.append((p, cmd))
        return rc, time.monotonic() - t0

    def stop_servers(self) -> list[str]:
        notes = []
        for p, cmd in reversed(self.servers):
            stop_group(p)
            notes.append(f"stopped pid {p.pid} ({cmd.doc}:{cmd.line})")
        self.servers.clear()
        return notes


def stop_group(p: subprocess.Popen) -> None:
    """SIGTERM the process group this script started (by its pid), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------------------
# the log

def one_line(s: str) -> str:
    """A multi-line shell command on one line: `for …; do` + `a` + `done` → `for …; do a; done`."""
    out = ""
    for part in s.split("\n"):
        part = part.strip()
        if not out:
            out = part
        elif re.search(r"(\bdo|\bthen|\belse|\{|;|&&|\|\|)$", out):
            out += " " + part
        else:
            out += "; " + part
    return out


def md_cell(s: str) -> str:
    return one_line(s).replace(r"\|", "|").replace("|", r"\|")


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def result_label(r: Result) -> str:
    if r.status == "passed":
        return "passed"
    if r.status in ("failed", "timeout"):
        return f"**{r.status.upper()}** (exit {r.rc})"
    if r.status == "not run":
        return f"not run ({r.note})"
    if r.status == "same":
        return r.note
    if r.status == "started":
        return "passed (server up; stopped at end of file)"
    if r.status == "mention":
        return "not a command"
    return r.status


def render(args, header: dict, results: list[Result], done: bool) -> str:
    ran = [r for r in results if r.status in ("passed", "failed", "timeout", "started")]
    passed = [r for r in ran if r.status in ("passed", "started")]
    failed = [r for r in ran if r.status in ("failed", "timeout")]
    notrun = [r for r in results if r.status == "not run"]
    same = [r for r in results if r.status == "same"]
    uncl = [r for r in results if r.status == "unclassified"]
    total = sum(r.seconds for r in results)
    L = [f"# Commands of the README and docs/, run as written ({header['date']})", ""]
    L.append("Produced by `python scripts/run_doc_commands.py` (its docstring says what counts as "
             "a command and how it runs them)." + ("" if done else " **Run in progress.**"))
    L.append("")
    L.append("## Environment")
    L.append("")
    for k in ("recipe", "machine", "python", "tvm", "packages", "cwd", "commit", "timeout",
              "started"):
        if header.get(k):
            L.append(f"- **{k}**: {header[k]}")
    for n in header.get("notes") or []:
        L.append(f"- {n}")
    L.append("")
    L.append("## Summary")
    L.append("")
    L.append(f"- commands run: {len(ran)}; passed: {len(passed)}; failed: {len(failed)}")
    L.append(f"- not run (need a phone, the NDK or a GPU, or not matched by --only): "
             f"{len(notrun)}")
    L.append(f"- repeated commands not run again (same as an earlier row): {len(same)}")
    if uncl:
        L.append(f"- inline mentions not classified: {len(uncl)}")
    L.append(f"- total time of the commands run: {total / 60:.1f} min")
    L.append("")
    L.append("## Commands")
    L.append("")
    L.append("Kind: *block* = fenced shell block; *inline* = in prose; *synopsis* = a usage line "
             "run with concrete arguments (note); *elsewhere* = runs on a phone or needs a tool "
             "not on this machine.")
    L.append("")
    L.append("| # | doc:line | kind | command | result | seconds | commit |")
    L.append("|---|---|---|---|---|---|---|")
    for i, r in enumerate(results, 1):
        cmd = f"`{md_cell(r.text)}`"
        if r.note and r.status in ("passed", "failed", "timeout", "started") and \
                r.note != "as written":
            cmd += f" ({md_cell(r.note)})"
        secs = f"{r.seconds:.1f}" if r.status in ("passed", "failed", "timeout", "started") else ""
        L.append(f"| {i} | {r.doc}:{r.line} | {r.kind} | {cmd} | {md_cell(result_label(r))} "
                 f"| {secs} | {r.commit if secs else ''} |")
    L.append("")
    L.append("## Last lines of output")
    L.append("")
    for i, r in enumerate(results, 1):
        if r.status not in ("passed", "failed", "timeout", "started"):
            continue
        L.append(f"### {i}. {r.doc}:{r.line} — {result_label(r)}, {r.seconds:.1f} s")
        L.append("")
        L.append("```")
        L.append(f"$ {one_line(r.text)}")
        L.extend(x[:300] for x in r.tail if not NOISE.search(x))
        L.append("```")
        L.append("")
    return "\n".join(L) + "\n"


def key_of(doc: str, text: str) -> str:
    return f"{doc}\x00{text}"


# ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cwd", type=Path, default=ROOT, help="checkout the commands run in")
    ap.add_argument("--venv", type=Path, help="virtual environment to activate")
    ap.add_argument("--log", type=Path,
                    default=ROOT / "out" / "doc_commands" / "commands_checked.md",
                    help="the run log (Markdown; its results in LOG.json beside it)")
    ap.add_argument("--outdir", type=Path,
                    help="full output of each command (default: a new folder in /tmp)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    ap.add_argument("--tail", type=int, default=12, help="output lines kept in the log")
    ap.add_argument("--server", action="append", default=list(DEFAULT_SERVERS),
                    help="regex of commands that are servers (run in the background)")
    ap.add_argument("--server-wait", type=float, default=10)
    ap.add_argument("--only", help="regex: run only matching commands, keep the earlier results "
                    "of the others from LOG.json")
    ap.add_argument("--list", action="store_true", help="print the commands and exit")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite LOG from its JSON sidecar (LOG.json) and run nothing")
    ap.add_argument("--date", default=_dt.date.today().isoformat())
    ap.add_argument("--recipe", default="", help="how the venv was made (for the log)")
    ap.add_argument("--note", action="append", default=[], help="a note for the log's header")
    args = ap.parse_args(argv)

    cwd = args.cwd.resolve()
    cmds, extra = collect(cwd)
    if args.list:
        for c in cmds:
            flag = f"   [needs: {c.needs}]" if c.needs else ""
            print(f"{c.doc}:{c.line} [{c.kind}] {c.text}{flag}")
        for r in extra:
            print(f"{r.doc}:{r.line} [{r.kind}] {r.text}   [{r.status}: {r.note}]")
        return 0

    state_path = args.log.with_suffix(".json")
    if args.render_only:
        saved = json.loads(state_path.read_text())
        saved["header"].update({k: v for k, v in (("recipe", args.recipe),
                                                  ("notes", args.note)) if v})
        write_atomic(args.log, render(args, saved["header"],
                                      [Result(**r) for r in saved["results"]], True))
        return 0
    previous: dict[str, dict] = {}
    if args.only and state_path.exists():
        saved = json.loads(state_path.read_text())
        for r in saved["results"]:
            r.setdefault("commit", saved["header"].get("commit", ""))
            previous[key_of(r["doc"], r["text"])] = r
    work = Path(tempfile.mkdtemp(prefix="doccmds."))
    outdir = args.outdir or work / "out"
    outdir.mkdir(parents=True, exist_ok=True)
    env = venv_env(args.venv)
    py = str(args.venv / "bin" / "python") if args.venv else sys.executable
    header = {
        "date": args.date,
        "recipe": args.recipe,
        "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
        "cwd": f"`{cwd}`",
        "timeout": f"{args.timeout:.0f} s per command",
        "started": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "commit": git_head(cwd),
        "notes": args.note,
    }
    sh = Shell(cwd, env, work)
    only = re.compile(args.only) if args.only else None
    servers = [re.compile(s) for s in args.server]
    results: list[Result] = []
    first_seen: dict[str, tuple[int, Result]] = {}
    cur_block = None

    def save(done=False):
        write_atomic(args.log, render(args, header, results, done))
        write_atomic(state_path, json.dumps({"header": header,
                                             "results": [asdict(r) for r in results]}, indent=1))

    # order: by doc, then fenced blocks and inline commands by line
    docs_order = []
    for c in cmds:
        if c.doc not in docs_order:
            docs_order.append(c.doc)
    for r in extra:
        if r.doc not in docs_order:
            docs_order.append(r.doc)
    for doc in docs_order:
        items = [("cmd", c.line, c) for c in cmds if c.doc == doc] + \
                [("res", r.line, r) for r in extra if r.doc == doc]
        # fenced blocks in order, then the prose (inline, synopsis, elsewhere) in order:
        # prose checks may use what the blocks made (models, databases)
        items.sort(key=lambda x: (x[0] == "res" or x[2].kind != "block", x[1]))
        sh.reset_file()
        cur_block = None
        for what, _, item in items:
            if what == "res" or item.kind != "block":
                for note in sh.stop_servers():   # servers live for the fenced blocks only
                    print("    " + note, flush=True)
            if what == "res":
                results.append(item)
                continue
            c: Command = item
            if c.kind != "block" or c.block != cur_block:
                sh.reset_block()
                cur_block = c.block if c.kind == "block" else None
            now = _dt.datetime.now().strftime("%H:%M")
            if c.needs:
                results.append(Result(c.doc, c.line, c.text, c.kind, "not run",
                                      note=f"needs {c.needs}"))
                continue
            k = c.text
            if k in first_seen:
                i, r0 = first_seen[k]
                results.append(Result(c.doc, c.line, c.text, c.kind, "same",
                                      note=f"same as #{i} ({r0.doc}:{r0.line}): {r0.status}"))
                continue
            prev = previous.get(key_of(c.doc, c.text))
            if only and not only.search(c.text) and not sets_state(c.text):
                # --only runs nothing else: an earlier result is kept, else none is claimed
                if prev:
                    r = Result(**prev)
                    r.line, r.kind = c.line, c.kind
                else:
                    r = Result(c.doc, c.line, c.text, c.kind, "not run",
                               note="not matched by --only")
                results.append(r)
                first_seen[k] = (len(results), r)
                save()
                continue
            n = len(results) + 1
            out = outdir / f"{n:03d}.log"
            print(f"[{now}] #{n} {c.doc}:{c.line}: {c.text}", flush=True)
            if any(s.search(c.text) for s in servers):
                rc, secs = sh.start_server(c, out, args.server_wait)
                status = "started" if rc is None else ("failed" if rc else "passed")
                r = Result(c.doc, c.line, c.text, c.kind, status, rc, secs, tail(out, args.tail),
                           c.note, now, header["commit"])
            else:
                rc, secs, to = sh.run(c.text, out, args.timeout)
                status = "timeout" if to else ("passed" if rc == 0 else "failed")
                r = Result(c.doc, c.line, c.text, c.kind, status, rc, secs, tail(out, args.tail),
                           c.note, now, header["commit"])
            print(f"    -> {status} rc={rc} {secs:.1f}s", flush=True)
            results.append(r)
            first_seen[k] = (len(results), r)
            if r.status == "passed" and " && " in k:   # `a && b` passed: a and b ran
                for part in k.split(" && "):
                    first_seen.setdefault(part.strip(), (len(results), r))
            save()
        for note in sh.stop_servers():
            print("    " + note, flush=True)
    header["python"] = probe(py, "import sys; print(sys.version.split()[0])")
    header["tvm"] = probe(py, "import tvm, tvm_ffi; print('apache-tvm', tvm.__version__, "
                              "'/ apache-tvm-ffi', tvm_ffi.__version__)")
    header["packages"] = probe(py, PACKAGES)
    save(done=True)
    print(f"log: {args.log}; outputs: {outdir}")
    return 0 if not any(r.status in ("failed", "timeout") for r in results) else 1


PACKAGES = """
import importlib.metadata as m
names = ("torch", "torchvision", "onnx", "onnxruntime", "transformers", "timm", "pyopencl")
found = []
for n in names:
    try:
        found.append(f"{n} {m.version(n)}")
    except m.PackageNotFoundError:
        pass
print(", ".join(found))
"""


def probe(py: str, code: str) -> str:
    try:
        p = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
        return p.stdout.strip() or p.stderr.strip().splitlines()[-1]
    except Exception as e:  # noqa: BLE001 - the log says what went wrong
        return f"({type(e).__name__})"


def git_head(cwd: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(cwd), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


if __name__ == "__main__":
    sys.exit(main())
