"""Nereus storage: the Arrow-backed EMU store and the run's metrics tables.

It imports pyarrow and nereus_core types, never prefect or dask. The run
directory it writes is documented field by field in storage/FORMAT.md.
"""
