"""The checkpoint pipeline behind `concordia.Session.checkpoint()`.

    staging   records cut from dirty pages, packed into extents, the host path
              and the extent pipeline that drives a kernel set
    device    the CuPy kernel set (detect, compact, stage, CRC tables, digests)
    host      the numpy twins of the device kernel set

`Session` owns the regions and the commit; this package turns one epoch's
dirty pages into records in reserved log space.
"""
