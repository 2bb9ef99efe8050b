"""Prefect tasks of Nereus, and the Dask glue they run on.

Dask appears only in ``tasks.runtime.device_pool`` (the pool of workers and the
torch.distributed world over them) and ``tasks.runtime.device_actor`` (the per-worker
holder of one device slot). Import them from there; this package does not
re-export them, so that importing a Prefect task module stays cheap.
"""
