"""The server's store on SQLite and on PostgreSQL (``--database_url``): the same behaviour on both,
versioned migrations, several server processes sharing one database, and one-line errors for a
bad URL that never show its password."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from .postgres_fixture import PASSWORD, postgres  # noqa: F401 - the fixture

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path):
    """``(data_dir, url)`` for Database: SQLite in a temporary folder, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "data"), None
    return None, request.getfixturevalue("postgres").new_database()


def _open(store_url):
    from ktransformers.server.db import Database

    data_dir, url = store_url
    return Database(data_dir, url=url)


# ---- the store's behaviour on both --------------------------------------------------------

def test_models_match_the_migrations(store_url):
    """The ORM models and the migrated schema agree column by column (a change to one needs the other)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from ktransformers.server import responses_store  # noqa: F401 - its tables are in Base.metadata
    from ktransformers.server.db import Base

    db = _open(store_url)
    try:
        with db.engine.connect() as c:
            diff = compare_metadata(MigrationContext.configure(c), Base.metadata)
        assert diff == []
    finally:
        db.close()


def test_store_roundtrip_and_unfinished_rows(store_url):
    from ktransformers.server.db import Database, Message, Run, Thread
    from ktransformers.server.responses_store import (ConversationRow, ResponseRow, add_conversation_items,
                                                      conversation_items, expire_unfinished_responses,
                                                      response_chain_items)

    db = _open(store_url)
    with db.write() as s:
        s.add(ConversationRow(id="conv_1", created_at=1, meta={"k": "v"}))
        add_conversation_items(s, "conv_1", [{"id": f"msg_{i}", "type": "message", "n": i} for i in range(3)])
        s.add(ResponseRow(id="resp_a", created_at=1, status="completed", data={"output": [{"id": "o1"}]},
                          input_items=[{"id": "i1"}]))
        s.add(ResponseRow(id="resp_b", created_at=2, status="in_progress", previous_response_id="resp_a",
                          data={"status": "in_progress", "output": [{"id": "o2", "status": "in_progress"}]},
                          input_items=[{"id": "i2"}]))
        s.add(Thread(id="thread_1", created_at=1, meta={}))
        for i in range(25):
            s.add(Message(id=f"msg_t{i:02d}", thread_id="thread_1", created_at=i, role="user", content=[]))
        s.add(Run(id="run_1", thread_id="thread_1", assistant_id="asst_1", created_at=1, status="in_progress",
                  model="m"))
    with db.read() as s:
        assert [it["n"] for it in conversation_items(s, "conv_1")] == [0, 1, 2]
        assert [it["id"] for it in response_chain_items(s, "resp_b")] == ["i1", "o1", "i2", "o2"]
        page = Database.page(s, Message, Message.thread_id == "thread_1", limit=10, order="asc", after="msg_t04")
        assert [m["id"] for m in page["data"]] == [f"msg_t{i:02d}" for i in range(5, 15)] and page["has_more"]
        assert s.query(ResponseRow).filter_by(id="resp_b").one().owner == db.instance_id
    # this process's own unfinished rows are not orphans; those of a process that is gone are
    assert expire_unfinished_responses(db) == 0 and db.expire_unfinished_runs() == 0
    db.close()
    db2 = _open(store_url)
    try:
        assert expire_unfinished_responses(db2) == 1 and db2.expire_unfinished_runs() == 1
        with db2.read() as s:
            row = s.query(ResponseRow).filter_by(id="resp_b").one()
            assert row.status == "incomplete" and row.data["output"][0]["status"] == "incomplete"
            assert s.query(Run).one().status == "failed"
    finally:
        db2.close()


def test_a_live_server_keeps_its_unfinished_rows(postgres):  # noqa: F811
    """A server starting beside a live one sharing the database leaves the other's runs and responses alone."""
    from ktransformers.server.db import Database, Run
    from ktransformers.server.responses_store import ResponseRow, expire_unfinished_responses

    url = postgres.new_database()
    a = Database(url=url)
    with a.write() as s:
        s.add(ResponseRow(id="resp_live", created_at=0, status="in_progress", data={"output": []}, input_items=[]))
        s.add(Run(id="run_live", thread_id="t", assistant_id="a", created_at=0, status="in_progress", model="m"))
    b = Database(url=url)
    try:
        assert expire_unfinished_responses(b) == 0 and b.expire_unfinished_runs() == 0
        a.close()  # as a process that ended: its lock is gone
        assert expire_unfinished_responses(b) == 1 and b.expire_unfinished_runs() == 1
    finally:
        b.close()


