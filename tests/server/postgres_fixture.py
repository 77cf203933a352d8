"""A throwaway PostgreSQL cluster for the shared-store tests (loopback only, password auth).

``postgres`` (session): starts ``initdb`` + ``pg_ctl`` in a temporary folder when the binaries are
found (on PATH or in Debian's ``/usr/lib/postgresql/*/bin``) and psycopg is installed; skips with
the reason otherwise.  ``postgres.new_database()`` gives each test a fresh, empty database URL.
Run as root, the cluster belongs to the ``postgres`` user (PostgreSQL refuses to run as root).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from .conftest import free_port

USER, PASSWORD = "kt", "s3cret-pw"


def _bin_dir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name))
    return Path(dirs[-1]) if dirs and (Path(dirs[-1]) / "pg_ctl").exists() else None


class Cluster:
    def __init__(self, bin_dir: Path):
        self.bin = bin_dir
        self.base = Path(tempfile.mkdtemp(prefix="kt-pg-"))
        self.port = free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.base, "postgres", "postgres")
        pwfile = self.base / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self.as_postgres:
            shutil.chown(pwfile, "postgres", "postgres")
        self._run("initdb", "-D", str(self.base / "data"), "-U", USER, "--auth=scram-sha-256",
                  f"--pwfile={pwfile}", "--no-sync", "-E", "UTF8", "--locale=C")
        self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.base / "data"), "-l", str(self.base / "log"),
                  "-o", f"-k {self.base} -p {self.port} -h 127.0.0.1 -F -c max_connections=100")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bin / tool), *args]
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.base)
        if r.returncode:
            raise RuntimeError(f"{tool} failed ({r.returncode}): {r.stderr[-2000:]}")

    def url(self, database: str = "postgres", *, password: str = PASSWORD) -> str:
        return f"postgresql://{USER}:{password}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "stop", "-D", str(self.base / "data"), "-m", "immediate")
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install 'ktransformers[scale-out]')")
    bin_dir = _bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no pg_ctl on PATH or in /usr/lib/postgresql/*/bin)")
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root without a 'postgres' user: PostgreSQL refuses to run as root")
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser: cannot start PostgreSQL as the 'postgres' user")
    cluster = Cluster(bin_dir)
    yield cluster
    cluster.stop()
