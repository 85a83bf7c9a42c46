"""The profiling database: merges, JSON round trips, foreign and corrupt files, several writer
processes at once, a writer killed mid-transaction, and the ``tvm-fusion db`` commands."""

import argparse
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from tvm_fusion.tuning import database as dbmod
from tvm_fusion.tuning.database import (
    Measurement,
    ProfilingDatabase,
    ProfilingDatabaseError,
)
from tvm_fusion.tuning.db_cli import add_db_parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _m(key="k0", variant="fused", samples=(1e-3, 2e-3, 3e-3), **kw):
    return Measurement("llvm", "dev0", "unscheduled", key, variant, list(samples), **kw)


def _digest(path):
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def _child(code: str, *args, **kwargs) -> subprocess.Popen:
    """A Python child process running ``code`` from the repository root."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


# ------------------------------------------------------------------------------- basics

def test_record_lookup_and_merge(tmp_path):
    with ProfilingDatabase(tmp_path / "p.db") as db:
        assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        first = _m(features={"n_ops": 2})
        entry = db.record(first)
        assert (entry.median, entry.count) == (2e-3, 3)
        assert db.record(first).count == 3  # the same run again: nothing changes
        merged = db.record(_m(samples=[5e-3]))  # another run of the same kernel: merged
        assert (merged.count, merged.median, merged.min) == (4, 2.5e-3, 1e-3)
        stored = db.lookup("llvm", "dev0", "unscheduled", "k0", "fused")
        assert stored.count == 4 and stored.features == {"n_ops": 2} and len(stored.runs) == 2
        assert db.lookup("llvm", "dev0", "unscheduled", "k0", "split:1") is None
        assert db.lookup("llvm", "dev1", "unscheduled", "k0", "fused") is None
        with pytest.raises(ValueError, match="no samples"):
            db.record(_m(samples=[]))
        assert db.stats()["entries"] == 1 and db.check() == "ok"


def test_json_round_trip_is_idempotent(tmp_path):
    src = ProfilingDatabase(tmp_path / "a.db")
    for i in range(5):
        src.record(_m(f"k{i}", samples=[i + 1e-3], shapes="float32[2,3]", description="a b"))
        src.record(_m(f"k{i}", "split:1", samples=[i + 2e-3]))
    out = tmp_path / "export.json"
    assert src.export_json(out) == 10
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # atomic: no leftovers
    dst = ProfilingDatabase(tmp_path / "b.db")
    assert dst.import_json(out) == {"added": 10, "merged": 0, "unchanged": 0}
    assert dst.import_json(out) == {"added": 0, "merged": 0, "unchanged": 10}
    a = [e.to_json() for e in src.entries(order="id")]
    b = [e.to_json() for e in dst.entries(order="id")]
    assert a == b
    # filters; and an export never overwrites a file that is not one of ours
    assert src.export_json(tmp_path / "k0.json", strategy="none") == 0
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    with pytest.raises(ProfilingDatabaseError, match="notes.json.*refusing to overwrite"):
        src.export_json(notes)
    assert notes.read_text() == '{"mine": 1}'
    with pytest.raises(ProfilingDatabaseError, match="notes.json.*not a tvm_fusion"):
        dst.import_json(notes)
    doc = json.loads(out.read_text())
    doc["entries"][3]["runs"] = {}  # one bad entry: nothing at all is imported
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(doc))
    fresh = ProfilingDatabase(tmp_path / "c.db")
    with pytest.raises(ProfilingDatabaseError, match="broken.json: entry 3 .*nothing was imported"):
        fresh.import_json(broken)
    assert len(fresh) == 0


# ----------------------------------------------------------------- foreign, corrupt, newer

def _assert_refused(path, match):
    before = _digest(path)
    for create in (True, False):
        with pytest.raises(ProfilingDatabaseError, match=match) as err:
            ProfilingDatabase(path, create=create)
        assert str(path) in str(err.value)
    assert _digest(path) == before  # never written to
    assert not os.path.exists(f"{path}-wal")


def test_not_sqlite_is_refused_untouched(tmp_path):
    path = tmp_path / "profile.db"
    path.write_text("these are my notes, not a database\n")
    _assert_refused(path, "not an SQLite file")


def test_foreign_sqlite_is_refused_untouched(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE customers (name TEXT)")
    conn.execute("INSERT INTO customers VALUES ('ada')")
    conn.commit()
    conn.close()
    _assert_refused(path, "not a tvm_fusion profiling database.*customers")
    conn = sqlite3.connect(tmp_path / "app.db")
    conn.execute("PRAGMA application_id = 1234")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    _assert_refused(tmp_path / "app.db", "application id 0x4d2")


def test_corrupt_database_is_refused_untouched(tmp_path):
    path = tmp_path / "p.db"
    with ProfilingDatabase(path) as db:
        for i in range(50):
            db.record(_m(f"k{i}", description="x" * 200))
        db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    data[100:] = bytes(len(data) - 100)  # keep SQLite's header, zero every page
    path.write_bytes(bytes(data))
    _assert_refused(path, "corrupt or not a tvm_fusion")


def test_newer_schema_is_refused_and_migrations_run(tmp_path, monkeypatch):
    newer = tmp_path / "newer.db"
    with ProfilingDatabase(newer) as db:
        db.conn.execute("PRAGMA user_version = 99")
    _assert_refused(newer, "schema v99 is newer")

    old = tmp_path / "old.db"
    with ProfilingDatabase(old) as db:
        db.record(_m())

    def add_notes(conn):
        conn.execute("ALTER TABLE entries ADD COLUMN notes TEXT NOT NULL DEFAULT ''")

    monkeypatch.setattr(dbmod, "SCHEMA_VERSION", 2)
    monkeypatch.setitem(dbmod.MIGRATIONS, 1, add_notes)
    with ProfilingDatabase(old) as db:
        assert db.schema_version == 2
        meta = dict(db.conn.execute("SELECT key, value FROM meta").fetchall())
        assert meta["schema_version"] == "2" and meta["format"] == dbmod.FORMAT
        columns = [r[1] for r in db.conn.execute("PRAGMA table_info(entries)")]
        assert "notes" in columns
        assert db.lookup("llvm", "dev0", "unscheduled", "k0", "fused").count == 3


def test_empty_file_becomes_a_database(tmp_path):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    with ProfilingDatabase(path) as db:
        assert db.schema_version == dbmod.SCHEMA_VERSION
    with pytest.raises(ProfilingDatabaseError, match="no such profiling database"):
        ProfilingDatabase(tmp_path / "missing.db", create=False)


# ---------------------------------------------------------------- several processes, kills

_WRITER = """
    import sys
    from tvm_fusion.tuning.database import Measurement, ProfilingDatabase
    path, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    db = ProfilingDatabase(path)
    for i in range(n):
        m = Measurement("llvm", "dev0", "unscheduled", f"k{i % 40}", "fused", [1e-3 + i * 1e-6],
                        run_id=f"{name}-{i}")
        db.record(m)
    print("done", flush=True)
