"""In-memory distributed datasets: caches of Arrow record batches, held by long-lived
servers, partitioned over nodes, read where they lie.

``clusterflow cache create NAME --from URL --partitions N`` loads a dataset (Parquet,
Arrow IPC or CSV from any fsspec URL) into partitions held in shared memory by cache
servers (``server.py``): daemons under ``$CLUSTERFLOW_HOME`` on the local backend
(``local.py``), one actor per node on Ray (``ray_nodes.py``). Jobs read it with
``distributed_dataset("cache://NAME", ...)`` (``clusterflow.data.cache_source``): local
partitions through the shared memory without a copy, others over the wire.
``clusterflow start --cache NAME`` places the workers on the partitions' nodes.

The map of partitions is ``clusterflow.data.cache_map`` (the data service reads it for
locality); planning is pure (``plan.py``); loading and holding is ``store.py``.
"""
