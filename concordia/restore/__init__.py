"""Restore: turning a log's plan back into arrays.

    run      the one recover entry (target checks, plan, host or device applier)
    device   the device pipeline: log -> pinned staging -> copy engine -> scatter
             kernel, every page CRC-checked on the device
"""
