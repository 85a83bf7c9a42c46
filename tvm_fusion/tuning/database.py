"""The profiling database: measured latencies of candidate kernels, per target and device.

DNNFusion resolves its yellow (fuse_depend) cells from "a profiling database" of fused-kernel
latencies (§4.3; about 22K entries after 15 models). Ours is one SQLite file:

* **WAL mode, ``BEGIN IMMEDIATE`` transactions, a busy timeout**: several processes (parallel
  compiles, a tuning farm) may measure into one file at once; each write is one short
  transaction, and a process killed mid-write leaves the last committed state.
* **Key**: ``(target, device_key, strategy, kernel_hash, variant)``. ``kernel_hash`` is the
  candidate's canonical hash (:mod:`.candidate`: per-operator TIR structural hashes, wiring,
  input shapes and dtypes); ``variant`` is ``fused`` or ``split:<j>``; ``strategy`` names the
  schedule both variants were built with (DNNFusion notes §8.2 item 9: a verdict only holds for
  the scheduler that produced it). ``shapes`` is stored beside the key for people and filters.
* **Entries** keep every run's samples (seconds) under a run id, so two processes timing the
  same kernel merge instead of overwriting, and importing a file twice changes nothing; median,
  mean, std, min and count are recomputed from all samples on every merge.
* **Versioned schema**: ``PRAGMA application_id`` marks the file as ours, ``user_version`` and
  ``meta.schema_version`` give the schema, and :data:`MIGRATIONS` upgrades older files in one
  transaction. A file that is not SQLite, or SQLite that is not ours, or ours from a newer
  schema, raises :class:`ProfilingDatabaseError` naming the file and is never written to.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from ..atomic import atomic_write_text

APPLICATION_ID = 0x54464442  # "TFDB"
FORMAT = "tvm_fusion.profiling_db"
SCHEMA_VERSION = 1
ENV_PATH = "TVM_FUSION_DB"
_SQLITE_MAGIC = b"SQLite format 3\x00"
_KEY = ("target", "device_key", "strategy", "kernel_hash", "variant")


class ProfilingDatabaseError(ValueError):
    """The file cannot be used as a profiling database; the message names the file."""


def default_path() -> str:
    """``$TVM_FUSION_DB``, else ``~/.cache/tvm_fusion/profiling.db``."""
    env = os.environ.get(ENV_PATH)
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "tvm_fusion", "profiling.db")


@dataclass
class Measurement:
    """One timing run of one variant, as handed to :meth:`ProfilingDatabase.record`."""

    target: str
    device_key: str
    strategy: str
    kernel_hash: str
    variant: str
    samples: list[float]  # seconds, one per repeat
    method: str = "local"  # "local" | "rpc"
    shapes: str = ""
    description: str = ""
    features: dict = field(default_factory=dict)
    tvm_version: str = ""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    measured_at: float = field(default_factory=time.time)


@dataclass
class Entry:
    """A database row: the key, what it is, and statistics over every run (seconds)."""

    target: str
    device_key: str
    strategy: str
    kernel_hash: str
    variant: str
    shapes: str
    description: str
    method: str
    median: float
    mean: float
    std: float
    min: float
    count: int
    features: dict
    tvm_version: str
    created_at: float
    updated_at: float
    runs: dict  # run id -> {"samples": [...], "at": time, "method": ...}

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(getattr(self, k) for k in _KEY)

    def to_json(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------- migrations

def _migrate_0_to_1(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("""
        CREATE TABLE entries (
            id INTEGER PRIMARY KEY,
            target TEXT NOT NULL,
            device_key TEXT NOT NULL,
            strategy TEXT NOT NULL,
            kernel_hash TEXT NOT NULL,
            variant TEXT NOT NULL,
            shapes TEXT NOT NULL,
            description TEXT NOT NULL,
            method TEXT NOT NULL,
            median REAL NOT NULL,
            mean REAL NOT NULL,
            std REAL NOT NULL,
            min REAL NOT NULL,
            count INTEGER NOT NULL,
            features TEXT NOT NULL,
            tvm_version TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            runs TEXT NOT NULL,
            UNIQUE (target, device_key, strategy, kernel_hash, variant)
        )""")
    conn.execute("CREATE INDEX entries_updated ON entries (updated_at)")
    conn.execute("INSERT INTO meta VALUES ('format', ?)", (FORMAT,))
    conn.execute("INSERT INTO meta VALUES ('created_at', ?)", (str(time.time()),))


# MIGRATIONS[v] upgrades schema v to v + 1; each runs inside the upgrade transaction.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {0: _migrate_0_to_1}


# --------------------------------------------------------------------------------- database

class ProfilingDatabase:
    """The profiling database in one SQLite file (see the module docstring).

    Parameters
    ----------
    path
        The file; ``None`` means :func:`default_path`.
    create
        Create the file if it does not exist (``False``: a missing file is an error, as the
        read-only CLI commands want).
    busy_timeout_s
        How long a writer waits for another process's transaction before giving up.
    """

    def __init__(self, path: str | os.PathLike | None = None, create: bool = True,
                 busy_timeout_s: float = 60.0):
        self.path = os.fspath(path) if path is not None else default_path()
        if not os.path.exists(self.path):
            if not create:
                raise ProfilingDatabaseError(f"{self.path}: no such profiling database")
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        elif os.path.isdir(self.path):
            raise ProfilingDatabaseError(f"{self.path}: is a directory, not a database file")
        _check_header(self.path)
        self._lock = threading.RLock()
        with self._errors("open"):
            # One connection, usable from any thread of this process (TVM may run a pass
            # elsewhere than where the oracle was made); ``_lock`` serialises its use.
            self.conn = sqlite3.connect(self.path, timeout=busy_timeout_s,
                                        isolation_level=None, check_same_thread=False)
        self.conn.row_factory = sqlite3.Row
        try:
            with self._errors("open"):
                self.conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
                with self._snapshot():  # before anything writes to the file
                    self._check_ours()
                self._enable_wal()
                self.conn.execute("PRAGMA synchronous = FULL")
                self._migrate()
        except BaseException:
            self.conn.close()
            raise

    # ------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ProfilingDatabase:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _errors(self, action: str):
        """SQLite errors name the file and the action, never just 'database is locked'."""
        try:
            with self._lock:
                yield
        except ProfilingDatabaseError:
            raise
        except sqlite3.DatabaseError as err:
            raise ProfilingDatabaseError(
                f"{self.path}: cannot {action} the profiling database ({err}); the file is "
                "corrupt or not a tvm_fusion profiling database, and was left untouched"
            ) from None

    @contextlib.contextmanager
    def _write(self):
        """One ``BEGIN IMMEDIATE`` transaction: the write lock is taken up front, so two
        writers serialise instead of deadlocking on a read-to-write upgrade."""
        with self._errors("write to"):
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    @contextlib.contextmanager
    def _snapshot(self):
        """One read transaction, so that several reads see the file at the same moment: read
        one by one, another process's creation could land between them (application id 0 from
        before it, its tables from after: a new database mistaken for a foreign one)."""
        self.conn.execute("BEGIN")
        try:
            yield
        finally:
            self.conn.execute("COMMIT")

    def _check_ours(self) -> None:
        app_id = self.conn.execute("PRAGMA application_id").fetchone()[0]
        tables = [r[0] for r in self.conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")]
        if app_id == APPLICATION_ID:
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ProfilingDatabaseError(
                    f"{self.path}: profiling database schema v{version} is newer than this "
                    f"tvm_fusion understands (v{SCHEMA_VERSION}); upgrade tvm_fusion")
            return
        if app_id == 0 and not tables:
            return  # a new (or empty) file: nothing in it to lose
        what = f"application id {app_id:#x}" if app_id else "tables " + ", ".join(tables[:5])
        raise ProfilingDatabaseError(
            f"{self.path}: an SQLite database that is not a tvm_fusion profiling database "
            f"({what}); refusing to use or overwrite it")

    def _enable_wal(self) -> None:
        for attempt in range(50):
            try:
                mode = self.conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if mode.lower() == "wal":
                    return
            except sqlite3.OperationalError:  # another process holds a lock: retry
                pass
            time.sleep(0.01 * (attempt + 1))
        raise ProfilingDatabaseError(f"{self.path}: cannot switch the database to WAL mode")

    def _migrate(self) -> None:
        if self.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
            return
        with self._write() as conn:
            self._check_ours()  # again, under the lock: another process may have created it
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            while version < SCHEMA_VERSION:
                MIGRATIONS[version](conn)
                version += 1
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))

    @property
    def schema_version(self) -> int:
        return int(self.conn.execute("PRAGMA user_version").fetchone()[0])

    # ---------------------------------------------------------------------- reads, writes

    def lookup(self, target: str, device_key: str, strategy: str, kernel_hash: str,
               variant: str) -> Entry | None:
        """The entry under this key, or ``None``."""
        with self._errors("read"):
            row = self.conn.execute(
                f"SELECT * FROM entries WHERE {' AND '.join(f'{k} = ?' for k in _KEY)}",
                (target, device_key, strategy, kernel_hash, variant)).fetchone()
            return None if row is None else self._entry(row)

    def record(self, m: Measurement) -> Entry:
        """Add one run; if the key exists its runs are merged (a run id already present is
        skipped, so re-importing is harmless). Returns the entry as stored."""
        if not m.samples:
            raise ValueError(f"measurement of {m.kernel_hash}/{m.variant} has no samples")
        run = {"samples": [float(s) for s in m.samples], "at": m.measured_at,
               "method": m.method}
        return self._merge(
            dict(target=m.target, device_key=m.device_key, strategy=m.strategy,
                 kernel_hash=m.kernel_hash, variant=m.variant, shapes=m.shapes,
                 description=m.description, method=m.method, features=m.features,
                 tvm_version=m.tvm_version, created_at=m.measured_at,
                 updated_at=m.measured_at),
            {m.run_id: run})

    def _merge(self, info: dict, runs: dict) -> Entry:
        key = tuple(info[k] for k in _KEY)
        with self._write() as conn:
            row = conn.execute(
                f"SELECT * FROM entries WHERE {' AND '.join(f'{k} = ?' for k in _KEY)}",
                key).fetchone()
            if row is None:
                merged, created = dict(runs), info["created_at"]
                old = None
            else:
                old = self._entry(row)
                if set(runs) <= set(old.runs):
                    return old
                merged = {**old.runs, **runs}
                created = min(old.created_at, info["created_at"])
            stats = _stats(merged)
            updated = max([r["at"] for r in merged.values()] + [info["updated_at"]])
            values = dict(info, **stats, created_at=created, updated_at=updated,
                          features=json.dumps(info["features"] or (old.features if old else {}),
                                              sort_keys=True),
                          runs=json.dumps(merged, sort_keys=True))
            columns = list(values)
            conn.execute(
                f"INSERT INTO entries ({', '.join(columns)}) VALUES "
                f"({', '.join('?' for _ in columns)}) ON CONFLICT "
                f"({', '.join(_KEY)}) DO UPDATE SET "
                + ", ".join(f"{c} = excluded.{c}" for c in columns if c not in _KEY),
                [values[c] for c in columns])
        return self._entry_from(values)

    def entries(self, target: str | None = None, device_key: str | None = None,
                strategy: str | None = None, order: str = "updated_at DESC",
                limit: int | None = None) -> Iterator[Entry]:
        """Entries matching every filter given."""
        where, params = _filters(target=target, device_key=device_key, strategy=strategy)
        if order not in ("updated_at DESC", "median DESC", "median ASC", "id"):
            raise ValueError(f"unsupported order {order!r}")
        sql = f"SELECT * FROM entries{where} ORDER BY {order}"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._errors("read"):
            rows = self.conn.execute(sql, params).fetchall()
        return (self._entry(r) for r in rows)

    def __len__(self) -> int:
        with self._errors("read"):
            return int(self.conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0])

    def stats(self) -> dict:
        """Counts per (target, device, strategy), sizes and ages, for ``tvm-fusion db stats``."""
        with self._errors("read"):
            groups = [
                {"target": t, "device_key": d, "strategy": s, "entries": n, "kernels": k}
                for t, d, s, n, k in self.conn.execute(
                    "SELECT target, device_key, strategy, COUNT(*), COUNT(DISTINCT kernel_hash)"
                    " FROM entries GROUP BY target, device_key, strategy ORDER BY 4 DESC")]
            oldest, newest, samples, kernels = self.conn.execute(
                "SELECT MIN(created_at), MAX(updated_at), SUM(count),"
                " COUNT(DISTINCT kernel_hash) FROM entries").fetchone()
        size = sum(os.path.getsize(p) for p in (self.path, self.path + "-wal")
                   if os.path.exists(p))
        return {"path": self.path, "schema_version": self.schema_version, "entries": len(self),
                "kernels": kernels, "samples": samples or 0, "bytes": size, "oldest": oldest,
                "newest": newest, "groups": groups}

    def check(self) -> str:
        """SQLite's ``quick_check``: ``"ok"`` or the first problem found."""
        with self._errors("check"):
            return self.conn.execute("PRAGMA quick_check").fetchone()[0]

    def prune(self, older_than_s: float | None = None, target: str | None = None,
              device_key: str | None = None, strategy: str | None = None,
              tvm_version: str | None = None, everything: bool = False,
              dry_run: bool = False) -> int:
        """Delete entries matching every criterion given; returns how many (would) go.

        At least one criterion, or ``everything=True``, is required: an empty filter
        deleting the whole database by accident is the failure this guards against.
        """
        where, params = _filters(target=target, device_key=device_key, strategy=strategy,
                                 tvm_version=tvm_version)
        if older_than_s is not None:
            where += (" AND" if where else " WHERE") + " updated_at < ?"
            params.append(time.time() - older_than_s)
        if not where and not everything:
            raise ValueError("prune needs a criterion (--older-than, --target, --device, "
                             "--strategy, --tvm-version) or --all")
        with self._write() as conn:
            count = int(conn.execute(f"SELECT COUNT(*) FROM entries{where}", params)
                        .fetchone()[0])
            if not dry_run:
                conn.execute(f"DELETE FROM entries{where}", params)
        return count

    # ------------------------------------------------------- Apollo feedback blocklist
    # A sibling table created on demand (``CREATE TABLE IF NOT EXISTS``): files without it are
    # still schema v1, older tvm_fusion versions ignore it, so no migration is needed.

    def _blocklist_table(self, conn) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS apollo_blocklist (target TEXT NOT NULL, "
                     "signature TEXT NOT NULL, reason TEXT NOT NULL, created_at REAL NOT NULL, "
                     "PRIMARY KEY (target, signature))")

    def blocklist_add(self, target: str, signature: str, reason: str) -> None:
        """Remember a merge Apollo's fusion phase rejected (relay_passes/apollo/feedback.py)."""
        with self._write() as conn:
            self._blocklist_table(conn)
            conn.execute("INSERT OR REPLACE INTO apollo_blocklist VALUES (?, ?, ?, ?)",
                         (target, signature, reason, time.time()))

    def blocklist(self, target: str | None = None) -> list[dict]:
        """Blocklisted merges (all targets when ``target`` is ``None``), oldest first."""
        with self._errors("read"):
            exists = self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                       "AND name = 'apollo_blocklist'").fetchone()
            if not exists:
                return []
            sql = "SELECT * FROM apollo_blocklist"
            rows = (self.conn.execute(sql + " WHERE target = ? ORDER BY created_at", (target,))
                    if target is not None else self.conn.execute(sql + " ORDER BY created_at"))
            return [dict(r) for r in rows.fetchall()]

    def vacuum(self) -> None:
        """Give freed pages back to the file system (after a large prune)."""
        with self._errors("vacuum"):
            self.conn.execute("VACUUM")

    # ------------------------------------------------------------------------------ JSON

    def export_json(self, path: str | os.PathLike, **filters) -> int:
        """Write the entries (optionally filtered) to a JSON file, atomically; returns count."""
        path = os.fspath(path)
        if os.path.exists(path):
            _check_json_is_ours(path, for_overwrite=True)
        entries = [e.to_json() for e in self.entries(order="id", **filters)]
        doc = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "exported_at": time.time(),
               "entries": entries}
        atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
        return len(entries)

    def import_json(self, path: str | os.PathLike) -> dict:
        """Merge the entries of an export; returns ``{"added", "merged", "unchanged"}``."""
        doc = _check_json_is_ours(os.fspath(path))
        parsed = []  # every entry is checked before any is merged
        for number, raw in enumerate(doc["entries"]):
            try:
                info = {k: raw[k] for k in (*_KEY, "shapes", "description", "method",
                                             "features", "tvm_version", "created_at",
                                             "updated_at")}
                runs = {str(k): {"samples": [float(x) for x in r["samples"]],
                                 "at": float(r["at"]), "method": str(r["method"])}
                        for k, r in raw["runs"].items()}
                if not runs or not all(r["samples"] for r in runs.values()):
                    raise ValueError("no samples")
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                raise ProfilingDatabaseError(
                    f"{path}: entry {number} is not a tvm_fusion profiling entry "
                    f"({type(err).__name__}: {err}); nothing was imported") from None
            parsed.append((info, runs))
        counts = {"added": 0, "merged": 0, "unchanged": 0}
        for info, runs in parsed:
            before = self.lookup(*(info[k] for k in _KEY))
            after = self._merge(info, runs)
            if before is None:
                counts["added"] += 1
            elif after.count != before.count:
                counts["merged"] += 1
            else:
                counts["unchanged"] += 1
        return counts

    # ------------------------------------------------------------------------- internals

    def _entry(self, row: sqlite3.Row) -> Entry:
        return self._entry_from(dict(row))

    @staticmethod
    def _entry_from(values: dict) -> Entry:
        data = {k: values[k] for k in Entry.__dataclass_fields__}
        for name in ("features", "runs"):
            if isinstance(data[name], str):
                data[name] = json.loads(data[name])
        return Entry(**data)


