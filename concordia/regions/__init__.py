"""The model of what a session protects.

    arrays     numpy, CuPy, PyTorch and ml_dtypes, in (`adapt`) and out (`present`)
    region     one array and its checkpoint state (`Region`, `KINDS`, `DETECTORS`)
    registry   the regions of one session and the one owner of their baselines (`RegionSet`)
    streams    the order of Concordia's device work against the caller's streams (`StreamOrder`)
    errors     the runtime's error classes

Nothing is imported here: `concordia.errors` loads `regions.errors` without
the rest.
"""
