"""What the engine integrations share, whatever the engine.

* :mod:`.settings`: ``KVCACHED_ENABLE`` and the engine-facing environment settings;
* :mod:`.devices`: which kvcached device an engine's torch device is;
* :mod:`.geometry`: an engine's KV cache in kvcached's terms (:class:`KVGeometry`);
* :mod:`.blocks`: the engine side, block ids from a kvcached block manager (:class:`EngineBlocks`);
* :mod:`.space`: the tensor side in processes that do not decide (:class:`WorkerSpace`);
* :mod:`.registration`: entering the per-device registry (``kvctl``, ``kvtop``).

Each engine keeps its version-specific code in its own subpackage.
"""
