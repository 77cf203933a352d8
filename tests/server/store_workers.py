"""What each process of the shared-store tests runs (a module of its own: spawned processes import
only this, not the test modules and their fixtures)."""

from __future__ import annotations


def write_and_race(store_url, worker: int, n_items: int, thread_ids, barrier, results) -> None:
    """Append ``n_items`` items to ``conv_shared`` one transaction each, then try to start a run on
    every thread of ``thread_ids`` at the same moment as the other processes; report the runs won."""
    from ktransformers.server.assistants_api import start_run
    from ktransformers.server.db import Database
    from ktransformers.server.errors import APIError
    from ktransformers.server.responses_store import add_conversation_items
    from ktransformers.server.schemas import RunCreate

    db = Database(store_url[0], url=store_url[1])
    barrier.wait()
    for i in range(n_items):
        with db.write() as s:
            add_conversation_items(s, "conv_shared", [{"id": f"item_{worker}_{i}", "w": worker, "i": i}])
    won = 0
    for tid in thread_ids:
        barrier.wait()
        try:
            start_run(db, tid, RunCreate(assistant_id="asst_1"))
            won += 1
        except APIError as e:
            if "already has an active run" not in e.message:
                raise
    results.put(won)
    db.close()
