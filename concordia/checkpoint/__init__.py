"""The checkpoint pipeline behind `concordia.Session.checkpoint()`.

    table     the region table (one row per region) and the plan of an
              epoch's records over it
    staging   records cut from dirty pages, packed into extents, the host path
              and the per-region extent pipeline that drives a kernel set
    device    the CuPy kernel set (detect, compact, stage, CRC tables, digests),
              the device table pass, and the one ordering point
              (`order_after_producer`)
    host      the numpy twins of the device kernel set and of the table pass

`Session` owns the regions and the commit; this package turns one epoch's
dirty pages into records in reserved log space.
"""