"""


def test_two_writer_processes_lose_nothing(tmp_path):
    path = tmp_path / "shared.db"
    n = 80
    children = [_child(_WRITER, path, name, n) for name in ("a", "b")]
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    with ProfilingDatabase(path) as db:
        assert db.check() == "ok"
        entries = list(db.entries())
        assert len(entries) == 40
        runs = {r for e in entries for r in e.runs}
        assert runs == {f"{name}-{i}" for name in "ab" for i in range(n)}  # every write kept
        assert all(e.count == len(e.runs) == 2 * n // 40 for e in entries)


_KILLED = """
    import sys, time
    from tvm_fusion.tuning.database import Measurement, ProfilingDatabase
    db = ProfilingDatabase(sys.argv[1])
    for i in range(20):
        db.record(Measurement("llvm", "dev0", "unscheduled", f"c{i}", "fused", [1e-3]))
    db.conn.execute("PRAGMA cache_size = 2")  # spill uncommitted pages into the WAL file
    db.conn.execute("BEGIN IMMEDIATE")
    for i in range(3000):
        db.conn.execute(
            "INSERT INTO entries (target, device_key, strategy, kernel_hash, variant, shapes,"
            " description, method, median, mean, std, min, count, features, tvm_version,"
            " created_at, updated_at, runs) VALUES ('llvm', 'dev0', 'unscheduled', ?, 'fused',"
            " '', ?, 'local', 1, 1, 0, 1, 1, '{}', '', 0, 0, '{}')", (f"u{i}", "x" * 500))
    print("mid-transaction", flush=True)
    time.sleep(60)