# ---- migrations ---------------------------------------------------------------------------

def _upgrade_to(store_url, revision: str):
    """Bring a fresh database to ``revision`` only, as an older ktransformers left it; its engine."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    from ktransformers.server.db import DB_FILE, MIGRATIONS_DIR, parse_database_url

    data_dir, url = store_url
    if url:
        engine = create_engine(parse_database_url(url))
    else:
        from pathlib import Path

        Path(data_dir).mkdir(parents=True, exist_ok=True)
        engine = create_engine(f"sqlite:///{Path(data_dir) / DB_FILE}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    return engine


def test_migrates_the_previous_schema_keeping_rows(store_url):
    from sqlalchemy import inspect, text

    from ktransformers.server.db import Run
    from ktransformers.server.responses_store import ResponseRow

    engine = _upgrade_to(store_url, "0001")
    with engine.begin() as c:
        assert "owner" not in {col["name"] for col in inspect(c).get_columns("runs")}
        c.execute(text("INSERT INTO runs (id, thread_id, assistant_id, created_at, status, model, tools, metadata, "
                       "parallel_tool_calls) VALUES ('run_old', 't', 'a', 1, 'in_progress', 'm', '[]', '{}', true)"))
        c.execute(text("INSERT INTO responses (id, created_at, status, data, input_items) "
                       "VALUES ('resp_old', 1, 'completed', '{}', '[]')"))
    engine.dispose()
    db = _open(store_url)
    try:
        with db.engine.connect() as c:
            assert c.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0002"
        with db.read() as s:
            assert s.query(Run).one().owner is None
            assert s.query(ResponseRow).one().cancel_requested is False
        assert db.expire_unfinished_runs() == 1  # written by a server that is gone
    finally:
        db.close()


def test_adopts_an_unversioned_file(tmp_path):
    """A SQLite file from before the schema was versioned (tables, no version table) is migrated."""
    from sqlalchemy import text

    engine = _upgrade_to((str(tmp_path), None), "0001")
    with engine.begin() as c:
        c.execute(text("DROP TABLE alembic_version"))
        c.execute(text("INSERT INTO conversations (id, created_at, metadata) VALUES ('conv_old', 1, '{}')"))
    engine.dispose()
    db = _open((str(tmp_path), None))
    try:
        from ktransformers.server.responses_store import ConversationRow

        with db.read() as s:
            assert s.query(ConversationRow).one().id == "conv_old"
    finally:
        db.close()


def test_a_newer_schema_is_refused_in_one_line(store_url):
    from sqlalchemy import text

    from ktransformers.errors import ConfigError

    db = _open(store_url)
    with db.engine.begin() as c:
        c.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    db.close()
    with pytest.raises(ConfigError) as e:
        _open(store_url)
    msg = str(e.value)
    assert "9999_future" in msg and "upgrade ktransformers" in msg and "\n" not in msg and PASSWORD not in msg


# ---- several processes --------------------------------------------------------------------

def test_several_processes_writing_at_once_lose_nothing_and_start_one_run_per_thread(store_url):
    """4 processes x 50 appends to one conversation: all 200 there, each process's in its order; then
    the 4 race to start a run on the same threads: exactly one wins each (the thread's row lock)."""
    from ktransformers.server.db import Assistant, Run, Thread
    from ktransformers.server.responses_store import ConversationRow, conversation_items

    from .store_workers import write_and_race

    threads = [f"thread_{i}" for i in range(10)]
    db = _open(store_url)
    with db.write() as s:
        s.add(ConversationRow(id="conv_shared", created_at=0, meta={}))
        s.add(Assistant(id="asst_1", created_at=0, model="m"))
        for t in threads:
            s.add(Thread(id=t, created_at=0, meta={}))
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=write_and_race, args=(store_url, w, 50, threads, barrier, results))
             for w in range(4)]
    for p in procs:
        p.start()
    won = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * 4
    with db.read() as s:
        items = conversation_items(s, "conv_shared")
        runs = sorted(r.thread_id for r in s.query(Run))
    db.close()
    assert len(items) == 200 and len({it["id"] for it in items}) == 200
    for w in range(4):
        assert [it["i"] for it in items if it["w"] == w] == list(range(50))
    assert sum(won) == len(threads) and runs == sorted(threads)


