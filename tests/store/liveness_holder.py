"""A replica's liveness, held by a separate process the tests can SIGKILL or SIGSTOP.

    python -m tests.store.liveness_holder DATABASE_URL REPLICA_ID

Takes the liveness lock, registers as a replica, prints "held" and sleeps until killed.
"""

from __future__ import annotations

import asyncio
import os
import sys

from toolledger.store.engine import create_engine
from toolledger.store.exclusive import SQLiteServiceLock
from toolledger.store.liveness import liveness_for
from toolledger.store.sessions import SessionStore


async def main(database_url: str, replica_id: str) -> None:
    engine = create_engine(database_url)
    serve_lock = SQLiteServiceLock(database_url)
    serve_lock.acquire()
    liveness = liveness_for(engine, replica_id, serve_lock)
    await liveness.hold()
    await SessionStore(engine).heartbeat_replica(
        replica_id, hostname="test", pid=os.getpid(), lease_seconds=30
    )
    print("held", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
