"""Replays: what was delivered or set aside, handed to a trigger's handler again.

:mod:`~dbtrigger.replay.batches` replays a recorded batch of the durable
history (:mod:`dbtrigger.history`) through a poller's handler, without moving
the live checkpoint (``dbtrigger replay``); :mod:`~dbtrigger.replay.dead_letters`
lists, replays and discards dead-lettered events, marking what became of each
beside the sink (``dbtrigger dead-letter``). Both stand on the runtime (the
handler call, the batch context) and on the history, which the runtime writes
below them.
"""