# ---- two servers sharing the database ----------------------------------------------------

def test_two_servers_share_conversations_responses_and_threads(postgres, make_engine, tmp_path):  # noqa: F811
    """What a client created through server A is read and continued through server B."""
    from fastapi.testclient import TestClient

    from ktransformers.server import Settings, create_app

    from .conftest import MODEL_NAME

    url = postgres.new_database()
    apps = [create_app(make_engine(), Settings(data_dir=str(tmp_path / n), database_url=url)) for n in "ab"]
    with TestClient(apps[0], base_url="http://127.0.0.1") as a, TestClient(apps[1], base_url="http://127.0.0.1") as b:
        conv = a.post("/v1/conversations", json={"items": [{"type": "message", "role": "user",
                                                              "content": "remember me"}]}).json()
        r1 = a.post("/v1/responses", json={"model": MODEL_NAME, "input": "hello", "conversation": conv["id"],
                                           "max_output_tokens": 3}).json()
        assert r1["status"] in ("completed", "incomplete")
        assert b.get(f"/v1/conversations/{conv['id']}").json()["id"] == conv["id"]
        assert b.get(f"/v1/responses/{r1['id']}").json()["output"] == r1["output"]
        r2 = b.post("/v1/responses", json={"model": MODEL_NAME, "input": "again", "conversation": conv["id"],
                                           "max_output_tokens": 3}).json()
        assert r2["usage"]["input_tokens"] > r1["usage"]["input_tokens"]  # A's turn was in B's prompt
        items = a.get(f"/v1/conversations/{conv['id']}/items", params={"order": "asc"}).json()["data"]
        assert [i["role"] for i in items] == ["user", "user", "assistant", "user", "assistant"]
        r3 = b.post("/v1/responses", json={"model": MODEL_NAME, "input": "go on", "previous_response_id": r1["id"],
                                           "max_output_tokens": 2}).json()
        assert r3["status"] in ("completed", "incomplete")
        assert a.get(f"/v1/responses/{r3['id']}").json()["previous_response_id"] == r1["id"]

        beta = {"OpenAI-Beta": "assistants=v2"}
        asst = a.post("/v1/assistants", json={"model": MODEL_NAME}, headers=beta).json()
        thread = a.post("/v1/threads", json={"messages": [{"role": "user", "content": "hi"}]}, headers=beta).json()
        run = b.post(f"/v1/threads/{thread['id']}/runs", json={"assistant_id": asst["id"],
                                                               "max_completion_tokens": 2}, headers=beta).json()
        got = _wait_status(a, f"/v1/threads/{thread['id']}/runs/{run['id']}", beta)
        assert got["status"] in ("completed", "incomplete")
        msgs = a.get(f"/v1/threads/{thread['id']}/messages", params={"order": "asc"}, headers=beta).json()["data"]
        assert [m["role"] for m in msgs] == ["user", "assistant"]
    for app in apps:
        app.state.db.close()


def _wait_status(client, path: str, headers=None, *, until=("queued", "in_progress", "cancelling")) -> dict:
    import time

    for _ in range(300):
        got = client.get(path, headers=headers).json()
        if got["status"] not in until:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{path} still {got['status']}")