def _stats(runs: dict) -> dict:
    samples = [s for run in runs.values() for s in run["samples"]]
    return {"median": statistics.median(samples), "mean": statistics.fmean(samples),
            "std": statistics.pstdev(samples) if len(samples) > 1 else 0.0,
            "min": min(samples), "count": len(samples)}


def _filters(**criteria) -> tuple[str, list]:
    parts, params = [], []
    for column, value in criteria.items():
        if value is not None:
            parts.append(f"{column} = ?")
            params.append(value)
    return (" WHERE " + " AND ".join(parts) if parts else ""), params


def _check_header(path: str) -> None:
    """A non-empty file must start with SQLite's magic; otherwise never touch it."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(_SQLITE_MAGIC))
    except FileNotFoundError:
        return
    except OSError as err:
        raise ProfilingDatabaseError(f"{path}: cannot read the file ({err})") from None
    if head and head != _SQLITE_MAGIC:
        raise ProfilingDatabaseError(
            f"{path}: not a tvm_fusion profiling database (not an SQLite file); "
            "refusing to use or overwrite it")


def _check_json_is_ours(path: str, for_overwrite: bool = False) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except FileNotFoundError:
        raise ProfilingDatabaseError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        doc = None
        reason = f"not JSON: {err}"
    else:
        reason = "no 'format': 'tvm_fusion.profiling_db' field"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        verb = "refusing to overwrite it" if for_overwrite else "cannot import it"
        raise ProfilingDatabaseError(
            f"{path}: not a tvm_fusion profiling export ({reason}); {verb}")
    if int(doc.get("schema_version", 0)) > SCHEMA_VERSION:
        raise ProfilingDatabaseError(
            f"{path}: export schema v{doc['schema_version']} is newer than this tvm_fusion "
            f"understands (v{SCHEMA_VERSION})")
    if not isinstance(doc.get("entries"), list):
        raise ProfilingDatabaseError(f"{path}: export has no 'entries' list")
    return doc