"""


def test_writer_killed_mid_transaction_leaves_a_readable_database(tmp_path):
    path = tmp_path / "killed.db"
    child = _child(_KILLED, path)
    line = child.stdout.readline()
    assert line.strip() == "mid-transaction", child.stderr.read()
    assert os.path.getsize(f"{path}-wal") > 100_000  # uncommitted pages really are on disk
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    with ProfilingDatabase(path) as db:
        assert db.check() == "ok"
        keys = sorted(e.kernel_hash for e in db.entries())
        assert keys == sorted(f"c{i}" for i in range(20))  # committed kept, partial gone
        db.record(_m("after-kill"))  # and it is writable again
        assert len(db) == 21


@pytest.mark.slow
def test_writer_killed_while_recording_in_a_loop(tmp_path):
    path = tmp_path / "loop.db"
    child = _child(_WRITER, path, "x", 100_000)
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until it has committed a few hundred writes
        time.sleep(0.2)
        if os.path.exists(path):
            try:
                with ProfilingDatabase(path, create=False) as probe:
                    if sum(e.count for e in probe.entries()) > 300:
                        break
            except ProfilingDatabaseError:
                continue
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    with ProfilingDatabase(path) as db:
        assert db.check() == "ok"
        entries = list(db.entries())
        assert sum(e.count for e in entries) > 300
        assert all(e.count == sum(len(r["samples"]) for r in e.runs.values()) for e in entries)


# -------------------------------------------------------------------------------- the CLI

def _cli(*argv):
    parser = argparse.ArgumentParser(prog="tvm-fusion")
    add_db_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_db_commands(tmp_path, capsys):
    path = tmp_path / "p.db"
    with ProfilingDatabase(path) as db:
        db.record(_m("aaaa", description="transpose[Shuffle] +matmul[M2M]", shapes="f[2]"))
        db.record(_m("aaaa", "split:1", samples=[9e-3]))
        db.record(Measurement("cuda", "gpu0", "dlight", "bbbb", "fused", [1e-4]))
    assert _cli("db", "stats", "--db", str(path), "--check") == 0
    out = capsys.readouterr().out
    assert "3 entries of 2 candidates" in out and "integrity: ok" in out
    assert _cli("db", "stats", "--db", str(path), "--json") == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 3
    assert _cli("db", "list", "--db", str(path), "--sort", "slowest") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("aaaa") and "split:1" in lines[1] and "9000.00" in lines[1]
    assert "+matmul[M2M]" in "".join(lines)
    assert _cli("db", "list", "--db", str(path), "--target", "cuda", "--json") == 0
    assert [e["kernel_hash"] for e in json.loads(capsys.readouterr().out)] == ["bbbb"]

    out_json = tmp_path / "e.json"
    assert _cli("db", "export", "--db", str(path), str(out_json), "--device", "dev0") == 0
    assert "wrote 2 entries" in capsys.readouterr().out
    other = tmp_path / "q.db"
    assert _cli("db", "import", "--db", str(other), str(out_json)) == 0
    assert "2 added, 0 merged, 0 unchanged" in capsys.readouterr().out

    with pytest.raises(ValueError, match="prune needs a criterion"):
        _cli("db", "prune", "--db", str(path))
    assert _cli("db", "prune", "--db", str(path), "--strategy", "dlight", "--dry-run") == 0
    assert "would delete 1 entries" in capsys.readouterr().out
    assert _cli("db", "prune", "--db", str(path), "--older-than", "1") == 0
    assert "deleted 0 entries" in capsys.readouterr().out
    assert _cli("db", "prune", "--db", str(path), "--all", "--vacuum") == 0
    assert "deleted 3 entries" in capsys.readouterr().out

    bad = tmp_path / "bad.db"
    bad.write_text("not a database")
    with pytest.raises(ValueError, match="bad.db: not a tvm_fusion profiling database"):
        _cli("db", "stats", "--db", str(bad))
    with pytest.raises(ValueError, match="missing.db: no such profiling database"):
        _cli("db", "list", "--db", str(tmp_path / "missing.db"))