def test_cancel_through_another_server(postgres, make_engine, tmp_path, monkeypatch):  # noqa: F811
    """A background response and a run generated by server A, cancelled through server B: A stops
    them at its next save and B answers with the final state."""
    from fastapi.testclient import TestClient

    from ktransformers.server import Settings, assistants_api, create_app, responses_api

    for module in (assistants_api, responses_api):  # a save each token: the cancel is seen at once
        monkeypatch.setattr(module, "_SAVE_EVERY_S", 0.0)

    from .conftest import MODEL_NAME

    url = postgres.new_database()
    apps = [create_app(make_engine(), Settings(data_dir=str(tmp_path / n), database_url=url)) for n in "ab"]
    beta = {"OpenAI-Beta": "assistants=v2"}
    with TestClient(apps[0], base_url="http://127.0.0.1") as a, \
            TestClient(apps[1], base_url="http://127.0.0.1") as b:
        r = a.post("/v1/responses", json={"model": MODEL_NAME, "input": "long", "background": True,
                                          "max_output_tokens": 1800}).json()
        _wait_status(a, f"/v1/responses/{r['id']}", until=("queued",))
        got = b.post(f"/v1/responses/{r['id']}/cancel").json()
        assert got["status"] == "cancelled", got["status"]
        assert a.get(f"/v1/responses/{r['id']}").json()["status"] == "cancelled"

        asst = a.post("/v1/assistants", json={"model": MODEL_NAME}, headers=beta).json()
        thread = a.post("/v1/threads", json={"messages": [{"role": "user", "content": "hi"}]}, headers=beta).json()
        run = a.post(f"/v1/threads/{thread['id']}/runs", json={"assistant_id": asst["id"],
                                                               "max_completion_tokens": 1800}, headers=beta).json()
        path = f"/v1/threads/{thread['id']}/runs/{run['id']}"
        _wait_status(a, path, beta, until=("queued",))
        assert b.post(path + "/cancel", headers=beta).json()["status"] == "cancelling"  # A still generates it
        done = _wait_status(b, path, beta)
        assert done["status"] == "cancelled"
    for app in apps:
        app.state.db.close()


# ---- bad URLs -----------------------------------------------------------------------------

@pytest.fixture
def keep_server_logging():
    """``main`` points the ``ktransformers`` logger at its data folder: give the other tests theirs back."""
    import logging

    logger = logging.getLogger("ktransformers")
    handlers, level = logger.handlers[:], logger.level
    yield
    for h in logger.handlers:
        if h not in handlers:
            h.close()
    logger.handlers[:], logger.level = handlers, level


@pytest.mark.parametrize("case", ["scheme", "garbage", "no_database", "unreachable", "credentials",
                                  "missing_database"])
def test_bad_database_url_is_one_line_at_start(case, postgres, tmp_path, capsys, keep_server_logging):  # noqa: F811
    """Before any model is loaded, ``main`` prints one ``error:`` line (no password) and exits 2."""
    from ktransformers.server.main import main

    from .conftest import free_port

    good = postgres.url("postgres")
    url = {"scheme": f"mysql://kt:{PASSWORD}@127.0.0.1/db", "garbage": f"{PASSWORD}@@::",
           "no_database": good.rsplit("/", 1)[0] + "/",
           "unreachable": good.replace(f":{postgres.port}/", f":{free_port()}/"),
           "credentials": postgres.url("postgres", password="wrong-" + PASSWORD),
           "missing_database": good.rsplit("/", 1)[0] + "/no_such_db"}[case]
    data = tmp_path / "data"
    rc = main(["--model_path", str(tmp_path), "--data_dir", str(data), "--port", str(free_port()),
               "--database_url", url])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: --database_url") and "\n" not in err, err
    assert PASSWORD not in err and "Traceback" not in err
    expect = {"scheme": "not served", "garbage": "not a database URL", "no_database": "names no database",
              "unreachable": "cannot open it", "credentials": "password authentication failed",
              "missing_database": "does not exist"}[case]
    assert expect in err, err
    log = data / "logs" / "server.log"
    assert not log.exists() or PASSWORD not in log.read_text()


def test_without_the_driver_the_url_says_what_to_install(monkeypatch):
    import sys

    from ktransformers.errors import ConfigError
    from ktransformers.server.db import parse_database_url

    monkeypatch.setitem(sys.modules, "psycopg", None)  # as where the extra is not installed
    with pytest.raises(ConfigError) as e:
        parse_database_url(f"postgresql://kt:{PASSWORD}@127.0.0.1/kt")
    assert "pip install 'ktransformers[scale-out]'" in str(e.value) and PASSWORD not in str(e.value)
