# EXPERIMENT ONLY: drain without wait_first per message
import asyncio
from faust.transport.consumer import Consumer
async def _drain_messages(self, fetcher):
    callback = self.callback
    getmany = self.getmany
    consumer_should_stop = self._stopped.is_set
    fetcher_should_stop = fetcher._stopped.is_set
    get_read_offset = self._read_offset.__getitem__
    set_read_offset = self._read_offset.__setitem__
    commit_every = self._commit_every
    sleep = asyncio.sleep
    n = 0
    while not (consumer_should_stop() or fetcher_should_stop()):
        ait = getmany(timeout=1.0)
        await self.sleep(0)
        if not self.should_stop:
            async for tp, message in ait:
                n += 1
                if n > 100:
                    await sleep(0); n = 0
                offset = message.offset
                r_offset = get_read_offset(tp)
                if r_offset is None or offset >= r_offset:
                    if commit_every is not None and self._n_acked >= commit_every:
                        self._n_acked = 0
                        await self.commit()
                    await callback(message)
                    set_read_offset(tp, offset)
Consumer._drain_messages = _drain_messages
