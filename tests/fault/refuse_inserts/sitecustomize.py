"""Test-only fault injection, loaded by the analytics app's interpreter when a test puts this
directory first on its PYTHONPATH: while the file named by REFUSE_INSERTS_FLAG exists, every
clickhouse-connect insert raises, as a store that is down, read-only or out of disk would.

Queries still run (analysts may read during an outage); only writes fail, at the client seam the
sink uses, so the production code under test is unchanged.
"""
import os

_FLAG = os.environ.get("REFUSE_INSERTS_FLAG")

if _FLAG:
    from clickhouse_connect.driver._backendclient import SyncBackendClient as Client

    def _refusing(insert):
        def refusing_insert(self, *args, **kwargs):
            if os.path.exists(_FLAG):
                raise ConnectionError(f"test fault: the store refuses inserts while {os.path.basename(_FLAG)} exists")
            return insert(self, *args, **kwargs)
        return refusing_insert

    # both seams the sink writes through: its Python columns (`insert`) and its native batches' bytes (`raw_insert`)
    Client.insert = _refusing(Client.insert)
    Client.raw_insert = _refusing(Client.raw_insert)
