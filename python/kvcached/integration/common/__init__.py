"""What the engine integrations share, whatever the engine.

* :mod:`.settings`: the engine-facing options (``KVCACHED_ENABLE``, name, limit, ...);
* :mod:`.rank_devices`: which physical device each rank uses (:class:`RankDevice`);
* :mod:`.engine_layout`: an engine's KV cache as one :class:`kvcached.KVLayout`;
* :mod:`.engine_log`: integration log records also in the engine's log stream;
* :mod:`.registration`: one registry entry per rank, in its device's registry;
* :mod:`.blocks`: the engine side, block ids from a kvcached block manager (:class:`EngineBlocks`);
* :mod:`.space`: the tensor side in processes that do not decide (:class:`WorkerSpace`);
* :mod:`.acks` and :mod:`.mirrors`: every rank's acknowledgements, dead or stalled ranks.

Each engine keeps its version-specific code in its own subpackage.
"""
