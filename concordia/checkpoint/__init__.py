"""The checkpoint pipeline behind `concordia.Session.checkpoint()`.

    epoch     the epoch runner (`EpochRunner`): routes, cached stagers and
              region table, one epoch from the producers' streams to the
              commit the session hands in
    detect    every dirty-page detector once, with one shadow diff
    table     the region table (one row per region) and the plan of an
              epoch's records over it
    staging   records cut from dirty pages, packed into extents, the host path
              and the per-region extent pipeline that drives a kernel set
    device    the CuPy kernel set (detect, compact, stage, CRC tables, digests),
              the device table pass, and the one ordering point
              (`order_after_producer`)
    host      the numpy twins of the device kernel set and of the table pass
    stats     what a checkpoint did (`CheckpointStats`)

The regions and their baselines belong to the `regions.RegionSet` the runner
is given; the commit is a callable; this package never imports the session.
"""
